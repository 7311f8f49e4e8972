"""Gallery index benchmarks.

1. Indexing throughput: end-to-end ``build_index`` images/s (decode in threads + embed + shards + faiss)
   against the embedder alone on already-preprocessed batches (target ratio >= 0.9).
2. Search: build time, tuned parameters, 1-recall@1, 10-recall@10 against exact search and p50/p99
   single-query latency of each index type on random unit vectors.
3. Read path: ``Index.open`` and single-query ``Index.search`` (faiss + catalogue rows) on a Flat index folder,
   optionally against another checkout of the code (``--against DIR``, e.g. ``git archive main | tar -x -C DIR``):
   each round runs both in fresh processes, one after the other; the ratio of their best rounds is reported.

    .venv/bin/python benchmarks/index.py throughput --images 1024 --rounds 5
    .venv/bin/python benchmarks/index.py search --n 1000000 --dim 128
    .venv/bin/python benchmarks/index.py read --n 20000 --against /tmp/before --rounds 3

4. Ray engine against the local engine: end-to-end ``build_index`` images/s of both on the same gallery,
   interleaved rounds, on a local Ray cluster started once (target ratio ray / local >= 0.85).
5. The Ray engine's IVF path from precomputed embeddings: parquet shards -> train on a sample -> per-shard
   add in Ray tasks -> merge; time of each step, the driver's peak RSS, recall against exact search.

    .venv/bin/python benchmarks/index.py ray-throughput --images 2000 --rounds 3
    .venv/bin/python benchmarks/index.py ray-ivf --n 1000000 --dim 128
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def throughput(args: argparse.Namespace) -> dict:
    import torch

    from retrieval.data.synthetic import write_digits
    from retrieval.export import export_embedder
    from retrieval.index import IngestOptions, build_index, load_model
    from retrieval.models import create_embedder

    work = Path(tempfile.mkdtemp(prefix="bench-index-"))
    torch.manual_seed(0)
    model = create_embedder(args.backbone, embedding_dim=128, pretrained=False).eval()
    export_embedder(model, work / "model.onnx", verify=False, log=lambda m: None)
    embedder = load_model(work / "model.onnx")
    write_digits(work / "gallery", args.images)
    size = embedder.preprocessing.input_size
    batch = np.random.default_rng(0).standard_normal((args.batch_size, 3, size, size)).astype(np.float32)
    embedder.embed(batch)  # warm-up
    alone, end_to_end, cpu_ms = [], [], []
    for round_number in range(args.rounds):  # interleaved, so that both see the same machine state
        start = time.perf_counter()
        for _ in range(args.images // args.batch_size):
            embedder.embed(batch)
        alone.append((args.images // args.batch_size) * args.batch_size / (time.perf_counter() - start))
        start, cpu_start = time.perf_counter(), own_cpu_seconds()
        build_index(
            work / "gallery",
            work / f"idx{round_number}",
            embedder=embedder,
            index_key="Flat",
            options=IngestOptions(batch_size=args.batch_size, workers=args.workers, progress=False),
        )
        end_to_end.append(args.images / (time.perf_counter() - start))
        cpu_ms.append(1000 * (own_cpu_seconds() - cpu_start) / args.images)
    ratios = [e / a for a, e in zip(alone, end_to_end, strict=True)]
    return {
        "backbone": args.backbone,
        "input_size": size,
        "images": args.images,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "rounds": args.rounds,
        "embedder_alone_img_s": [round(v, 1) for v in alone],
        "end_to_end_img_s": [round(v, 1) for v in end_to_end],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(float(np.median(ratios)), 3),
        # what the build cost in CPU, its decoding threads included: unlike img/s, other load on the machine moves it
        # little
        "end_to_end_cpu_ms_per_img": [round(v, 2) for v in cpu_ms],
    }


def own_cpu_seconds() -> float:
    """CPU seconds of this process (its decoding threads included) and its ended child processes."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def busy_cpu_seconds() -> float:
    """CPU seconds this machine spent busy (all cores, every process, ended ones too), from /proc/stat (Linux)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def ray_throughput(args: argparse.Namespace) -> dict:
    import ray
    import torch

    from retrieval.data.synthetic import write_digits
    from retrieval.export import export_embedder
    from retrieval.index import IngestOptions, build_index
    from retrieval.index.embedding.engine import RayOptions
    from retrieval.models import create_embedder

    work = Path(tempfile.mkdtemp(prefix="bench-ray-"))
    torch.manual_seed(0)
    model = create_embedder(args.backbone, embedding_dim=128, pretrained=False).eval()
    model.config = model.config.with_fields({"input_size": args.input_size})
    export_embedder(model, work / "model.onnx", verify=False, log=lambda m: None)
    write_digits(work / "gallery", min(args.images, 1700))
    # sklearn has ~1,790 distinct digits: the rest are mirrored and rotated copies (7 per digit, up to 13,600)
    from PIL import Image

    originals = sorted((work / "gallery").rglob("*.png"))
    variants = [(op, path) for op in Image.Transpose for path in originals]
    for i, (op, path) in enumerate(variants[: args.images - len(originals)]):
        Image.open(path).transpose(op).save(path.with_name(f"{op.name.lower()}_{i:05d}.png"))
    count = sum(1 for _ in (work / "gallery").rglob("*.png"))
    if count != args.images:
        most = (1 + len(Image.Transpose)) * len(originals)
        raise SystemExit(f"the gallery has {count} images, not {args.images} (at most {most})")
    # the cluster starts once (as a `ray start` cluster would be running); 3 logical CPUs on 2 cores: an actor
    # with 2 onnxruntime threads plus a decode task, as the local engine runs 2 threads plus a decode worker
    started = time.perf_counter()
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    cluster_start = time.perf_counter() - started
    local_options = IngestOptions(batch_size=args.batch_size, workers=args.workers, progress=False)
    ray_options = IngestOptions(
        batch_size=args.batch_size,
        progress=False,
        engine="ray",
        ray=RayOptions(address="auto", actors=1, cpus_per_actor=args.cpus_per_actor),
    )
    import contextlib
    import io
    import re

    local, ray_rates, ray_after_start, indexed = [], [], [], set()
    cpu: dict[str, list[float]] = {"local": [], "ray": []}
    for round_number in range(args.rounds):  # interleaved, so that both see the same machine state
        for name, options, rates in (("local", local_options, local), ("ray", ray_options, ray_rates)):
            log = io.StringIO()
            busy = busy_cpu_seconds()
            start = time.perf_counter()
            with contextlib.redirect_stderr(log):
                summary = build_index(
                    work / "gallery", work / f"{name}{round_number}", model=work / "model.onnx", index_key="Flat",
                    options=options,
                )
            seconds = time.perf_counter() - start
            cpu[name].append(round(busy_cpu_seconds() - busy, 2))
            rates.append(summary["indexed"] / seconds)
            indexed.add(summary["indexed"])  # byte-identical copies are catalogued once, by both engines
            startup = re.search(r"ray: first embeddings after ([\d.]+) s", log.getvalue())
            if startup:  # the rate once the workers run (the first batch's images left out)
                first = float(startup.group(1))
                ray_after_start.append((summary["indexed"] - args.batch_size) / (seconds - first))
            print(name, round(rates[-1], 1), startup and startup.group(0), cpu[name][-1], file=sys.stderr, flush=True)
    ray.shutdown()
    ratios = [r / lo for lo, r in zip(local, ray_rates, strict=True)]
    return {
        "backbone": args.backbone,
        "input_size": args.input_size,
        "images": args.images,
        "indexed": sorted(indexed),
        "batch_size": args.batch_size,
        "local_workers": args.workers,
        "ray_cpus": args.ray_cpus,
        "ray_cpus_per_actor": args.cpus_per_actor,
        "cluster_start_s": round(cluster_start, 1),
        "local_img_s": [round(v, 1) for v in local],
        "ray_img_s": [round(v, 1) for v in ray_rates],
        "ratios": [round(r, 3) for r in ratios],
        "median_ratio": round(float(np.median(ratios)), 3),
        "ray_after_startup_img_s": [round(v, 1) for v in ray_after_start],
        "cpu_seconds_per_round": cpu,
        "median_ratio_after_ray_startup": round(
            float(np.median([r / lo for lo, r in zip(local, ray_after_start, strict=True)])), 3
        ),
    }


def ray_ivf(args: argparse.Namespace) -> dict:
    import dataclasses
    import resource

    import ray

    from retrieval.index.catalogue import Catalogue, Outcome
    from retrieval.index.embedding.engine import RayOptions
    from retrieval.index.embedding.ray_engine import RayEngine
    from retrieval.index.faiss_backend import faiss_keys, faiss_measure
    from retrieval.index.faiss_backend.faiss_build import build_faiss
    from retrieval.index.layout import IndexLayout
    from retrieval.index.shards import ShardStore
    from retrieval.index.sources import GalleryItem

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((args.clusters, args.dim)).astype(np.float32)
    layout = IndexLayout(tempfile.mkdtemp(prefix="bench-ray-ivf-"))
    steps = {}
    start = time.perf_counter()
    catalogue = Catalogue(layout.catalogue)
    catalogue.plan([GalleryItem(f"/v/{i}.jpg", None) for i in range(args.n)])
    store = ShardStore(layout.shards)
    for first in range(0, args.n, args.shard_size):
        ids = np.arange(first + 1, min(first + args.shard_size, args.n) + 1)  # SQLite ids start at 1
        x = centres[rng.integers(0, args.clusters, len(ids))] + args.noise * rng.standard_normal((len(ids), args.dim))
        x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
        outcomes = [Outcome(int(i), "done", f"{i:064x}", 1) for i in ids]
        name = store.write_parquet(ids, x, outcomes, {int(i): f"/v/{i - 1}.jpg" for i in ids})
        catalogue.record([dataclasses.replace(o, shard=name) for o in outcomes])
    steps["shards_s"] = round(time.perf_counter() - start, 1)
    ray.init(address="local", num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False)
    engine = RayEngine(RayOptions(address="auto", merge_on_disk=args.on_disk or None))
    policy = dataclasses.replace(faiss_keys.AUTO_POLICY, max_train=args.train)
    start = time.perf_counter()
    with engine:
        built = build_faiss(
            layout, catalogue, store, args.key, args.dim, policy=policy, add_vectors=engine.add_vectors
        )
    steps["train_add_merge_tune_s"] = round(time.perf_counter() - start, 1)
    ray.shutdown()
    # held-out queries from the same distribution against exact search over every shard
    queries = centres[rng.integers(0, args.clusters, args.queries)] + args.noise * rng.standard_normal(
        (args.queries, args.dim)
    )
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    done = catalogue.done_shards()
    from retrieval.index.search import Index
    from retrieval.index.vectors import done_chunks

    _, exact = faiss_measure.exact_knn(queries, done_chunks(store, done), 10)
    catalogue.set_meta(state="complete")
    layout.write_info({"model_hash": "bench", "embedding_dim": args.dim, "model_path": None} | built)
    with Index.open(layout.root) as index:
        _, found = index.search_arrays(queries, 10)
    catalogue.close()
    return {
        "n": args.n,
        "dim": args.dim,
        "shard_size": args.shard_size,
        "index_key": built["index_key"],
        "params": built["params"],
        "train_sample": args.train,
        **steps,
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "tuning_recall_10_at_10": built["tuning"]["recall_10_at_10"],
        "heldout_recall_10_at_10": round(faiss_measure.recall_at(found, exact, 10, 10), 4),
        "queries": args.queries,
        "size_on_disk": layout.size_on_disk(),
    }


def search(args: argparse.Namespace) -> dict:
    import faiss

    from retrieval.index.faiss_backend import faiss_keys, faiss_measure, faiss_tuning

    rng = np.random.default_rng(0)
    gallery = rng.standard_normal((args.n, args.dim)).astype(np.float32)
    gallery /= np.linalg.norm(gallery, axis=1, keepdims=True)
    queries = rng.standard_normal((args.queries, args.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = np.arange(args.n, dtype=np.int64)
    start = time.perf_counter()
    _, exact = faiss_measure.exact_knn(queries, [(ids, gallery)], 10)
    results = {
        "n": args.n,
        "dim": args.dim,
        "queries": args.queries,
        "threads": faiss.omp_get_max_threads(),
        "exact_ground_truth_s": round(time.perf_counter() - start, 1),
        "indexes": {},
    }
    # half the queries tune the search parameters, the other half measure them
    tune_q, test_q = queries[: args.queries // 2], queries[args.queries // 2 :]
    tune_exact, test_exact = exact[: args.queries // 2], exact[args.queries // 2 :]
    for key in args.keys:
        key = faiss_keys.expand_key(key, args.n, args.dim)
        start = time.perf_counter()
        index = faiss_keys.new_index(key, args.dim)
        if not index.is_trained:
            index.train(gallery[rng.choice(args.n, min(args.n, args.train), replace=False)])
        index.add_with_ids(gallery, ids)
        built = time.perf_counter() - start
        tuning = faiss_tuning.tune_search_params(index, tune_q, tune_exact, 0.95)
        _, found = index.search(test_q, 10)
        latency = faiss_measure.latency_ms(lambda q, index=index: index.search(q, 10), test_q)
        row = {
            "build_s": round(built, 1),
            "params": tuning.params,
            "target_met_on_tuning": tuning.target_met,
            "recall_1_at_1": round(faiss_measure.recall_at(found, test_exact, 1, 1), 4),
            "recall_10_at_10": round(faiss_measure.recall_at(found, test_exact, 10, 10), 4),
            **{k: round(v, 3) for k, v in latency.items()},
        }
        results["indexes"][key] = row
        print(key, json.dumps(row), file=sys.stderr, flush=True)
    return results


def write_vector_index(folder: Path, n: int, dim: int, key: str = "Flat", clusters: int = 0) -> Path:
    """An index folder (faiss ``key``, default Flat) over ``n`` random unit vectors (catalogue rows, shards, faiss,
    index.json); with ``clusters``, around that many centres (as embeddings of many classes are), else uniform."""
    import dataclasses

    from retrieval.index.catalogue import Catalogue, Outcome
    from retrieval.index.faiss_backend.faiss_build import build_faiss
    from retrieval.index.layout import IndexLayout
    from retrieval.index.shards import ShardStore
    from retrieval.index.sources import GalleryItem

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    if clusters:
        centres = rng.standard_normal((clusters, dim)).astype(np.float32)
        centres /= np.linalg.norm(centres, axis=1, keepdims=True)
        vectors = centres[rng.integers(0, clusters, n)] + vectors * (0.6 / np.sqrt(dim))
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    layout = IndexLayout(folder)
    folder.mkdir(parents=True)
    store = ShardStore(layout.shards)
    with Catalogue(layout.catalogue) as catalogue:
        catalogue.plan([GalleryItem(f"/gallery/class{i % 100}/{i}.png", f"class{i % 100}") for i in range(n)])
        for start in range(0, n, 4096):
            ids = np.arange(start + 1, min(start + 4096, n) + 1)  # SQLite ids start at 1
            outcomes = [Outcome(int(i), "done", f"{i:064x}", 1) for i in ids]
            name = store.write(ids, vectors[ids - 1], outcomes)
            catalogue.record([dataclasses.replace(o, shard=name) for o in outcomes])
        catalogue.set_meta(model_hash="bench", embedding_dim=str(dim), index_key=key)
        built = build_faiss(layout, catalogue, store, key, dim)
        catalogue.set_meta(state="complete")
    layout.write_info({"params": {}, "embedding_dim": dim, "model_hash": "bench"} | built)
    return folder


def read_once(args: argparse.Namespace) -> dict:
    """Open the index, then time single-query searches (k = 10) of random unit vectors (this process's code)."""
    from retrieval.index import Index

    queries = np.random.default_rng(1).standard_normal((args.queries, args.dim)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    start = time.perf_counter()
    index = Index.open(args.index)
    opened = time.perf_counter() - start
    for query in queries[:50]:  # warm-up
        index.search(query, 10)
    times = []
    for query in queries:
        start = time.perf_counter()
        index.search(query, 10)
        times.append((time.perf_counter() - start) * 1e3)
    index.close()
    return {"open_ms": opened * 1e3, "p50_ms": float(np.percentile(times, 50)),
            "p99_ms": float(np.percentile(times, 99)), "mean_ms": float(np.mean(times))}  # fmt: skip


def read(args: argparse.Namespace) -> dict:
    """The read path of this checkout, and of ``--against`` if given, in alternating fresh processes."""
    work = Path(tempfile.mkdtemp(prefix="bench-read-"))
    index = write_vector_index(work / "idx", args.n, args.dim)
    codes = {"this": str(Path(__file__).resolve().parents[1])} | ({"against": args.against} if args.against else {})
    runs: dict[str, list[dict]] = {name: [] for name in codes}
    for _ in range(args.rounds):
        for name, code in codes.items():
            command = [sys.executable, __file__, "read", "--code", code, "--index", str(index),
                       "--dim", str(args.dim), "--queries", str(args.queries)]  # fmt: skip
            output = subprocess.run(command, check=True, capture_output=True, text=True, cwd=code).stdout
            runs[name].append(json.loads(output))
    result: dict = {"n": args.n, "dim": args.dim, "queries": args.queries, "rounds": args.rounds}
    for name, rows in runs.items():
        # the best round of each: other jobs on a shared machine only ever add time
        result[name] = {key: round(float(np.min([r[key] for r in rows])), 4) for key in rows[0]}
    if args.against:
        result["ratio_this_over_against"] = {
            key: round(result["this"][key] / result["against"][key], 3) for key in result["this"]
        }
    return result


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("throughput")
    t.add_argument("--images", type=int, default=256)
    t.add_argument("--batch-size", type=int, default=32)
    t.add_argument("--workers", type=int, default=None, help="decoding threads (default: the build's own)")
    t.add_argument("--rounds", type=int, default=5, help="interleaved alone / end-to-end rounds (median reported)")
    t.add_argument("--backbone", default="resnet18")
    s = sub.add_parser("search")
    s.add_argument("--n", type=int, default=1_000_000)
    s.add_argument("--dim", type=int, default=128)
    s.add_argument("--queries", type=int, default=1000)
    s.add_argument("--train", type=int, default=100_000)
    s.add_argument(
        "--keys", nargs="+", default=["Flat", "HNSW32", "IVF{K},Flat", "IVF{K},SQ8", "IVF{K},PQ{m}"]
    )
    r = sub.add_parser("read")
    r.add_argument("--n", type=int, default=20_000)
    r.add_argument("--dim", type=int, default=64)
    r.add_argument("--queries", type=int, default=2000)
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--against", help="another checkout of the code (its root folder) to compare with")
    r.add_argument("--code", help=argparse.SUPPRESS)  # internal: time this checkout's code on --index
    r.add_argument("--index", help=argparse.SUPPRESS)
    r = sub.add_parser("ray-throughput")
    r.add_argument("--images", type=int, default=2000)
    r.add_argument("--batch-size", type=int, default=64)
    r.add_argument("--workers", type=int, default=1, help="the local engine's decode workers")
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--backbone", default="efficientnet_lite0")
    r.add_argument("--input-size", type=int, default=128)
    r.add_argument("--ray-cpus", type=int, default=3, help="logical CPUs of the local Ray cluster")
    r.add_argument("--cpus-per-actor", type=float, default=2.0, help="= onnxruntime threads of the actor")
    v = sub.add_parser("ray-ivf")
    v.add_argument("--n", type=int, default=1_000_000)
    v.add_argument("--dim", type=int, default=128)
    v.add_argument("--clusters", type=int, default=1000)
    v.add_argument("--noise", type=float, default=1.0, help="std of the points around their centre (per dimension)")
    v.add_argument("--shard-size", type=int, default=50_000)
    v.add_argument("--key", default="IVF{K},Flat")
    v.add_argument("--train", type=int, default=200_000)
    v.add_argument("--queries", type=int, default=1000)
    v.add_argument("--ray-cpus", type=int, default=2)
    v.add_argument("--on-disk", action="store_true", help="merge with faiss.contrib.ondisk into an .ivfdata file")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(args.what if args.what.startswith("ray") else f"index-{args.what}", args.save)
    if args.what == "read" and args.code:
        # The checkout to time comes first on the path, before any import of retrieval: its `retrieval` package
        # (the read path, retrieval.index) is then imported instead of the installed one, so that two versions of
        # the code are timed on the same index in the same way.
        sys.path.insert(0, args.code)
        print(json.dumps(read_once(args)))
        return
    commands = {"throughput": throughput, "search": search, "read": read, "ray-throughput": ray_throughput,
                "ray-ivf": ray_ivf}
    result = commands[args.what](args)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
