"""What ``retrieval train`` says at the end of a run without labels, and the export of the delivered model beside
a run trained on an index's own gallery (so that ``retrieval index upgrade`` is the next command)."""

from __future__ import annotations

from pathlib import Path

import click

from retrieval.compatibility import KEPT, KEPT_K
from retrieval.reports import delivered_checkpoint
from retrieval.train.config import TrainConfig


def label_free_summary(cfg: TrainConfig, report: dict, after: dict, report_path: str,
                        upgrade: tuple[str, str] | None) -> None:
    """The lines that end a run without labels: how far its neighbours moved, which model best.pt is and why, and
    the next command (the export, the index upgrade, or the pretrained export where the check kept it)."""
    check = report.get("label_free_check") or {}
    swapped = check.get("start_delivered") is True  # the label-free check made the start the delivered model
    epoch = ((check.get("trained") if swapped else report.get("best")) or {}).get("epoch", 0)
    floor = f"{cfg.kept_floor:.0%} (--kept-floor)"
    if not epoch:  # the guard's fallback: best.pt is the start with or without the check
        chosen = f"no epoch kept {floor}: best.pt is the start"
    elif swapped:
        chosen = (f"epoch {epoch} was the latest that keeps {floor}, and the label-free check rejected "
                  f"{check.get('model') or 'best.pt'}: best.pt is the start")
    else:
        chosen = f"best.pt is epoch {epoch}, the latest that keeps {floor}"
    click.echo(f"trained {cfg.out} without labels: its images keep {after[KEPT]:.0%} of their {KEPT_K} nearest "
               f"neighbours from the pretrained backbone; {chosen}; report {report_path}")
    command = (report.get("pretrained_export") or {}).get("command")
    if report.get("keep_pretrained") is True:  # the label-free check could not tell the model from its start
        click.echo(str(report.get("keep_pretrained_reason")) + ("; best.pt is the start" if swapped else ""))
        if on_an_index(cfg):
            click.echo(f"keep the index {cfg.data} as it is: no upgrade")
        if command:
            click.echo(f"next: {command}   (keep the pretrained export)")
    elif upgrade is None:
        checkpoint = delivered_checkpoint(report)
        click.echo(f"next: retrieval export --checkpoint {Path(cfg.out) / checkpoint} --out "
                   f"{Path(cfg.out) / 'model.onnx'}")


def on_an_index(cfg: TrainConfig) -> bool:
    """Whether the run trained without labels on an index's own gallery."""
    from retrieval.data.unlabelled import is_index_folder

    return cfg.labels == "none" and cfg.data is not None and is_index_folder(cfg.data)


def export_for_the_index(cfg: TrainConfig, report: dict, quiet: bool) -> tuple[str, str] | None:
    """Trained on an index's own gallery: the delivered model exported beside the run, so that the upgrade is the
    next command; returns (the model, that command), None for any other run and where the label-free check kept
    the start (the index stays as it is)."""
    if not on_an_index(cfg) or report.get("keep_pretrained") is True:
        return None
    from retrieval.export import export_checkpoint

    checkpoint = Path(cfg.out) / delivered_checkpoint(report)
    model = Path(cfg.out) / "model.onnx"
    export_checkpoint(checkpoint, model, log=None if quiet else (lambda line: click.echo(f"  {line}")))
    command = f"retrieval index upgrade {cfg.data} --model {model}"
    if not quiet:
        click.echo(f"exported {checkpoint.name} to {model} (verified with onnxruntime)")
        click.echo(f"next: {command}   (the gallery re-embedded by the adapted model; a model trained "
                   "--compatible-with the index's own keeps serving while it runs)")
    return str(model), command
