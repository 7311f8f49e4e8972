"""`--resize crop` against `--resize pad` with a pretrained backbone as it is (`retrieval export --pretrained`):
Recall@1 and MAP@R of each data set's test split, leave-one-out, as `retrieval evaluate` measures them.

    .venv/bin/python benchmarks/resize_modes.py [--datasets emoji fashion-mnist digits] [--limit 2000]
    .venv/bin/python benchmarks/resize_modes.py --trained [--datasets ...] [--seeds 0 1 2] [--epochs 10]
    .venv/bin/python benchmarks/resize_modes.py --cutout [--trained] [--datasets ...] [--work DIR]

The embedder is the pretrained EfficientNet-Lite0's pooled features, L2-normalised (no training: no seed to vary,
the numbers are deterministic); each data set at its image size. Square images (all of these) lose only pad's
border to crop's 1.14 zoom; the modes differ most on wide and tall images, which these sets do not hold.

--trained: per data set, mode and seed, a 64-d head (multi-similarity loss) trained on the frozen backbone's features
of the train split in that mode (`retrieval train --resize MODE --freeze-backbone`, as benchmarks/rerank.py), then
its test Recall@1 and MAP@R; mean and half the spread over the seeds.

--cutout: every image cut to its content's bounding box, as a catalogue's cut-out product photos are (Fashion-MNIST
and digits: the pixels above ``CUTOUT_THRESHOLD`` on their black ground, made opaque, the ground transparent; emoji:
the drawing's own alpha), written as a `--dataset folder` tree (train/ and test/ class folders of PNGs, under
``--work``) and measured as above: trousers and dresses become tall images, sandals and bags wide ones, flags and
keycaps wide. ``CUTOUT_PER_CLASS`` images a class and split at most (emoji: every pair).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

# data set -> (its options, image size)
DATASETS = {"emoji": ({}, 224), "fashion-mnist": ({"protocol": "standard"}, 64), "digits": ({}, 64)}
CUTOUT_THRESHOLD = 10  # a grey pixel above it is the object's (Fashion-MNIST's and digits' grounds are 0)
CUTOUT_PER_CLASS = 100


def cutout_folder(dataset: str, work: Path) -> Path:
    """The data set's train and test splits cut to their content's bounding box, as a folder tree (made once)."""
    from PIL import Image

    from retrieval.data import load_dataset
    from retrieval.data.dataset import array_to_image

    root = work / f"cutout-{dataset}"
    if (root / "done").is_file():
        return root
    options = dict(DATASETS[dataset][0])
    if dataset != "emoji":
        options["limit_per_class"] = CUTOUT_PER_CLASS
    for split in ("train", "test"):
        data = load_dataset(dataset, None, split=split, **options)
        for position, (sample, label) in enumerate(zip(data.samples, data.labels, strict=True)):
            if isinstance(sample, np.ndarray):
                grey = np.asarray(array_to_image(sample).convert("L"))
                rgba = np.dstack([np.repeat(grey[..., None], 3, axis=2),
                                  np.where(grey > CUTOUT_THRESHOLD, 255, 0).astype(np.uint8)])
                image = Image.fromarray(rgba, "RGBA")
            else:
                with Image.open(sample) as opened:
                    image = opened.convert("RGBA")
            box = image.getchannel("A").getbbox()
            if box is None:
                continue  # nothing drawn
            folder = root / split / str(data.class_names[int(label)])
            folder.mkdir(parents=True, exist_ok=True)
            image.crop(box).save(folder / f"{position:05d}.png")
    (root / "done").write_text("")
    return root


def measure(dataset: str, mode: str, limit: int, folder: Path | None = None) -> dict[str, float]:
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.metrics import evaluate
    from retrieval.models import create_pretrained_embedder

    options, size = DATASETS[dataset]
    model = create_pretrained_embedder("efficientnet_lite0", size, mode)
    transform = build_transforms(model.preprocessing, train=False)
    data = load_dataset("folder", folder, split="test", transform=transform) if folder is not None else \
        load_dataset(dataset, None, split="test", transform=transform, **options)
    if limit and len(data) > limit:
        from torch.utils.data import Subset

        data = Subset(data, np.random.default_rng(0).choice(len(data), limit, replace=False).tolist())
    embedded = embed_samples(model, data, 128, torch.device("cpu"), 0, False, "embeddings", False)
    metrics = evaluate(embedded.embeddings, embedded.labels)
    return {"images": len(embedded.labels), "recall@1": round(float(metrics["recall@1"]), 4),
            "map@r": round(float(metrics["map@r"]), 4)}


# data set -> (its options, batch size, images of a class in a batch, batches an epoch): as benchmarks/rerank.py
# (digits trains on 5 classes: batches of 20)
TRAINED = {"fashion-mnist": ({"protocol": "standard", "limit_per_class": 60}, 40, 4, 10), "emoji": ({}, 40, 2, 30),
           "digits": ({}, 20, 4, 10)}


def trained(dataset: str, mode: str, seed: int, epochs: int, work: Path, folder: Path | None = None
            ) -> dict[str, float]:
    """One frozen-backbone run in ``mode`` (on ``folder``, the cut-out tree, where given); its last test metrics."""
    from retrieval.train import TrainConfig, train

    options, batch_size, per_class, batches = TRAINED[dataset]
    source = dict(dataset="folder", data=str(folder), dataset_kwargs={}) if folder is not None else \
        dict(dataset=dataset, dataset_kwargs=dict(options))
    name = f"{'cutout-' if folder is not None else ''}{dataset}-{mode}-{seed}"
    report = train(TrainConfig(**source, backbone="efficientnet_lite0",
                               pretrained=True, image_size=DATASETS[dataset][1], resize=mode, freeze_backbone=True,
                               embedding_dim=64, loss="ms", batch_size=batch_size, per_class=per_class,
                               batches_per_epoch=batches, epochs=epochs, lr=1e-3, seed=seed, workers=0,
                               device="cpu", out=str(work / name),
                               feature_cache=str(work / "cache"), plots=False, tensorboard=False, val_fraction=0.0,
                               eval_before=False), progress=False)
    return {"recall@1": float(report["last"]["recall@1"]), "map@r": float(report["last"]["map@r"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--limit", type=int, default=2000, help="test images a data set, seeded subset (0: all)")
    parser.add_argument("--trained", action="store_true", help="a trained head per mode and seed (see above)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--work", help="the runs' folder (default: a new temporary one)")
    parser.add_argument("--cutout", action="store_true", help="each image cut to its content (see above)")
    args = parser.parse_args()
    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="resize-modes-"))
    folders = {dataset: cutout_folder(dataset, work) if args.cutout else None for dataset in args.datasets}
    if args.trained:
        for dataset in args.datasets:
            for mode in ("crop", "pad"):
                runs = [trained(dataset, mode, seed, args.epochs, work, folders[dataset]) for seed in args.seeds]
                row = {"dataset": dataset, "cutout": args.cutout, "resize": mode, "seeds": args.seeds}
                for key in ("recall@1", "map@r"):
                    values = [run[key] for run in runs]
                    row[key] = round(float(np.mean(values)), 4)
                    row[f"{key} ±"] = round((max(values) - min(values)) / 2, 4)
                print(json.dumps(row), flush=True)
        return
    for dataset in args.datasets:
        for mode in ("crop", "pad"):
            print(json.dumps({"dataset": dataset, "cutout": args.cutout, "resize": mode,
                              **measure(dataset, mode, args.limit, folders[dataset])}), flush=True)


if __name__ == "__main__":
    main()
