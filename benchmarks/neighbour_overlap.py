"""Does the label-free neighbour overlap predict what fine-tuning costs out of domain?

    .venv/bin/python benchmarks/neighbour_overlap.py --data artifacts/demo/data/emoji --runs runs/overlap \\
        [--seeds 0 1 2] [--backbone-lrs 3e-4 3e-3] [--extra fashion-mnist digits]

Each run is the demo recipe (``retrieval.cli.demo.DEMO_RECIPE``: whole-backbone fine-tuning on emoji, WiSE-FT
"auto") with one backbone learning rate and seed, evaluated at every epoch on the test half of each ``--extra``
set and on ``EVAL_LIMIT`` emoji test images (a finished run is read back, not trained again). Two populations
of (model, out-of-domain set) points:

- epochs: every evaluated epoch's model against the pretrained backbone at its own resolution: the share of each
  image's top-10 neighbours it keeps from the backbone's (``neighbours_kept@10``, no labels) and the Recall@1 it
  loses against the backbone's (labels);
- WiSE-FT: every mix of the curve against the start (alpha 0), on the extra sets' validation half.

Prints Spearman's rank correlation of "neighbours lost" (1 - kept) with "Recall@1 lost", per set and pooled, and
what WiSE-FT would take if it chose by the overlap instead of the labelled out-of-domain Recall@1: the best
in-domain validation Recall@1 among the mixes keeping at least FLOOR of the start's neighbours, beside today's
choice (within --wise-tolerance of the start's out-of-domain Recall@1). The Markdown goes to docs/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import KEPT

FLOORS = (0.5, 0.6, 0.7, 0.8, 0.9)
EVAL_LIMIT = 600  # emoji test images evaluated each epoch: the in-domain numbers are not what this measures


def run(data: str, out: Path, backbone_lr: float, seed: int, extra: list[str]) -> dict[str, Any]:
    """Train one run (or read its finished report)."""
    from retrieval.cli.demo import DEMO_RECIPE
    from retrieval.train import TrainConfig, train

    report_path = out / "report.json"
    if report_path.is_file():
        return json.loads(report_path.read_text())
    recipe = {**DEMO_RECIPE, "data": data, "out": str(out), "backbone_lr": backbone_lr, "seed": seed,
              "eval_extra": list(extra), "eval_every": 1, "eval_limit": EVAL_LIMIT, "plots": False,
              "tensorboard": False}
    return train(TrainConfig(**recipe), progress=True)


def epoch_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """(set, neighbours lost, Recall@1 lost) of every evaluated epoch against the pretrained backbone."""
    reference = report["reference"]["sets"]
    points = []
    for row in report["history"]:
        for name, metrics in (row.get("extra") or {}).items():
            if KEPT in metrics:
                points.append({"set": name, "epoch": row["epoch"], "lost_neighbours": 1 - metrics[KEPT],
                               "lost_recall": reference[name]["test"]["recall@1"] - metrics["recall@1"]})
    return points


def wise_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """(set, alpha, neighbours lost, Recall@1 lost) of every WiSE-FT mix against the start (alpha 0)."""
    curve = report["wise"]["curve"]
    start = curve[0]
    return [{"set": name, "alpha": p["alpha"], "lost_neighbours": 1 - p["extra_kept"][name],
             "lost_recall": start["extra"][name] - p["extra"][name]}
            for p in curve[1:] for name in p["extra"]]


def spearman(points: list[dict[str, Any]]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr([p["lost_neighbours"] for p in points], [p["lost_recall"] for p in points]).statistic)


def choose_by_floor(curve: list[dict[str, Any]], floor: float) -> float:
    """The alpha of the best in-domain validation Recall@1 among the mixes keeping >= ``floor`` of the start's
    neighbours (ties to the smaller alpha)."""
    allowed = [p for p in curve if p["kept"] >= floor]
    return max(allowed, key=lambda p: (p["in_domain"], -p["alpha"]))["alpha"]


def selection_rows(reports: list[dict[str, Any]]) -> list[tuple[str, list[float], list[float], list[float]]]:
    """Per rule: the alphas taken, their in-domain and mean out-of-domain validation Recall@1 change from the start."""
    from retrieval.train.robust import choose_alpha

    rules = {"labelled out-of-domain R@1 (today)": lambda c, r: choose_alpha(c, r["wise"]["tolerance"]),
             "in-domain only (no out-of-domain data)": lambda c, r: max(c, key=lambda p: (p["in_domain"],
                                                                                           -p["alpha"]))["alpha"]}
    rules.update({f"neighbours kept >= {floor:g} (no labels)": (lambda c, r, f=floor: choose_by_floor(c, f))
                  for floor in FLOORS})
    rows = []
    for name, rule in rules.items():
        alphas, in_domain, out = [], [], []
        for report in reports:
            curve = report["wise"]["curve"]
            alpha = rule(curve, report)
            point = next(p for p in curve if p["alpha"] == alpha)
            alphas.append(alpha)
            in_domain.append(point["in_domain"] - curve[0]["in_domain"])
            out.append(point["out_of_domain"] - curve[0]["out_of_domain"])
        rows.append((name, alphas, in_domain, out))
    return rows


def mean_std(values: list[float]) -> str:
    return f"{100 * statistics.mean(values):+.1f} ± {100 * statistics.stdev(values):.1f}" if len(values) > 1 \
        else f"{100 * values[0]:+.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the demo's emoji folder (retrieval demo prepares it)")
    parser.add_argument("--runs", type=Path, default=Path("runs/overlap"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--backbone-lrs", type=float, nargs="+", default=[3e-4, 3e-3])
    parser.add_argument("--extra", nargs="+", default=["fashion-mnist", "digits"])
    args = parser.parse_args()
    reports = [run(args.data, args.runs / f"blr{lr:g}" / f"seed{seed}", lr, seed, args.extra)
               for seed in args.seeds for lr in args.backbone_lrs]
    epochs = [p for r in reports for p in epoch_points(r)]
    mixes = [p for r in reports for p in wise_points(r)]
    print(f"{len(reports)} runs; {len(epochs)} epoch points, {len(mixes)} WiSE-FT points\n")
    print("| population | set | points | Spearman (neighbours lost vs Recall@1 lost) |")
    print("|---|---|---|---|")
    for label, points in (("epochs vs pretrained backbone (test half)", epochs),
                          ("WiSE-FT mixes vs start (val half)", mixes)):
        for name in [*args.extra, "pooled"]:
            chosen = points if name == "pooled" else [p for p in points if p["set"] == name]
            if len(chosen) > 2:
                print(f"| {label} | {name} | {len(chosen)} | {spearman(chosen):.2f} |")
    print("\n| WiSE-FT alpha chosen by | alphas | in-domain val R@1 vs start | out-of-domain val R@1 vs start |")
    print("|---|---|---|---|")
    for name, alphas, in_domain, out in selection_rows(reports):
        print(f"| {name} | {', '.join(f'{a:g}' for a in alphas)} | {mean_std(in_domain)} | {mean_std(out)} |")
    raw = {"epochs": epochs, "wise": mixes}
    (args.runs / "neighbour_overlap.json").write_text(json.dumps(raw, indent=1))
    print(f"\npoints written to {args.runs / 'neighbour_overlap.json'}; mean lost neighbours "
          f"{np.mean([p['lost_neighbours'] for p in epochs]):.3f} (epochs)")


if __name__ == "__main__":
    main()
