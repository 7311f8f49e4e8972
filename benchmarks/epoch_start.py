"""What an epoch's start costs the fine-tuning pipeline: the wait for each epoch's first batch, and the whole
epoch, with the train workers kept from epoch to epoch (``ImagePipeline``'s one loader) and started anew each epoch
(the pipeline before: a new DataLoader an epoch), the two alternated in one process.

    .venv/bin/python benchmarks/epoch_start.py --data artifacts/demo/data/emoji --epochs 4 --batches 10 --repeats 3

The demo recipe's input: emoji at 128 px, "light" augmentation, batches of 32 (2 a class), the default workers.
No model runs: this is the input pipeline alone.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np
import torch

import retrieval.train.features as features
from retrieval.data import BadImageLog, ClassBalancedBatchSampler, load_dataset
from retrieval.models import create_embedder
from retrieval.train.config import TrainConfig
from retrieval.train.features import Embedding, ImagePipeline
from retrieval.utils.workers import default_workers


def one_run(cfg: TrainConfig, persistent: bool, epochs: int, batches: int, workers: int) -> dict[str, float]:
    """Seconds to each epoch's first batch (the first epoch left out: both start workers there) and per epoch."""
    made = features.make_loader
    if not persistent:  # the pipeline as it was: a new loader, new workers, every epoch
        features.make_loader = lambda *args, **kwargs: made(*args, **{**kwargs, "persistent": False})
    try:
        preprocessing = replace(create_embedder(cfg.backbone, pretrained=False).preprocessing,
                                input_size=cfg.image_size)
        run = Embedding(torch.device("cpu"), cfg.batch_size, workers, amp=False, progress=False,
                        bad_images=BadImageLog("skip"))
        train_set = load_dataset(cfg.dataset, cfg.data, split="train",
                                 transform=ImagePipeline.train_transform(preprocessing, cfg.augmentation(), run.device))
        pipeline = ImagePipeline(cfg, train_set, None, run, preprocessing)
        sampler = ClassBalancedBatchSampler(np.asarray(train_set.labels), cfg.batch_size // cfg.per_class,
                                            cfg.per_class, seed=cfg.seed, batches_per_epoch=batches)
        first, whole = [], []
        for epoch in range(epochs):
            if not persistent:
                pipeline._train_loader = None  # the next batches() makes a new loader
            start = time.perf_counter()
            for i, _ in enumerate(pipeline.batches(sampler, epoch, 0)):
                if i == 0:
                    first.append(time.perf_counter() - start)
            whole.append(time.perf_counter() - start)
        pipeline.close()
    finally:
        features.make_loader = made
    return {"first_batch_s": statistics.mean(first[1:]), "epoch_s": statistics.mean(whole[1:])}


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the emoji data folder (retrieval data prepare emoji)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batches", type=int, default=10, help="batches an epoch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("epoch-start", args.save)
    cfg = TrainConfig(dataset="emoji", data=args.data, image_size=128, batch_size=32, per_class=2,
                      augment="light", pretrained=False, eval_extra=[])
    rows: dict[str, list[dict[str, float]]] = {"new workers each epoch": [], "kept workers": []}
    for repeat in range(args.repeats):
        for name, persistent in (("new workers each epoch", False), ("kept workers", True)):
            rows[name].append(one_run(cfg, persistent, args.epochs, args.batches, args.workers))
            print(f"run {repeat + 1} {name}: {rows[name][-1]}", flush=True)
    print(f"\n| {args.workers} workers, {args.batches} batches of 32 an epoch | first batch of an epoch (s) | "
          "epoch (s) |\n|---|---:|---:|")
    for name, results in rows.items():
        print(f"| {name} | " + " | ".join(" / ".join(f"{r[key]:.3f}" for r in results)
                                         for key in ("first_batch_s", "epoch_s")) + " |")


if __name__ == "__main__":
    main()
