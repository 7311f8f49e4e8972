"""`retrieval index text`: record in an index folder the text model (``text.onnx``, `retrieval text train`) that
searches it by text, so that `retrieval search --text` and `retrieval serve` use it without ``--text-model``."""

from __future__ import annotations

import shlex

import click

from retrieval.cli.config_options import command_option
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import finish, index_folder, json_option
from retrieval.cli.index_options import IndexOptions


def no_match_summary(summary: dict) -> str:
    """The no-match floor `index text` measured, in a sentence (docs/TEXT.md, "No good match")."""
    record = summary.get("text_no_match")
    if not record:
        return "; no \"no good match\" floor (its vectors are not in the folder, or it holds under 2 images)"
    return (f"; a text query whose best score is under {record['floor']:.3f} says \"no good match\" (the "
            f"{record['quantile']:.0%} quantile of {record['texts']} everyday texts' best scores on its "
            f"{record['images']} images; {record['left_out']} texts it answers well left out)")


@click.command("text", cls=OptionCommand)
@index_folder
@command_option(IndexOptions, "index_text_model")
@command_option(IndexOptions, "text_columns")
@command_option(IndexOptions, "adapt_text_model")
@json_option
def text_command(index_dir: str, text_model: str | None, text_columns: str | None, adapt: bool,
                 as_json: bool) -> None:
    """Record the text model that searches the index by text (index.json keeps its path, its path from the index
    folder and its hash, as it keeps the image model's); one trained for another image model is refused. With
    --text-columns, build the keyword index of those manifest columns (either option is enough)."""
    from retrieval.index.sources import printable_path
    from retrieval.index.writing.keyword_build import record_keywords
    from retrieval.text.gallery_index import adaptation_sentence, record_adapted
    from retrieval.text.text_index import record_text_model

    if text_model is None and text_columns is None:
        raise click.UsageError("give --text-model (a text tower to record), --text-columns (manifest columns to "
                               "search by keyword), or both", ctx=click.get_current_context(silent=True))
    folder = shlex.quote(str(index_dir))
    keywords = record_keywords(index_dir, text_columns) if text_columns is not None else None
    if text_model is None:
        finish(keywords, as_json, f"built the keyword index of {', '.join(keywords['text_columns'])} "
               f"({keywords['keyword_rows']} images) in {printable_path(keywords['index_dir'])}",
               f"retrieval search --index {folder} --text 'a red apple'   (or: retrieval serve --index {folder})")
        return
    # a zero-shot tower: adapted to the gallery first
    recorded, adaptation = record_adapted(index_dir, text_model) if adapt else (
        record_text_model(index_dir, text_model), None)
    summary = recorded | (keywords or {}) | ({"gallery_adaptation": adaptation} if adaptation else {})
    replaced = summary["replaced_text_model_hash"]
    finish(summary, as_json,
           f"recorded the text model {printable_path(summary['text_model_path'])} (text_model_hash "
           f"{summary['text_model_hash']}, trained for image model {summary['image_model_hash']}) in "
           f"{printable_path(summary['index_dir'])}"
           + (f"; it replaces the text model {replaced}" if replaced else "") + no_match_summary(summary)
           + (f"; keyword index of {', '.join(keywords['text_columns'])}" if keywords else "")
           + adaptation_sentence(adaptation),
           f"retrieval search --index {folder} --text 'a red apple'   (or: retrieval serve --index {folder})")

