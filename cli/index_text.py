"""`retrieval index text`: record in an index folder the text model (``text.onnx``, `retrieval text train`) that
searches it by text, so that `retrieval search --text` and `retrieval serve` use it without ``--text-model``."""

from __future__ import annotations

import shlex

import click

from retrieval.cli.config_options import command_option
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import finish, index_folder, json_option
from retrieval.cli.index_options import IndexOptions


@click.command("text", cls=OptionCommand)
@index_folder
@command_option(IndexOptions, "index_text_model")
@json_option
def text_command(index_dir: str, text_model: str, as_json: bool) -> None:
    """Record the text model that searches the index by text (index.json keeps its path, its path from the index
    folder and its hash, as it keeps the image model's); one trained for another image model is refused."""
    from retrieval.index.sources import printable_path
    from retrieval.text.text_index import record_text_model

    summary = record_text_model(index_dir, text_model)
    folder = shlex.quote(str(index_dir))
    replaced = summary["replaced_text_model_hash"]
    finish(summary, as_json,
           f"recorded the text model {printable_path(summary['text_model_path'])} (text_model_hash "
           f"{summary['text_model_hash']}, trained for image model {summary['image_model_hash']}) in "
           f"{printable_path(summary['index_dir'])}"
           + (f"; it replaces the text model {replaced}" if replaced else ""),
           f"retrieval search --index {folder} --text 'a red apple'   (or: retrieval serve --index {folder})")
