"""The keyword index's writer: ``keywords.sqlite`` (``retrieval.text.keywords``: FTS5, one row per indexed image,
one column per text column) built from the catalogue's rows (their label and the manifest columns kept in the
``metadata`` table), and kept in step with them as images are added and removed.

A build writes a new file beside the old one and renames it into place (a reader sees the old file or the new one,
whole); an update after ``add``/``remove`` inserts and deletes the rows by set difference between the ids the file
holds and the catalogue's indexed rows, in one transaction, so a writer killed at any point is put right by the next.
The text columns are recorded in the catalogue's meta (what index.json is written from) and in index.json
(``text_columns``, ``keyword_index``).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue, Status
from retrieval.index.display_columns import parse_column_list
from retrieval.index.layout import IndexLayout
from retrieval.index.sources import MAX_EXTRA_CHARS, MAX_EXTRA_COLUMNS, printable_path
from retrieval.records.index_info import IndexInfo
from retrieval.text.keywords import (
    FTS_TABLE,
    INFO_TABLE,
    KEYWORD_INDEX,
    KEYWORD_INDEX_FILE,
    TEXT_COLUMNS,
    TOKENIZER,
    KeywordError,
    read_columns,
)

log = logging.getLogger(__name__)

BATCH_ROWS = 5000  # rows inserted per statement batch: memory stays bounded on any gallery
LABEL = "label"  # the catalogue's own column a keyword index may hold too (a folder gallery's names)


def fts5_available() -> bool:
    """Whether this Python's SQLite has FTS5 compiled in."""
    db = sqlite3.connect(":memory:")
    try:
        db.execute("CREATE VIRTUAL TABLE t USING fts5(a)")
    except sqlite3.OperationalError:
        return False
    finally:
        db.close()
    return True


def require_fts5() -> None:
    """A ``ParameterError`` naming the problem where this SQLite has no FTS5."""
    if not fts5_available():
        raise ParameterError("text_columns", f"need SQLite's FTS5, which this Python's SQLite "
                                             f"({sqlite3.sqlite_version}) was built without; use a Python whose "
                                             "sqlite3 has FTS5 (the python.org and most Linux builds do)")


def parse_text_columns(value: str | Sequence[str] | None) -> list[str]:
    """``title,brand`` (or a list of names) as a list of column names, each once, in order; empty: none."""
    names = list(dict.fromkeys(parse_column_list(value)))
    if len(names) > MAX_EXTRA_COLUMNS:
        raise ParameterError("text_columns", f"names {len(names)} columns; at most {MAX_EXTRA_COLUMNS}")
    return names


def catalogue_columns(catalogue: Catalogue) -> list[str]:
    """The columns the catalogue keeps per row that a keyword index can hold: ``label`` and the manifest's kept
    columns (the keys of its rows' metadata), sorted."""
    return [LABEL, *[name for name in catalogue.metadata_columns() if name != LABEL]]


def check_text_columns(columns: Sequence[str], catalogue: Catalogue) -> list[str]:
    """``columns`` once each is a column the catalogue keeps (``catalogue_columns``), else a ``ParameterError``
    listing the ones it has."""
    available = catalogue_columns(catalogue)
    unknown = [c for c in columns if c not in available]
    if unknown:
        shown = ", ".join(printable_path(c, 64) for c in unknown[:5])
        raise ParameterError("text_columns", f"names {'a column' if len(unknown) == 1 else 'columns'} the manifest "
                             f"does not have: {shown}; the columns kept for its images are: {', '.join(available)} "
                             "(a column empty in every row is not kept)")
    if not columns:
        raise ParameterError("text_columns", f"names no column; give one of: {', '.join(available)}")
    return list(columns)


def recorded_columns(catalogue: Catalogue) -> list[str]:
    """The text columns an earlier build recorded in the catalogue's meta (empty: none)."""
    value = catalogue.get_meta(TEXT_COLUMNS)
    try:
        columns = json.loads(value) if value else []
    except ValueError:
        return []
    return [c for c in columns if isinstance(c, str)] if isinstance(columns, list) else []


def keyword_fields(columns: Sequence[str]) -> dict[str, Any]:
    """index.json's record of a keyword index of ``columns``."""
    return {TEXT_COLUMNS: list(columns), KEYWORD_INDEX: KEYWORD_INDEX_FILE}


def build_keywords(layout: IndexLayout, catalogue: Catalogue, columns: Sequence[str]) -> dict[str, Any]:
    """Build ``keywords.sqlite`` of ``columns`` from the catalogue's indexed rows (a new file renamed into place),
    and record the columns in the catalogue's meta; returns index.json's fields."""
    require_fts5()
    columns = check_text_columns(list(columns), catalogue)
    target = layout.root / KEYWORD_INDEX_FILE
    temporary = target.with_name(f".{KEYWORD_INDEX_FILE}.building")
    temporary.unlink(missing_ok=True)
    db = sqlite3.connect(str(temporary), isolation_level=None)
    try:
        db.execute("PRAGMA journal_mode=OFF")  # a new file: a crash leaves a temporary one, rebuilt next time
        _create(db, columns)
        rows = 0
        db.execute("BEGIN")
        for batch in _batches(_row_texts(catalogue, columns, None)):
            db.executemany(_insert_sql(len(columns)), batch)
            rows += len(batch)
        db.execute("COMMIT")
        db.execute("PRAGMA journal_mode=DELETE")  # readers open it read-only: no WAL files to set up
    finally:
        db.close()
    with open(temporary, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, target)
    catalogue.set_meta(**{TEXT_COLUMNS: json.dumps(columns), KEYWORD_INDEX: KEYWORD_INDEX_FILE})
    log.info("keyword index of %s: %d rows, columns %s", layout.root, rows, ", ".join(columns))
    return keyword_fields(columns)


def sync_keywords(layout: IndexLayout, catalogue: Catalogue, info: IndexInfo) -> dict[str, Any]:
    """Bring the keyword index that ``info`` (index.json) records in step with the catalogue's indexed rows: the
    rows added since inserted, those removed deleted (one transaction); rebuilt where its file is missing or holds
    other columns. Returns index.json's fields ({} where the index has no keyword index)."""
    listed = info.catalogue.text_columns
    columns = [c for c in listed if isinstance(c, str)] if isinstance(listed, list) else []
    columns = columns or recorded_columns(catalogue)
    if not columns:
        return {}
    target = layout.root / KEYWORD_INDEX_FILE
    db = None
    try:
        db = sqlite3.connect(str(target), isolation_level=None, timeout=30) if target.is_file() else None
        held = read_columns(db, target) if db is not None else None
    except (sqlite3.Error, KeywordError):
        if db is not None:
            db.close()
        db, held = None, None
    if db is None or held != list(columns):
        if db is not None:
            db.close()
        return build_keywords(layout, catalogue, columns)
    try:
        have = np.fromiter((r[0] for r in db.execute(f"SELECT rowid FROM {FTS_TABLE}")), np.int64)
        done = np.asarray(catalogue.ids_with_status(Status.DONE), np.int64)
        added, removed = np.setdiff1d(done, have), np.setdiff1d(have, done)
        db.execute("BEGIN IMMEDIATE")
        try:
            for start in range(0, len(removed), 500):
                part = removed[start:start + 500].tolist()
                db.execute(f"DELETE FROM {FTS_TABLE} WHERE rowid IN ({','.join('?' * len(part))})", part)
            for batch in _batches(_row_texts(catalogue, columns, added)):
                db.executemany(_insert_sql(len(columns)), batch)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
    finally:
        db.close()
    log.info("keyword index of %s: %d rows added, %d removed", layout.root, len(added), len(removed))
    return keyword_fields(columns)


def record_keywords(index_dir: str | Path, columns: str | Sequence[str]) -> dict[str, Any]:
    """`retrieval index text --text-columns`: build the keyword index of a finished folder index under its writer
    lock, and record it in index.json; returns what it recorded."""
    names = parse_text_columns(columns)
    require_fts5()
    layout = IndexLayout(index_dir)
    layout.require_finished()
    with layout.write_lock("build the keyword index of"), Catalogue(layout.catalogue) as catalogue:
        info = layout.read_record()
        fields = build_keywords(layout, catalogue, names)
        layout.write_info(info.with_fields(fields))
        rows = catalogue.indexed_count()
    return {"index_dir": str(layout.root), **fields, "keyword_rows": rows}


def _create(db: sqlite3.Connection, columns: Sequence[str]) -> None:
    names = ", ".join(f"c{i}" for i in range(len(columns)))
    db.execute(f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5({names}, tokenize='{TOKENIZER}')")
    db.execute(f"CREATE TABLE {INFO_TABLE} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.executemany(f"INSERT INTO {INFO_TABLE}(key, value) VALUES (?, ?)",
                   [("columns", json.dumps(list(columns))), ("tokenizer", TOKENIZER)])


def _insert_sql(count: int) -> str:
    return (f"INSERT INTO {FTS_TABLE}(rowid, {', '.join(f'c{i}' for i in range(count))}) "
            f"VALUES (?, {', '.join('?' * count)})")


def _metadata(data: str | None) -> dict[str, Any]:
    """A row's metadata JSON as a dict ({} where it is not one)."""
    try:
        value = json.loads(data) if data else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _text(value: object) -> str:
    """A cell as the text the keyword index holds: bounded, no NUL (a manifest's cells are hostile)."""
    if value is None or isinstance(value, (dict, list)):
        return ""
    return str(value)[:MAX_EXTRA_CHARS].replace("\x00", " ")


def _row_texts(catalogue: Catalogue, columns: Sequence[str], ids: np.ndarray | None) -> Iterator[tuple]:
    """(id, text of each column) of the indexed rows (``ids``: those alone, sorted), one at a time."""
    sql = ("SELECT i.id, i.label, m.data FROM images i LEFT JOIN metadata m ON m.id = i.id WHERE i.status = ? "
           "ORDER BY i.id")
    wanted = None if ids is None else set(ids.tolist())
    if wanted is not None and not wanted:
        return
    for image_id, label, data in catalogue.db.execute(sql, (Status.DONE,)):
        if wanted is not None and image_id not in wanted:
            continue
        extra = _metadata(data) | {LABEL: label}
        yield (int(image_id), *(_text(extra.get(column)) for column in columns))


def _batches(rows: Iterable[tuple]) -> Iterator[list[tuple]]:
    batch: list[tuple] = []
    for row in rows:
        batch.append(row)
        if len(batch) == BATCH_ROWS:
            yield batch
            batch = []
    if batch:
        yield batch
