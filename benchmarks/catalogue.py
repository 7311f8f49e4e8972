"""A small catalogue fine-tuned as the README says, against the pretrained pad export it starts from: what the folder
recipe gains on unseen items of seen classes (`--dataset-param protocol=standard`, the catalogue case).

    .venv/bin/python benchmarks/catalogue.py [--catalogue fashion|shop] [--seeds 0 1 2] [--recipes recipe ...]
        [--resizes pad crop] [--work DIR] [--out benchmarks/results/catalogue/runs-CATALOGUE-NAME-cpu-2core.json]
    (the tables of the runs files: benchmarks/catalogue_tables.py)

The catalogue: real product photos (Fashion-MNIST's Zalando photos, its train split's first ``--per-class`` of each of
its 10 classes) cut to the object (the pixels above ``CUTOUT_THRESHOLD``), scaled 3x to 6x, and set on a white
ground with margins of their own, as a shop's cut-out photos are: tall dresses and trousers, wide sandals and bags,
47 to 230 px a side, saved as JPEG (quality 90). Written once as a folder of class folders, without a split.

Per seed S: the folder split with ``protocol=standard, seed=S`` (20 % of each class's images are the test split);
the pretrained EfficientNet-Lite0 letterboxed at 224 px (``retrieval export --pretrained efficientnet_lite0 --resize
pad``: the quick path) measured on that test split, each image a query against the others; then each recipe trained
with ``retrieval train --dataset folder --data CATALOGUE --dataset-param protocol=standard --dataset-param seed=S
--seed S --resize pad --image-size 224 --freeze-backbone ...`` (best.pt chosen on the validation split the run
carves from the train images) and best.pt measured on the same test split (the run's report; the last epoch's
numbers beside it). Mean and half the spread over the seeds.

``--catalogues fashion shop``: catalogue B is the shop of benchmarks/shop_catalogue.py (its seed-0 gallery and its
train.csv photos together, 634 images in 22 categories: Fashion-MNIST photos coloured and emoji products drawn on
white), read as a manifest whose label is the category, split the same way. ``--resizes pad crop`` measures the
pretrained export each way (crop: `retrieval export --pretrained`'s default). Each run's row holds its BEFORE (the
report's baseline), best.pt and the last epoch, and the report's ``keep_pretrained`` where the run writes one, judged
against the pretrained pad export measured here (``catalogue_tables.py`` writes the results tables).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

CUTOUT_THRESHOLD = 10  # a grey pixel above it is the object's (Fashion-MNIST's ground is 0)
IMAGE_SIZE = 224
# what every recipe gives beside its own options: 10 classes of 4 images a batch (the default batch of 64 needs 16)
BASE = {"batch_size": 40, "per_class": 4}
# recipe -> the `retrieval train` options beside the data, the model and the seed (TrainConfig fields)
RECIPES = {
    "head": {},  # the defaults: a 512-d head, multi-similarity loss, 10 epochs
    "head-64d": {"embedding_dim": 64},
    # the README's upgrade from the quick path: trained compatible with the pretrained pad export (its ONNX file)
    "head-compatible": {"compatible_with": "PRETRAINED_ONNX"},
}
QUICK_PATH_MODEL = "model_pad.onnx"  # the pretrained pad export, written into --work once
# The recipe's options beside the head start: the start itself, and the epochs (measured under --head-start)
HEAD_START_RECIPES = {
    "start-random": {"head_start": "random"},
    "start-principal": {"head_start": "principal"},
    "start-identity": {"head_start": "identity", "embedding_dim": 1280},  # EfficientNet-Lite0's 1280 features
    "30-epochs": {"epochs": 30},
    # the README's recipe: the head starts at the pretrained export itself (auto at the backbone's size), 30 epochs
    "recipe": {"embedding_dim": 1280, "epochs": 30},
    "recipe-compatible": {"embedding_dim": 1280, "epochs": 30, "compatible_with": "PRETRAINED_ONNX"},
}
RECIPES.update(HEAD_START_RECIPES)
CATALOGUES = ("fashion", "shop")
SHOP_COLUMNS = ("path", "label", "title", "category")  # the shop's manifest as a shop writes it: label = category


def catalogue_folder(work: Path, per_class: int) -> Path:
    """The cut-out catalogue (see the module's docstring), made once."""
    from PIL import Image

    from retrieval.data import load_dataset
    from retrieval.data.dataset import array_to_image

    root = work / f"catalogue-{per_class}"
    if (root / "done").is_file():
        return root
    data = load_dataset("fashion-mnist", None, split="train", protocol="standard", limit_per_class=per_class)
    rng = np.random.default_rng(0)
    for position, (sample, label) in enumerate(zip(data.samples, data.labels, strict=True)):
        grey = np.asarray(array_to_image(sample).convert("L"))
        rows, cols = np.nonzero(grey > CUTOUT_THRESHOLD)
        if not len(rows):
            continue
        crop = grey[rows.min():rows.max() + 1, cols.min():cols.max() + 1]
        mask = crop > CUTOUT_THRESHOLD
        scale = rng.uniform(3, 6)
        size = (max(1, round(crop.shape[1] * scale)), max(1, round(crop.shape[0] * scale)))
        obj = Image.fromarray(crop).resize(size, Image.BICUBIC).convert("RGB")
        alpha = Image.fromarray((mask * 255).astype(np.uint8)).resize(size, Image.BILINEAR)
        margins = rng.uniform(0.05, 0.2, 4)
        canvas = Image.new("RGB", (round(size[0] * (1 + margins[0] + margins[1])),
                                   round(size[1] * (1 + margins[2] + margins[3]))), (255, 255, 255))
        canvas.paste(obj, (round(size[0] * margins[0]), round(size[1] * margins[2])), alpha)
        folder = root / str(data.class_names[int(label)])
        folder.mkdir(parents=True, exist_ok=True)
        canvas.save(folder / f"{position:05d}.jpg", quality=90)
    (root / "done").write_text("")
    return root


def shop_manifest(work: Path) -> Path:
    """Catalogue B: the shop's gallery and training photos in one manifest, the category its label (made once)."""
    import csv

    from shop_catalogue import catalogue  # beside this file
    from shop_text import emoji_folder

    shop = catalogue(work / "shop", emoji_folder(work), 0)
    manifest = shop / "catalogue.csv"
    if not manifest.is_file():
        rows = []
        for name in ("manifest.csv", "train.csv"):
            with open(shop / name, newline="", encoding="utf-8") as handle:
                rows += [{column: row[column] for column in SHOP_COLUMNS} for row in csv.DictReader(handle)]
        with open(manifest.with_suffix(".tmp"), "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(SHOP_COLUMNS))
            writer.writeheader()
            writer.writerows(rows)
        manifest.with_suffix(".tmp").replace(manifest)
    return manifest


def catalogue_data(name: str, work: Path, per_class: int) -> tuple[str, Path]:
    """The data set and the path `retrieval train --dataset D --data PATH` reads for catalogue ``name``."""
    return ("folder", catalogue_folder(work, per_class)) if name == "fashion" else ("csv", shop_manifest(work))


def pretrained_metrics(data: tuple[str, Path], seed: int, resize: str = "pad") -> dict[str, float]:
    """The pretrained model exported with ``resize`` (pad: the quick path's export) on the seed's test split,
    leave-one-out."""
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.metrics.evaluation import leave_one_out_metrics
    from retrieval.models import create_pretrained_embedder

    model = create_pretrained_embedder("efficientnet_lite0", IMAGE_SIZE, resize)
    test = load_dataset(data[0], data[1], split="test", transform=build_transforms(model.preprocessing, train=False),
                        protocol="standard", seed=seed)
    embedded = embed_samples(model, test, 64, torch.device("cpu"), 0, False, "pretrained", False)
    metrics = leave_one_out_metrics(embedded.embeddings, embedded.labels)
    return {"recall@1": float(metrics["recall@1"]), "map@r": float(metrics["map@r"]), "images": len(test)}


def recipe_metrics(data: tuple[str, Path], recipe: str, seed: int, work: Path,
                   head_start: str | None = None, name: str = "fashion") -> dict[str, float]:
    """One run of ``recipe`` on the seed's split: its BEFORE, best.pt's test metrics and the epoch it holds, the last
    epoch's, the report's pretrained export and keep_pretrained where it has them, and the wall time."""
    from retrieval.train import TrainConfig, train

    options = {**BASE, **({"head_start": head_start} if head_start else {}), **RECIPES[recipe]}
    if options.get("compatible_with") == "PRETRAINED_ONNX":
        options["compatible_with"] = str(quick_path_model(work))
    if "head_start" in options and "head_start" not in TrainConfig.__dataclass_fields__:
        raise SystemExit(f"recipe {recipe!r} (or --head-start) needs `retrieval train --head-start`, which this "
                         "tree's training does not have yet")
    started_at = f"-{head_start}" if head_start else ""
    out = work / "runs" / f"{'' if name == 'fashion' else name + '-'}{recipe}{started_at}-{seed}"
    shutil.rmtree(out, ignore_errors=True)  # the benchmark's own run folder: a new measurement replaces it
    started = time.perf_counter()
    report = train(TrainConfig(
        dataset=data[0], data=str(data[1]), dataset_kwargs={"protocol": "standard", "seed": seed},
        backbone="efficientnet_lite0", pretrained=True, image_size=IMAGE_SIZE, resize="pad", freeze_backbone=True,
        seed=seed, workers=0, device="cpu", out=str(out), feature_cache=str(work / "cache"),
        plots=False, tensorboard=False, **options), progress=False)
    best, last, before = report["best"], report["last"], report.get("baseline") or {}
    row = {"recall@1": float(best["recall@1"]), "map@r": float(best["map@r"]), "epoch": int(best["epoch"]),
           "selected_on": report["selected_on"], "last_recall@1": float(last["recall@1"]),
           "last_map@r": float(last["map@r"]), "last_epoch": int(last["epoch"]),
           "before_recall@1": before.get("recall@1"), "before_map@r": before.get("map@r"),
           "seconds": round(time.perf_counter() - started, 1)}
    for key in ("pretrained_export", "keep_pretrained", "keep_pretrained_reason"):  # a run that measures them
        if key in report:
            row[key] = report[key]
    if report.get("wise"):  # the delivered model is wise.pt where the run made one
        row["wise"] = report["wise"]
    if "compatibility" in best:  # new queries against the old (pretrained) gallery: what index upgrade serves at first
        row["cross_model"] = best["compatibility"]
    return row


def quick_path_model(work: Path) -> Path:
    """The quick path's model: `retrieval export --pretrained efficientnet_lite0 --resize pad` (written once)."""
    from retrieval.export import export_pretrained

    path = work / QUICK_PATH_MODEL
    if not path.is_file():
        export_pretrained("efficientnet_lite0", path, image_size=IMAGE_SIZE, resize="pad")
    return path


def summary(values: list[float]) -> dict[str, float]:
    return {"mean": round(float(np.mean(values)), 4), "half_spread": round(float(np.ptp(values)) / 2, 4)}


def run_name(recipe: str, head_start: str | None) -> str:
    """A recipe's row: its name, and the head start it ran under where --head-start chose it."""
    return f"{recipe} (start {head_start})" if head_start and "head_start" not in RECIPES[recipe] else recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--catalogue", default="fashion", choices=CATALOGUES,
                        help="fashion: the 600 cut-outs; shop: benchmarks/shop_catalogue.py's gallery and train photos")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--recipes", nargs="*", default=["head", "head-64d", "head-compatible"], choices=list(RECIPES))
    parser.add_argument("--resizes", nargs="+", default=["pad"], choices=["pad", "crop"],
                        help="the pretrained exports measured beside the recipes")
    parser.add_argument("--head-start", help="`retrieval train --head-start` of the recipes that do not set their own")
    parser.add_argument("--work", help="the catalogues, runs and feature cache (default: a new temporary folder)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="catalogue-"))
    data = catalogue_data(args.catalogue, work, args.per_class)
    rows: dict[str, list[dict]] = {f"pretrained {resize} export": [] for resize in args.resizes}
    images = data[1].rglob("*.jpg") if data[0] == "folder" else data[1].read_text(encoding="utf-8").splitlines()[1:]
    result = {"machine": "2-core CPU", "date": time.strftime("%Y-%m-%d"), "catalogue": args.catalogue,
              "seeds": [], "per_class": args.per_class, "images": sum(1 for _ in images),
              "head_start": args.head_start, "table": {}, "runs": rows}
    for seed in args.seeds:
        for resize in args.resizes:
            rows[f"pretrained {resize} export"].append(pretrained_metrics(data, seed, resize))
        for recipe in args.recipes:
            rows.setdefault(run_name(recipe, args.head_start), []).append(
                recipe_metrics(data, recipe, seed, work, args.head_start, args.catalogue))
        print(json.dumps({name: runs[-1] for name, runs in rows.items()}), flush=True)
        result["seeds"].append(seed)
        result["table"] = {name: {key: summary([run[key] for run in runs]) for key in ("recall@1", "map@r")}
                           for name, runs in rows.items()}
        if args.out:  # after each seed: a stopped measurement keeps the seeds it finished
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["table"], indent=1))


if __name__ == "__main__":
    main()
