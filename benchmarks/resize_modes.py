"""`--resize crop` against `--resize pad` with a pretrained backbone as it is (`retrieval export --pretrained`):
Recall@1 and MAP@R of each data set's test split, leave-one-out, as `retrieval evaluate` measures them.

    .venv/bin/python benchmarks/resize_modes.py [--datasets emoji fashion-mnist digits] [--limit 2000]

The embedder is the pretrained EfficientNet-Lite0's pooled features, L2-normalised (no training: no seed to vary,
the numbers are deterministic); each data set at its image size. Square images (all of these) lose only pad's
border to crop's 1.14 zoom; the modes differ most on wide and tall images, which these sets do not hold.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

# data set -> (its options, image size)
DATASETS = {"emoji": ({}, 224), "fashion-mnist": ({"protocol": "standard"}, 64), "digits": ({}, 64)}


def measure(dataset: str, mode: str, limit: int) -> dict[str, float]:
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.metrics import evaluate
    from retrieval.models import create_pretrained_embedder

    options, size = DATASETS[dataset]
    model = create_pretrained_embedder("efficientnet_lite0", size, mode)
    data = load_dataset(dataset, None, split="test", transform=build_transforms(model.config, train=False), **options)
    if limit and len(data) > limit:
        from torch.utils.data import Subset

        data = Subset(data, np.random.default_rng(0).choice(len(data), limit, replace=False).tolist())
    embedded = embed_samples(model, data, 128, torch.device("cpu"), 0, False, "embeddings", False)
    metrics = evaluate(embedded.embeddings, embedded.labels)
    return {"images": len(embedded.labels), "recall@1": round(float(metrics["recall@1"]), 4),
            "map@r": round(float(metrics["map@r"]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS))
    parser.add_argument("--limit", type=int, default=2000, help="test images a data set, seeded subset (0: all)")
    args = parser.parse_args()
    for dataset in args.datasets:
        for mode in ("crop", "pad"):
            print(json.dumps({"dataset": dataset, "resize": mode, **measure(dataset, mode, args.limit)}), flush=True)


if __name__ == "__main__":
    main()
