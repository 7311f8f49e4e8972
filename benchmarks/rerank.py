"""Re-ranking (`--rerank qe|dba|kreciprocal`): what it does to MAP@R and Recall@1, and what it adds to a query.

    .venv/bin/python benchmarks/rerank.py quality [--datasets emoji fashion-mnist] [--seeds 0 1 2] [--epochs 10]
    .venv/bin/python benchmarks/rerank.py latency [--vectors 1000000] [--dim 512] [--queries 100]
    .venv/bin/python benchmarks/rerank.py memory [--dim 512] [--queries 5]

quality: per data set and seed, a 64-d head trained on frozen pretrained EfficientNet-Lite0 features (as
benchmarks/compatibility.py: emoji at 224 px, Fashion-MNIST's standard protocol at 32 px, 60 images a class); its test
split embedded (the frozen backbone's features once per data set, each seed's head on them) and evaluated
leave-one-out as `retrieval evaluate` does: plain, then each re-ranking through ``reranked_metrics`` (the shortlist a
search re-ranks: the top 100). Then DBA twice on a held-out split (every 5th test image a query, the rest the
gallery): over each query's shortlist (what the toolkit does, at query time) and over the whole gallery (each gallery
vector augmented with its own top-k neighbours once: what an index-time DBA would store). Mean ± half the spread
(max - min) over the seeds.

latency: ``--vectors`` synthetic unit vectors (clustered) in an IDMap2,Flat index; per query, one at a time as the
API answers: faiss' top-C, then each method's re-ranking of it (reading the C vectors back, ``rerank_lists``). Then
an IVF1024,Flat index of the same vectors: the one-off direct map re-ranking needs there, and reading C vectors
back through it. Milliseconds, median and 95th percentile.

memory: one query's re-ranking at the cap (1,000 candidates, k = k1 = k2 = 100): its peak memory (tracemalloc: NumPy's
arrays), its time with BLAS on one thread (median of ``--queries``), beside the bound ``peak_bytes`` states and the
work units ``work_units`` charges, and so the milliseconds a unit takes on this machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

# data set -> (its options, images of a class in a batch, image size, batches an epoch): as benchmarks/compatibility.py
DATASETS = {"fashion-mnist": ({"protocol": "standard", "limit_per_class": 60}, 4, 32, 10),
            "emoji": ({}, 2, 224, 30)}
# (row name, RerankConfig fields): the papers' sizes, and qe/dba with the 2 nearest (small classes: emoji has R = 1)
VARIANTS = [("qe", {"method": "qe", "k": 10}), ("qe k=2", {"method": "qe", "k": 2}),
            ("dba", {"method": "dba", "k": 10}), ("dba k=2", {"method": "dba", "k": 2}),
            ("kreciprocal", {"method": "kreciprocal", "k1": 20, "k2": 6})]


def train_head(dataset: str, out: Path, cache: Path, seed: int, epochs: int) -> Path:
    """One frozen-backbone run (multi-similarity loss, 64-d head); its last.pt."""
    from retrieval.train import TrainConfig, train

    options, per_class, size, batches = DATASETS[dataset]
    if not (out / "last.pt").is_file():
        train(TrainConfig(dataset=dataset, dataset_kwargs=dict(options), backbone="efficientnet_lite0",
                          pretrained=True, image_size=size, freeze_backbone=True, embedding_dim=64, loss="ms",
                          batch_size=40, per_class=per_class, batches_per_epoch=batches, epochs=epochs, lr=1e-3,
                          seed=seed, workers=0, device="cpu", out=str(out), feature_cache=str(cache), plots=False,
                          tensorboard=False, eval_before=False), progress=False)
    return out / "last.pt"


def test_features(checkpoint: Path, dataset: str) -> tuple[Any, np.ndarray]:
    """The frozen backbone's features of the test split [n, F] (shared by every seed's model) and the labels."""
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.models import load_embedder

    model = load_embedder(checkpoint)
    data = load_dataset(dataset, None, split="test", transform=build_transforms(model.preprocessing, train=False),
                        **DATASETS[dataset][0])
    embedded = embed_samples(model.backbone, data, 128, torch.device("cpu"), 0, False, "features", False)
    return torch.from_numpy(embedded.embeddings), embedded.labels


def head_embeddings(checkpoint: Path, features) -> np.ndarray:
    """A run's head over the shared backbone features: its test embeddings."""
    import torch

    from retrieval.models import load_embedder

    with torch.no_grad():
        return load_embedder(checkpoint).head(features).numpy()


def full_gallery_dba(gallery: np.ndarray, k: int, alpha: float) -> np.ndarray:
    """Index-time DBA: every gallery vector augmented with its own top-k others in the whole gallery."""
    from retrieval.metrics import knn
    from retrieval.rerank import augment_database

    scores, neighbours = knn(gallery, None, k=k, exclude_self=True)
    return augment_database(gallery, neighbours, scores, alpha)


def seed_numbers(embeddings: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """One seed's rows: plain and each variant (leave-one-out), then DBA at query and at index time (held out)."""
    from retrieval.metrics import evaluate
    from retrieval.metrics.evaluation import reranked_metrics
    from retrieval.rerank import RerankConfig

    rows: dict[str, float] = {}
    plain = evaluate(embeddings, labels, ks=(1,), metrics=["recall", "map@r"])
    rows |= {"plain/recall@1": plain["recall@1"], "plain/map@r": plain["map@r"]}
    for name, fields in VARIANTS:
        started = time.perf_counter()
        metrics = reranked_metrics(embeddings, labels, None, None, RerankConfig(**fields), ks=(1,))["metrics"]
        rows[f"{name}/ms_per_query"] = (time.perf_counter() - started) * 1000 / len(labels)
        rows |= {f"{name}/recall@1": metrics["recall@1"], f"{name}/map@r": metrics["map@r"]}
    queries = np.arange(len(labels)) % 5 == 0
    q, ql, g, gl = embeddings[queries], labels[queries], embeddings[~queries], labels[~queries]
    held = evaluate(q, ql, g, gl, ks=(1,), metrics=["recall", "map@r"])
    rows |= {"held-out plain/recall@1": held["recall@1"], "held-out plain/map@r": held["map@r"]}
    for k in (10, 2):
        query_time = reranked_metrics(q, ql, g, gl, RerankConfig(method="dba", k=k), ks=(1,))["metrics"]
        index_time = evaluate(q, ql, full_gallery_dba(g, k, 3.0), gl, ks=(1,), metrics=["recall", "map@r"])
        for where, metrics in (("query time", query_time), ("index time", index_time)):
            rows |= {f"held-out dba k={k} {where}/recall@1": metrics["recall@1"],
                     f"held-out dba k={k} {where}/map@r": metrics["map@r"]}
    return rows


def spread(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def quality(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work or tempfile.mkdtemp(prefix="rerank-bench-"))
    results: dict[str, Any] = {}
    for dataset in args.datasets:
        per_seed: dict[str, list[float]] = {}
        features = labels = None
        for seed in args.seeds:
            checkpoint = train_head(dataset, work / dataset / f"seed{seed}", work / "cache", seed, args.epochs)
            if features is None:  # the backbone is pretrained and frozen: the same for every seed
                features, labels = test_features(checkpoint, dataset)
            for key, value in seed_numbers(head_embeddings(checkpoint, features), labels).items():
                per_seed.setdefault(key, []).append(value)
            print(f"{dataset} seed {seed} done", file=sys.stderr)
        results[dataset] = {"images": len(labels), "relevant_per_query": int(np.bincount(labels).max()) - 1,
                            "rows": {key: spread(values) for key, values in per_seed.items()}}
    return results


def clustered_vectors(count: int, dim: int, seed: int = 0, chunk: int = 100_000) -> np.ndarray:
    """``count`` unit vectors around count / 100 centres (neighbourhoods of ~100, as a gallery of classes)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(max(count // 100, 1), dim)).astype(np.float32)
    out = np.empty((count, dim), dtype=np.float32)
    for start in range(0, count, chunk):
        rows = min(chunk, count - start)
        block = centres[rng.integers(0, len(centres), rows)] + 0.7 * rng.normal(size=(rows, dim)).astype(np.float32)
        out[start:start + rows] = block / np.linalg.norm(block, axis=1, keepdims=True)
    return out


def timed(call, *args) -> tuple[Any, float]:
    started = time.perf_counter()
    value = call(*args)
    return value, (time.perf_counter() - started) * 1000


def percentiles(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(float(np.median(values)), 3), "p95_ms": round(float(np.percentile(values, 95)), 3)}


def latency(args: argparse.Namespace) -> dict[str, Any]:
    import faiss

    from retrieval.index.faiss_backend.faiss_search import reconstructed_vectors
    from retrieval.rerank import RerankConfig, rerank_lists

    vectors = clustered_vectors(args.vectors, args.dim)
    rng = np.random.default_rng(1)
    picked = vectors[rng.choice(len(vectors), args.queries, replace=False)]
    queries = picked + 0.3 * rng.normal(size=picked.shape).astype(np.float32) / np.sqrt(args.dim)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    ids = np.arange(len(vectors), dtype=np.int64)
    flat = faiss.IndexIDMap2(faiss.IndexFlatIP(args.dim))
    flat.add_with_ids(vectors, ids)
    out: dict[str, Any] = {"vectors": args.vectors, "dim": args.dim, "queries": args.queries,
                           "threads": faiss.omp_get_max_threads(), "flat": {}}
    for candidates in (100, 1000):
        searches, found = [], []
        for query in queries:
            (_, top), ms = timed(flat.search, query[None], candidates)
            searches.append(ms)
            found.append(top)
        row: dict[str, Any] = {"search top-C": percentiles(searches)}
        for method in ("qe", "dba", "kreciprocal"):
            config = RerankConfig(method=method, candidates=candidates)
            added = [timed(rerank_lists, query[None], top, lambda wanted: reconstructed_vectors(flat, wanted),
                           config)[1] for query, top in zip(queries, found, strict=True)]
            row[method] = percentiles(added)
        out["flat"][f"C={candidates}"] = row
        print(f"flat C={candidates} done", file=sys.stderr)
    quantizer = faiss.IndexFlatIP(args.dim)
    ivf = faiss.IndexIVFFlat(quantizer, args.dim, 1024, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors[rng.choice(len(vectors), min(len(vectors), 50_000), replace=False)])
    wrapped = faiss.IndexIDMap2(ivf)
    wrapped.add_with_ids(vectors, ids)
    del vectors
    ivf.nprobe = 16
    sample = [rng.choice(args.vectors, 100, replace=False) for _ in range(args.queries)]
    _, first_ms = timed(reconstructed_vectors, wrapped, sample[0])  # makes the direct map
    reads = [timed(reconstructed_vectors, wrapped, wanted)[1] for wanted in sample[1:]]
    out["ivf1024_flat"] = {"first read (makes the direct map) ms": round(first_ms, 1),
                           "read 100 vectors": percentiles(reads)}
    return out


def memory(args: argparse.Namespace) -> dict[str, Any]:
    import tracemalloc

    from retrieval.rerank import RerankConfig, one_blas_thread, peak_bytes, rerank_candidates, work_units

    candidates = clustered_vectors(1000, args.dim)
    query = candidates[0] + 0.05
    query /= np.linalg.norm(query)
    out: dict[str, Any] = {"dim": args.dim, "candidates": 1000}
    for method in ("qe", "dba", "kreciprocal"):
        config = RerankConfig(method=method, candidates=1000, k=100, k1=100, k2=100)
        with one_blas_thread():
            times = [timed(rerank_candidates, query, candidates, config)[1] for _ in range(args.queries)]
            tracemalloc.start()
            rerank_candidates(query, candidates, config)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        units = work_units(config, args.dim)
        out[method] = {"peak_mib": round(peak / 2**20, 1), "bound_mib": round(peak_bytes(config, args.dim) / 2**20, 1),
                       "median_ms": round(float(np.median(times)), 1), "work_units": units,
                       "ms_per_unit": round(float(np.median(times)) / units, 2)}
    return out


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["quality", "latency", "memory"])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--work", help="the runs' folder (default: a new temporary one); finished runs are reused")
    parser.add_argument("--vectors", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables({"latency": "rerank"}.get(args.part, f"rerank-{args.part}"), args.save)
    print(json.dumps({"quality": quality, "latency": latency, "memory": memory}[args.part](args), indent=2))


if __name__ == "__main__":
    main()
