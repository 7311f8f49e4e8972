"""`retrieval index columns`: the manifest columns an index keeps, and the display columns (a title, a price) every
answer shows with each image, recorded in index.json; `index build --display-columns` records them at the build."""

from __future__ import annotations

import shlex
from pathlib import Path

import click

from retrieval.cli.config_options import command_option
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import finish, index_folder, json_option
from retrieval.cli.index_options import IndexOptions


def check_manifest_columns(images: str | None, display_columns: str | None) -> None:
    """--display-columns checked against a manifest's header before a build reads any image (a folder gallery keeps
    no columns: every name is refused)."""
    if display_columns is None or images is None:
        return
    from retrieval.index.display_columns import check_display_columns, parse_column_list
    from retrieval.index.sources import kept_columns

    manifest = Path(images)
    try:
        available = kept_columns(manifest) if manifest.is_file() else []
    except (OSError, ValueError):
        return  # the build names what is wrong with the manifest itself
    check_display_columns(parse_column_list(display_columns), available)  # OptionCommand names the option


def record_display(index_dir: str | Path, display_columns: str | None, summary: dict) -> None:
    """After a build: record its display columns (given, or the defaults) and put them in its ``summary``."""
    from retrieval.index.display_columns import parse_column_list, record_display_columns

    chosen = None if display_columns is None else parse_column_list(display_columns)
    summary["display_columns"] = record_display_columns(index_dir, chosen)["display_columns"]


def shown_columns(names: list[str]) -> str:
    """The display columns for a one-line summary."""
    return ", ".join(names) if names else "none (results show their paths)"


@click.command("columns", cls=OptionCommand)
@index_folder
@command_option(IndexOptions, "display_columns")
@json_option
def columns_command(index_dir: str, display_columns: str | None, as_json: bool) -> None:
    """List the manifest columns the index keeps and the ones every answer shows with each image; with
    --display-columns, choose those (e.g. title,price; '' for paths only)."""
    from retrieval.index.display_columns import (
        DISPLAY_COLUMNS,
        catalogue_columns,
        checked_columns,
        parse_column_list,
        record_display_columns,
    )
    from retrieval.index.layout import IndexLayout
    from retrieval.index.sources import printable_path

    folder = shlex.quote(str(index_dir))
    if display_columns is not None:
        summary = record_display_columns(index_dir, parse_column_list(display_columns))
        kept = ", ".join(summary["available_columns"]) or "none"
        finish(summary, as_json,
               f"every answer of {printable_path(summary['index_dir'])} shows: "
               f"{shown_columns(summary[DISPLAY_COLUMNS])} (of its columns: {kept})",
               f"retrieval search --index {folder} IMAGE   (a pushed Milvus collection takes them at its next "
               "`retrieval index push`)")
        return
    layout = IndexLayout(index_dir)
    layout.require_finished(vectors_in_milvus=True)
    recorded = layout.read_record().catalogue.display_columns
    summary = {"index_dir": str(layout.root), DISPLAY_COLUMNS: checked_columns(recorded),
               "available_columns": catalogue_columns(layout.catalogue)}
    finish(summary, as_json,
           f"{printable_path(summary['index_dir'])} keeps the manifest columns: "
           f"{', '.join(summary['available_columns']) or 'none'}; every answer shows: "
           f"{shown_columns(summary[DISPLAY_COLUMNS])}",
           f"retrieval index columns {folder} --display-columns COLUMN[,COLUMN...]")
