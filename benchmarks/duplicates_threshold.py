"""`retrieval index duplicates --threshold auto` on small labelled galleries with planted copies (docs/RESULTS.md,
"Near-duplicates: the automatic threshold on small galleries").

Each gallery: ``--gallery`` images of a labelled data set (one folder per label: the index's labels), seeded,
stretched to varied shapes (``ASPECTS``: square, 4:3, 3:4, 16:9, 9:16), and
``--planted`` copies of some of them made by ``plant_copies`` (the kinds `auto` claims to find, in turn: resized,
re-encoded, cropped, recoloured; another seed than the calibration's) saved in the original's folder. The index is
built with the model of ``benchmarks/near_duplicates.py model`` (EfficientNet-Lite0, ImageNet weights, 128 px), then
``find_duplicates(index, DuplicateOptions("auto"))`` runs as the command does. Scored per gallery:

- recall: planted copies grouped with their original;
- precision: (first image, member) pairs of the groups that are a planted copy with its original;
- mixed: share of the groups whose images carry more than one label;
- proposed: images the summary proposes to remove (its ``removal`` ids; before it had none: every copy of every
  group), and the share of them that are planted pairs.

    .venv/bin/python benchmarks/near_duplicates.py model --out DIR
    .venv/bin/python benchmarks/duplicates_threshold.py --out DIR --tag after [--datasets emoji,fashion-mnist,digits]
        [--seeds 0,1,2] [--gallery 250] [--planted 12]
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image

KINDS = ("resized", "jpeg", "cropped", "recoloured")
FIXED_CUTS = (0.85, 0.9, 0.95, 0.97)  # the same graph's groups at fixed cosines, beside auto's


# --- the labelled pools: name -> (label, PIL image)
def emoji_pool(out: Path, candidates: int = 400) -> list[tuple[str, str, Image.Image]]:
    """The emoji renderer's images (noto and openmoji, 128 px, transparent backgrounds kept): label = the emoji."""
    from retrieval.data import prepare_emoji

    source = out / "emoji-source"
    if not (source / "manifest.csv").is_file():
        prepare_emoji(source, image_size=128, limit=candidates, progress=False)
    with (source / "manifest.csv").open(newline="", encoding="utf-8") as file:
        rows = [(row["path"], row["label"]) for row in csv.DictReader(file)]
    return [(f"{label}-{Path(path).stem}", label, Image.open(source / path).copy()) for path, label in rows]


def fashion_pool() -> list[tuple[str, str, Image.Image]]:
    """Fashion-MNIST's test part (28 px grey, as shipped): label = the class name."""
    from retrieval.data.builtin import FASHION_MNIST_CLASSES, read_fashion_mnist

    images, labels = read_fashion_mnist(None, "t10k")
    return [(f"f{i:05d}", FASHION_MNIST_CLASSES[int(label)], Image.fromarray(images[i]))
            for i, label in enumerate(labels.tolist())]


def digits_pool() -> list[tuple[str, str, Image.Image]]:
    """sklearn's digits upscaled to 32 px (as tests/planted.py writes them): label = the digit."""
    from retrieval.data.builtin import digits_images

    images, labels = digits_images(32)
    return [(f"d{i:04d}", str(int(label)), Image.fromarray(images[i])) for i, label in enumerate(labels.tolist())]


def balanced_sample(pool: list[tuple[str, str, Image.Image]], count: int, seed: int) -> list[int]:
    """``count`` pool positions, seeded, spread evenly over the labels (as many per label as fit)."""
    rng = np.random.default_rng(seed)
    by_label: dict[str, list[int]] = {}
    for position, (_, label, _) in enumerate(pool):
        by_label.setdefault(label, []).append(position)
    labels = sorted(by_label)
    if len(labels) > count // 2:  # many labels of few images (emoji: two each): whole labels, seeded
        chosen = [p for label in rng.permutation(labels) for p in by_label[label]][:count]
        return sorted(chosen)
    per_label = count // len(labels)
    chosen = [p for label in labels for p in rng.permutation(by_label[label])[:per_label].tolist()]
    return sorted(chosen)


ASPECTS = (1.0, 4 / 3, 3 / 4, 16 / 9, 9 / 16)  # width / height: the gallery's images come in varied shapes


def reshaped(image: Image.Image, aspect: float) -> Image.Image:
    """``image`` stretched to ``aspect`` (width / height), its short side kept."""
    side = min(image.size)
    size = (round(side * aspect), side) if aspect >= 1 else (side, round(side / aspect))
    return image.resize(size, Image.Resampling.BICUBIC)


def write_gallery(folder: Path, pool: list[tuple[str, str, Image.Image]], count: int, planted: int,
                  seed: int) -> dict[str, str]:
    """The gallery in ``folder/<label>/``: originals, and ``planted`` copies (kinds in turn) of seeded originals;
    copy file name -> its original's."""
    from retrieval.index.curation.copy_planting import THRESHOLD_KINDS, plant_copies

    if folder.exists():
        shutil.rmtree(folder)
    rng = np.random.default_rng(1000 + seed)
    chosen = balanced_sample(pool, count, seed)
    names = {}
    shaped = {}
    for position in chosen:
        key, label, image = pool[position]
        target = folder / label.replace("/", "_")
        target.mkdir(parents=True, exist_ok=True)
        shaped[position] = reshaped(image, ASPECTS[int(rng.integers(len(ASPECTS)))])
        shaped[position].save(target / f"{key}.png")
        names[position] = f"{key}.png"
    truth = {}
    for n, position in enumerate(sorted(rng.choice(chosen, planted, replace=False).tolist())):
        key, label, _ = pool[position]
        image = shaped[position]
        kind = KINDS[n % len(KINDS)]
        # another seed than auto's calibration (which plants with seeds 0.. of its own sample)
        copy = plant_copies(image, THRESHOLD_KINDS, seed=10_000 + 100 * seed + n)[kind]
        name = f"{key}__{kind}.{'jpg' if kind == 'jpeg' else 'png'}"
        copy.save(folder / label.replace("/", "_") / name, **({"quality": 95} if kind == "jpeg" else {}))
        truth[name] = names[position]
    return truth


# --- scoring
def score(summary: dict, truth: dict[str, str]) -> dict:
    """Recall and pair precision of the planted copies, the share of label-mixed groups, the removal proposed."""
    true_pairs = {frozenset((copy, original)) for copy, original in truth.items()}
    groups = summary["groups"]
    names = [[Path(p).name if p else None for p in group["paths"]] for group in groups]
    pairs = [frozenset((members[0], other)) for members in names for other in members[1:]]
    together = {frozenset((a, b)) for members in names for i, a in enumerate(members) for b in members[i + 1:]}
    mixed = sum(len({label for label in group["labels"] if label is not None}) > 1 for group in groups)
    removal = summary.get("removal")
    name_of = {i: n for group, members in zip(groups, names, strict=True)
               for i, n in zip(group["ids"], members, strict=True)}
    proposed = removal["ids"] if removal is not None else [i for group in groups for i in group["ids"][1:]]
    planted_names = set(truth) | set(truth.values())
    calibration = summary.get("calibration") or {}
    return {
        "threshold": summary["threshold"],
        "separated": calibration.get("separated"),
        "groups": len(groups),
        "mixed_groups": mixed,
        "mixed_share": round(mixed / len(groups), 3) if groups else 0.0,
        "recall": round(sum(pair in together for pair in true_pairs) / max(1, len(true_pairs)), 3),
        "precision": round(sum(pair in true_pairs for pair in pairs) / len(pairs), 3) if pairs else None,
        "proposed": len(proposed),
        "proposed_precision": (round(sum(name_of.get(i) in planted_names for i in proposed) / len(proposed), 3)
                               if proposed else None),
        "copy_p10": _quantile(calibration, "copy_score_quantiles", "p5"),
        "neighbour_p95": _quantile(calibration, "neighbour_score_quantiles", "p95"),
    }


def _quantile(calibration: dict, key: str, which: str) -> float | None:
    values = calibration.get(key) or {}
    return values.get(which)


def run(out: Path, dataset: str, seed: int, count: int, planted: int, model: Path) -> dict:
    from retrieval.index import Index, IngestOptions, build_index
    from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
    from retrieval.index.curation.neighbour_graph import index_graph

    pools = {"emoji": lambda: emoji_pool(out), "fashion-mnist": fashion_pool, "digits": digits_pool}
    pool = pools[dataset]()
    folder = out / f"{dataset}-{count}-s{seed}"
    truth = write_gallery(folder / "gallery", pool, count, planted, seed)
    if (folder / "index").exists():
        shutil.rmtree(folder / "index")
    build_index(folder / "gallery", folder / "index", model=model, options=IngestOptions(workers=2, progress=False))
    started = time.perf_counter()
    with Index.open(folder / "index") as index:
        graph = index_graph(index, 10, None, seed)
        summary = find_duplicates(index, DuplicateOptions("auto", seed=seed, max_groups=10_000), graph=graph)
        seconds = time.perf_counter() - started
        # what fixed cuts give on the same graph: whether any cut meets both targets
        curve = {f"{cut:g}": {key: value for key, value in score(
            find_duplicates(index, DuplicateOptions(cut, max_groups=10_000), graph=graph), truth).items()
            if key in ("groups", "mixed_share", "recall", "precision")} for cut in FIXED_CUTS}
    return {"dataset": dataset, "seed": seed, "images": summary["images"], "planted": len(truth),
            **score(summary, truth), "seconds": round(seconds, 1),
            "warnings": summary.get("warnings", []), "fixed": curve}


def aggregate(rows: list[dict]) -> str:
    """Mean ± standard deviation over the seeds, a line per data set, as Markdown."""
    columns = ["threshold", "groups", "mixed_share", "recall", "precision", "proposed", "proposed_precision"]
    lines = ["| data set | images | " + " | ".join(columns) + " | separated |", "|" + " --- |" * (len(columns) + 3)]
    for dataset in dict.fromkeys(row["dataset"] for row in rows):
        part = [row for row in rows if row["dataset"] == dataset]
        cells = []
        for column in columns:
            values = [row[column] for row in part if row[column] is not None]
            cells.append(f"{np.mean(values):.3g} ± {np.std(values):.2g}" if values else "n/a")
        separated = sum(bool(row["separated"]) for row in part)
        lines.append(f"| {dataset} | {part[0]['images']} | " + " | ".join(cells) + f" | {separated}/{len(part)} |")
    return "\n".join(lines)


def fixed_table(rows: list[dict]) -> str:
    """Recall and label-mixed share at the fixed cuts, mean over the seeds, as Markdown."""
    lines = ["| data set | " + " | ".join(f"{cut:g}: recall / mixed" for cut in FIXED_CUTS) + " |",
             "|" + " --- |" * (len(FIXED_CUTS) + 1)]
    for dataset in dict.fromkeys(row["dataset"] for row in rows):
        part = [row for row in rows if row["dataset"] == dataset]
        cells = [f"{np.mean([r['fixed'][f'{cut:g}']['recall'] for r in part]):.2f} / "
                 f"{np.mean([r['fixed'][f'{cut:g}']['mixed_share'] for r in part]):.2f}" for cut in FIXED_CUTS]
        lines.append(f"| {dataset} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("near-duplicates"))
    parser.add_argument("--tag", default="after", help="the results' file name: DIR/threshold-TAG.json")
    parser.add_argument("--datasets", default="emoji,fashion-mnist,digits")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--gallery", type=int, default=250, help="originals per gallery")
    parser.add_argument("--planted", type=int, default=12, help="copies planted in each gallery")
    parser.add_argument("--model", type=Path, help="default: DIR/model.onnx")
    args = parser.parse_args()
    rows = []
    for dataset in args.datasets.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            rows.append(run(args.out, dataset, seed, args.gallery, args.planted, args.model or args.out / "model.onnx"))
            print(json.dumps(rows[-1]), flush=True)
    print(aggregate(rows))
    print(fixed_table(rows))
    (args.out / f"threshold-{args.tag}.json").write_text(json.dumps(
        {"machine": f"{platform.machine()}, {platform.python_version()}", "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
