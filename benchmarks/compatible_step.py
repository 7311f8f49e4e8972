"""What --compatible-with costs a training step: the old model's forward on every batch, and the influence term.

    .venv/bin/python benchmarks/compatible_step.py [--rounds 3] [--batches 8] [--image-size 64]

Whole-backbone fine-tuning (EfficientNet-Lite0, ImageNet weights, Fashion-MNIST images at ``--image-size``, ms,
batch 32 = 8 x 4, AdamW) for ``--batches`` steps, without and with ``--compatible-with`` an old checkpoint of the
same recipe, the two interleaved ``--rounds`` times in one process so that both meet the same machine. Reported:
images/s of each (the epoch's own count, data loading included) and the ratio, the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def config(out: Path, image_size: int, batches: int, **overrides):
    from retrieval.train import TrainConfig

    values = dict(dataset="fashion-mnist", dataset_kwargs={"protocol": "standard", "limit_per_class": 40},
                  backbone="efficientnet_lite0", pretrained=True, image_size=image_size, freeze_backbone=False,
                  embedding_dim=128, loss="ms", batch_size=32, per_class=4, batches_per_epoch=batches, epochs=1,
                  workers=0, device="cpu", out=str(out), plots=False, tensorboard=False, eval_before=False,
                  eval_every=100, eval_limit=64)
    values.update(overrides)
    return TrainConfig(**values)


def images_per_s(run: Path) -> float:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(row["images_per_s"] for row in rows if "images_per_s" in row)


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("compatible-step", args.save)
    from retrieval.train import train

    work = Path(tempfile.mkdtemp(prefix="compatible-step-"))
    train(config(work / "old", args.image_size, 2), progress=False)
    speeds: dict[str, list[float]] = {"plain": [], "compatible": []}
    for n in range(args.rounds):
        for name in ("plain", "compatible") if n % 2 == 0 else ("compatible", "plain"):
            extra = {"compatible_with": str(work / "old" / "last.pt")} if name == "compatible" else {}
            run = work / f"{name}-{n}"
            train(config(run, args.image_size, args.batches, **extra), progress=False)
            speeds[name].append(images_per_s(run))
    plain, compatible = (statistics.median(speeds[k]) for k in ("plain", "compatible"))
    print(json.dumps({"images_per_s": {k: [round(v, 1) for v in values] for k, values in speeds.items()},
                      "median_plain": round(plain, 1), "median_compatible": round(compatible, 1),
                      "step_time_ratio": round(plain / compatible, 3)}, indent=2))


if __name__ == "__main__":
    main()
