"""Robust fine-tuning on the demo: in-domain (emoji test) and out-of-domain (Fashion-MNIST) Recall@1 per method.

    .venv/bin/python benchmarks/robust_finetune.py --data artifacts/demo/data/emoji --runs runs/robust \\
        --seeds 0 1 2 --methods plain lp-ft l2sp distill layer-decay ema [--base light]

Every cell is the demo recipe before the sweep (``RECIPE_BEFORE``) with the changes of a base (``BASES``: an
augmentation, WiSE-FT "auto"; ``demo`` is ``retrieval.cli.demo.DEMO_RECIPE`` as it stands) and of one method
(``METHODS``), trained once per seed into RUNS/BASE/METHOD/seedS (a finished run is read back, not trained again),
evaluated at the end on the emoji test split and on the test half of ``--eval-extra fashion-mnist``. Prints the
Markdown table of docs/RESULTS.md: mean ± standard deviation over seeds, and the training time of each method (the
sum of its epochs' times, mean over seeds) against plain fine-tuning's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from retrieval.cli.demo import DEMO_RECIPE
from retrieval.train import TrainConfig, train

EXTRA = "fashion-mnist"
# the demo recipe before the sweep (commit 4f3a409): every base but "demo" starts from it, so the table does not
# move when the sweep's choice becomes the demo recipe
RECIPE_BEFORE: dict[str, Any] = dict(
    dataset="emoji", backbone="efficientnet_lite0", pretrained=True, freeze_backbone=False, image_size=128,
    embedding_dim=512, loss="lifted_min", negatives="loop", batch_size=32, per_class=2, epochs=3, lr=1e-3,
    optimizer="adamw", seed=0,
)
# every base ends with WiSE-FT "auto" on 10 % held-out train classes, so each run gives two rows: the fine-tuned
# model (last epoch) and its WiSE-FT mix
WISE = dict(wise_alpha="auto", val_fraction=0.1)
BASES: dict[str, dict[str, Any]] = {
    "demo": DEMO_RECIPE,  # the demo recipe as it stands
    "crop-flip": dict(augment="crop-flip", **WISE),  # the augmentation of the recipe before robust fine-tuning
    "light": dict(augment="light", **WISE),
}
METHODS: dict[str, dict[str, Any]] = {
    "plain": {},
    "lp-ft": dict(lp_epochs=1, epochs=RECIPE_BEFORE["epochs"] + 1),  # a head epoch, then the base's fine-tuning
    "l2sp": dict(l2sp=0.01),
    "distill": dict(distill=1.0),
    "layer-decay": dict(layer_decay=0.8),
    "ema": dict(ema=0.99),
    "backbone-lr-3e-4": dict(backbone_lr=3e-4),
    "backbone-lr-1e-3": dict(backbone_lr=1e-3),
    "backbone-lr-3e-4+distill-0.3": dict(backbone_lr=3e-4, distill=0.3),
}


def run(data: str, out: Path, base: dict[str, Any], overrides: dict[str, Any], seed: int) -> dict[str, Any]:
    """Train one cell (or read its finished report) and return its row."""
    report_path = out / "report.json"
    recipe = {**RECIPE_BEFORE, **base, "data": data, "out": str(out), "eval_before": False, "plots": False,
              "eval_extra": [EXTRA], "seed": seed, **overrides}
    recipe["eval_every"] = recipe["epochs"]
    if report_path.is_file():
        report = json.loads(report_path.read_text())
    else:
        report = train(TrainConfig(**recipe), progress=False)
    last, wise = report["last"], report.get("wise") or {}
    return {"seed": seed, "in_domain": last["recall@1"], "out_of_domain": last["extra"][EXTRA]["recall@1"],
            "wise_in_domain": (wise.get("metrics") or {}).get("recall@1"),
            "wise_out_of_domain": ((wise.get("metrics") or {}).get("extra") or {}).get(EXTRA, {}).get("recall@1"),
            "alpha": wise.get("alpha"), "reference": report["reference"]["sets"][EXTRA]["test"]["recall@1"],
            "train_s": sum(h.get("epoch_time_s", 0) for h in report["history"])}


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="the rendered emoji folder (make demo writes it)")
    parser.add_argument("--runs", type=Path, default=Path("runs/robust"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--base", default="demo", choices=list(BASES))
    args = parser.parse_args()
    rows: dict[str, list[dict[str, Any]]] = {}
    for method in args.methods:
        for seed in args.seeds:
            start = time.perf_counter()
            row = run(args.data, args.runs / args.base / method / f"seed{seed}", BASES[args.base], METHODS[method],
                      seed)
            rows.setdefault(method, []).append(row)
            print(json.dumps({"method": method, **row, "wall_s": round(time.perf_counter() - start)}), flush=True)
    plain_s = statistics.mean(r["train_s"] for r in rows.get("plain", [])) if "plain" in rows else None
    reference = statistics.mean(r["reference"] for group in rows.values() for r in group)
    print(f"\nbase: {args.base}; pretrained backbone at its own resolution, {EXTRA} test R@1: {100 * reference:.1f}\n")
    print("| method | seeds | emoji R@1 (in domain) | Fashion-MNIST R@1 (out of domain) | + WiSE-FT: emoji | "
          "+ WiSE-FT: Fashion-MNIST | alpha chosen | training time |")
    print("|---|---|---|---|---|---|---|---|")
    for method, group in rows.items():
        train_s = statistics.mean(r["train_s"] for r in group)
        cost = f"{train_s:.0f} s" + (f" ({train_s / plain_s:.2f}x)" if plain_s else "")
        alphas = ", ".join(f"{r['alpha']:g}" for r in group if r["alpha"] is not None) or "-"
        wise = [mean_std([r[k] for r in group]) if all(r[k] is not None for r in group) else "-"
                for k in ("wise_in_domain", "wise_out_of_domain")]
        print(f"| {method} | {len(group)} | {mean_std([r['in_domain'] for r in group])} | "
              f"{mean_std([r['out_of_domain'] for r in group])} | {wise[0]} | {wise[1]} | {alphas} | {cost} |")


if __name__ == "__main__":
    main()
