"""The demo's model against the pretrained backbone, read two ways and out of its domain.

    .venv/bin/python benchmarks/demo_readings.py [--seeds 0 1 2] [--work DIR] [--recipes demo whole]

Per seed, two recipes trained on the emoji data's subgroup reading (`--dataset-param reading=subgroup`: a class is a
Unicode subgroup, test subgroups unseen in training), each delivering the model `retrieval demo` would (WiSE-FT's mix
where the run made one, else best.pt, chosen on the validation subgroups):

* ``demo``: the demo's recipe (`retrieval.cli.demo.DEMO_RECIPE`): the pretrained backbone frozen, a head trained;
* ``whole``: the whole backbone fine-tuned (backbone lr 3e-4, light augmentation, lifted structure with LoOp
  negatives, 3 epochs), WiSE-FT's alpha chosen on the validation subgroups and Fashion-MNIST's val half.

Each delivered model and the pretrained backbone as it is (`retrieval export --pretrained`, at the demo's size and
resize mode) are measured as the demo's step 3 measures them (`retrieval.cli.demo.reading_metrics`): on the same
test images by subgroup (Recall@1, MAP@R, R-precision; leave-one-out) and by twin (relevant = the same emoji by the
other artist: Recall@1), and on Fashion-MNIST's test half as ``--eval-extra`` splits it (real product photos, out of
the emoji domain: Recall@1; all 5,000 of its images, where the demo's step shows 500). Mean ± half the spread over the
seeds; the pretrained backbone has no seed. Finished runs in ``--work`` are reused.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

WHOLE = dict(freeze_backbone=False, loss="lifted_min", negatives="loop", per_class=2, batch_size=32, epochs=3,
             lr=1e-3, backbone_lr=3e-4, augment="light", wise_alpha="auto", feature_cache=None)


def recipe(name: str, seed: int, work: Path) -> dict[str, Any]:
    from retrieval.cli.demo import DEMO_RECIPE

    base = dict(DEMO_RECIPE) | {"seed": seed, "out": str(work / f"{name}-{seed}"), "workers": 2}
    if name == "whole":
        base |= WHOLE
    else:
        base["feature_cache"] = str(work / "cache")
    return base


def delivered(config: dict[str, Any]) -> Path:
    """The run's delivered checkpoint, trained once."""
    from retrieval.reports import delivered_checkpoint
    from retrieval.train import TrainConfig, train

    report_path = Path(config["out"]) / "report.json"
    if not report_path.is_file():
        train(TrainConfig(**config), progress=False)
    return Path(config["out"]) / delivered_checkpoint(json.loads(report_path.read_text()))


def cell(values: list[float]) -> str:
    """Mean ± half the spread (the mean alone for one value)."""
    spread = f" ± {(max(values) - min(values)) / 2:.3f}" if len(values) > 1 else ""
    return f"{np.mean(values):.3f}{spread}"


def main() -> None:
    from retrieval.cli.demo import reading_metrics
    from retrieval.models import create_pretrained_embedder, load_embedder

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", default=["demo", "whole"], choices=["demo", "whole"])
    parser.add_argument("--work", help="the runs' folder (default: a new temporary one)")
    parser.add_argument("--out", help="write the numbers here (JSON)")
    parser.add_argument("--plot", help="draw the whole backbone's WiSE-FT curves (the trade-off) into this PNG")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="demo-readings-"))
    first = recipe("demo", 0, work)
    pretrained = create_pretrained_embedder(first["backbone"], first["image_size"], first.get("resize", "crop"))
    rows = {"pretrained backbone": [reading_metrics(pretrained, photos_limit=None)]}
    for name in args.recipes:
        rows[name] = []
        for seed in args.seeds:
            rows[name].append(reading_metrics(load_embedder(delivered(recipe(name, seed, work))), photos_limit=None))
            print(name, seed, json.dumps(rows[name][-1]), flush=True)
    keys = list(rows["pretrained backbone"][0])
    print("| model | " + " | ".join(keys) + " |\n| --- |" + " --- |" * len(keys))
    for name, runs in rows.items():
        cells = [cell([run[key] for run in runs]) for key in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    if args.plot and "whole" in args.recipes:
        plot_tradeoff([recipe("whole", seed, work) for seed in args.seeds], Path(args.plot))


def plot_tradeoff(configs: list[dict[str, Any]], path: Path) -> None:
    """WiSE-FT's curve of each whole-backbone run as its training recorded it (the validation subgroups' Recall@1
    against Fashion-MNIST's val half's, one point per alpha from 0, the pretrained start, to 1, the fine-tuned
    model): what each step towards the fine-tuned weights gains on emoji and costs on photos."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 4.2))
    for config in configs:
        wise = json.loads((Path(config["out"]) / "report.json").read_text())["wise"]
        curve = wise["curve"]
        xs, ys = [100 * row["out_of_domain"] for row in curve], [100 * row["in_domain"] for row in curve]
        ax.plot(xs, ys, "o-", label=f"seed {config['seed']} (chosen: alpha {wise['alpha']:g})", markersize=4)
        for row, x, y in zip(curve, xs, ys, strict=True):
            ax.annotate(f"{row['alpha']:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="photos (Fashion-MNIST val half): Recall@1, %",
           ylabel="emoji (validation subgroups): Recall@1, %",
           title="Whole-backbone fine-tuning, WiSE-FT alpha 0 -> 1")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
