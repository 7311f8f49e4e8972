"""``retrieval text train``: a text tower trained onto an image model (LiT), so that an index built with that model
is searched by text without re-indexing (docs/TEXT.md). Its options are ``TextTrainConfig``'s."""

from __future__ import annotations

import json

import click

from retrieval.cli.config_options import config_options
from retrieval.cli.errors import OptionCommand, OptionGroup
from retrieval.cli.options import apply_options
from retrieval.train.text_config import TextTrainConfig


@click.group("text", cls=OptionGroup)
def text_group() -> None:
    """Search an image index by text: train a text tower onto the index's image model."""


def _train_command(func):  # the options of TextTrainConfig, declared there once
    return apply_options(func, config_options(TextTrainConfig))


@text_group.command("train", cls=OptionCommand, needs="train")
@_train_command
@click.option("--json", "as_json", is_flag=True, help="end with report.json's summary as JSON (for programs).")
def text_train_command(as_json: bool, **values) -> None:
    """Train a text tower whose captions land on their images' embeddings under --model (the image tower locked:
    the index's vectors stay as they are), choose its epoch on held-out captions, and export RUN/text.onnx."""
    from retrieval.export.text_export import export_text_tower
    from retrieval.train.text_tower import train_text_tower

    config = TextTrainConfig(**{name: value for name, value in values.items() if value is not None})
    report = train_text_tower(config, export_text_tower, progress=not as_json,
                              log_line=(lambda _: None) if as_json else click.echo)
    held, start = report["held_out"], report["start"]
    if as_json:
        click.echo(json.dumps({k: report[k] for k in ("text_model", "image_model_hash", "images", "captions",
                                                      "chosen_epoch", "selected_on", "held_out", "start",
                                                      "verification")}, indent=2))
        return
    shown = ", ".join(f"R@{k.split('@')[1]} {v:.3f}" for k, v in held.items())
    baseline = ", ".join(f"R@{k.split('@')[1]} {v:.3f}" for k, v in start.items() if k.startswith("recall@"))
    click.echo(f"wrote {report['text_model']} for image model {report['image_model_hash']}: epoch "
               f"{report['chosen_epoch']} ({report['selected_on']}); held-out captions {shown} (the "
               f"{start['kind']} start: {baseline}); ONNX = PyTorch to cosine "
               f"{report['verification']['min_cosine']:.6f}")
    click.echo(f"next: retrieval index text INDEX --text-model {report['text_model']}")
