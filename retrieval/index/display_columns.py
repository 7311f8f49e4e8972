"""The display columns: which of a manifest's columns (a product's title, its price) every answer carries beside its
path, recorded in index.json (``display_columns``), and their values as answers show them: bounded and printable.

A manifest cell is anyone's text: a value is cut to ``MAX_DISPLAY_CHARS`` and its control characters become spaces
here, once, for every reader (the CLI, the API, the client, the app); numbers stay numbers where they are finite.
Read side and writer alike import this module: it imports neither faiss nor the index writer.
"""

from __future__ import annotations

import dataclasses
import json
import math
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from retrieval.errors import ParameterError
from retrieval.index.sources import MAX_COLUMN_NAME_CHARS

DISPLAY_COLUMNS = "display_columns"  # index.json: the list of column names every answer carries
TITLE_COLUMNS = ("title", "name", "product_name", "caption")  # names that hold a row's title, in order of preference
PRICE_COLUMNS = ("price",)
MAX_DISPLAY_COLUMNS = 16  # columns an answer carries per result
MAX_DISPLAY_CHARS = 300  # characters of one value (a title; a longer description is cut)
MAX_METADATA_CHARS = 1 << 20  # a catalogue row's metadata JSON read for display (a manifest row's is far less)
MAX_NAMES_LISTED = 40  # the columns a refusal lists

ColumnValue = str | int | float | None


def parse_column_list(text: str | Sequence[str] | None) -> list[str]:
    """``"title, price"`` (or a list of names) as ``["title", "price"]``: names stripped, empties dropped."""
    if text is None:
        return []
    parts = text.split(",") if isinstance(text, str) else [str(part) for part in text]
    return [name.strip() for name in parts if name.strip()]


def default_display_columns(available: Sequence[str], text_columns: Iterable[str] = ()) -> list[str]:
    """The columns shown when none are chosen: those of ``available`` named like a title (``TITLE_COLUMNS``) and a
    price (``PRICE_COLUMNS``), then the keyword columns (``text_columns``) the index keeps, each once."""
    present = set(available)
    chosen = [name for name in (*TITLE_COLUMNS, *PRICE_COLUMNS) if name in present]
    chosen += [name for name in text_columns if name in present and name not in chosen]
    return chosen[:MAX_DISPLAY_COLUMNS]


def check_display_columns(names: Sequence[str], available: Sequence[str]) -> list[str]:
    """``names`` (each once, in order) when every one is a column of ``available``, else a ``ParameterError``
    naming the unknown one and listing those there are."""
    chosen = list(dict.fromkeys(names))
    if len(chosen) > MAX_DISPLAY_COLUMNS:
        raise ParameterError("display_columns", f"names {len(chosen)} columns; at most {MAX_DISPLAY_COLUMNS} are "
                                                "shown with each result: choose the ones a reader needs")
    known = set(available)
    for name in chosen:
        if name not in known:
            shown = ", ".join(list(available)[:MAX_NAMES_LISTED]) + (", ..." if len(available) > MAX_NAMES_LISTED
                                                                      else "")
            there = (f"the columns are: {shown}" if available else
                     "it keeps no manifest columns (a folder gallery, or a manifest of path and label only)")
            raise ParameterError("display_columns", f"names {printable(name, 64)!r}, which is no manifest column of "
                                                    f"the index; {there}")
    return chosen


def checked_columns(names: object) -> list[str]:
    """A recorded list of column names (the record's ``catalogue.display_columns``, ``text_columns``) as it is
    shown: [] where it is no list (results show paths)."""
    if not isinstance(names, list):
        return []
    # a hand-edited index.json is read as any file is: names a manifest could not have are left out
    return [name for name in names if isinstance(name, str) and name.isidentifier() and name.isascii()
            and len(name) <= MAX_COLUMN_NAME_CHARS][:MAX_DISPLAY_COLUMNS]


def printable(text: str, limit: int = MAX_DISPLAY_CHARS) -> str:
    """``text`` on one line: control, format and separator characters (newlines, bidi overrides, zero-width marks)
    as spaces, runs of spaces as one, cut to ``limit`` characters with an ellipsis."""
    cleaned = "".join(ch if ch == " " or unicodedata.category(ch)[0] not in "CZ" else " "
                      for ch in text[: limit * 4])
    cleaned = " ".join(cleaned.split())
    return cleaned if len(cleaned) <= limit else cleaned[: limit - 1].rstrip() + "…"


def shown_value(value: object) -> ColumnValue:
    """A catalogue value as answers carry it: text printable and bounded, finite numbers as they are, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if abs(value) < 2 ** 53 else float(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        text = printable(value)
        return text or None
    return None


def display_values(data: str | Mapping[str, Any] | None, columns: Sequence[str]) -> dict[str, ColumnValue]:
    """The ``columns`` of one row (its metadata: JSON text or a mapping), each shown (``shown_value``); None where
    the row has no value of it."""
    if isinstance(data, str):
        try:
            data = json.loads(data) if len(data) <= MAX_METADATA_CHARS else None
        except ValueError:
            data = None
    values = data if isinstance(data, Mapping) else {}
    return {name: shown_value(values.get(name)) for name in columns}


def columns_of(ids: Sequence[int], columns: Sequence[str],
               metadata_of: Callable[[list[int]], Mapping[int, Any]]) -> dict[int, dict[str, ColumnValue]]:
    """id -> the display ``columns`` of each of ``ids``, the rows' metadata read at once (``metadata_of(ids)``: id ->
    JSON text or mapping); {} where no columns are shown."""
    if not columns or not len(ids):
        return {}
    wanted = sorted({int(i) for i in ids})
    data = metadata_of(wanted)
    return {i: display_values(data.get(i), columns) for i in wanted}


def with_columns(found: list[list[Any]], columns_of: Callable[[list[int]], Mapping[int, dict[str, Any]]]
                 ) -> list[list[Any]]:
    """Each query's results (``SearchResult``s) with their display columns (``columns_of(ids)``, asked once for the
    whole answer) where they lack them."""
    wanted = sorted({r.id for results in found for r in results if r.columns is None})
    values = columns_of(wanted) if wanted else {}
    if not values:
        return found
    return [[r if r.columns is not None or r.id not in values else dataclasses.replace(r, columns=values[r.id])
             for r in results] for results in found]


def title_of(columns: Mapping[str, Any] | None) -> str | None:
    """The row's title: the value of its first column named like one (``TITLE_COLUMNS``), else None."""
    for name in TITLE_COLUMNS:
        value = (columns or {}).get(name)
        if isinstance(value, str) and value:
            return value
    return None


def display_text(columns: Mapping[str, Any] | None, limit: int = 2 * MAX_DISPLAY_CHARS) -> str | None:
    """A result's columns on one line: its title, its price, then the others as ``name: value`` (``·`` between);
    None where it has no value to show."""
    columns = columns or {}
    title = title_of(columns)
    parts = [title] if title else []
    for name, value in columns.items():
        if value is None or value == "" or (title and value == title and name in TITLE_COLUMNS):
            continue
        if name in TITLE_COLUMNS and title:
            continue
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        parts.append(shown if name in PRICE_COLUMNS else f"{printable(name, 64)}: {shown}")
    return printable(" · ".join(parts), limit) if parts else None


def catalogue_columns(catalogue_path: str | Path) -> list[str]:
    """The manifest columns an index's catalogue keeps (its rows' metadata keys), sorted."""
    from retrieval.index.catalogue_reader import CatalogueReader

    with CatalogueReader(catalogue_path) as catalogue:
        return catalogue.metadata_columns()


def record_display_columns(index_dir: str | Path, columns: Sequence[str] | None = None) -> dict[str, Any]:
    """Record in the index's index.json the display columns every answer carries, under the folder's writer lock:
    ``columns`` checked against the catalogue's columns, or (None) the defaults (``default_display_columns``, with
    the keyword columns index.json records as ``text_columns``); [] records none: results show their paths.
    Returns what it recorded, what it replaced and the columns there are."""
    from retrieval.index.layout import IndexLayout

    layout = IndexLayout(index_dir)
    layout.require_finished(vectors_in_milvus=True)
    with layout.write_lock("record the display columns of"):
        info = layout.read_record()
        available = catalogue_columns(layout.catalogue)
        if columns is None:
            recorded = info.catalogue.text_columns
            text_columns = recorded if isinstance(recorded, list) else []
            chosen = default_display_columns(available, [str(c) for c in text_columns])
        else:
            chosen = check_display_columns(list(columns), available)
        replaced = info.catalogue.display_columns
        layout.write_info(info.with_fields({DISPLAY_COLUMNS: chosen}))
    return {"index_dir": str(layout.root), DISPLAY_COLUMNS: chosen, "available_columns": available,
            "replaced_display_columns": replaced if replaced != chosen else None}
