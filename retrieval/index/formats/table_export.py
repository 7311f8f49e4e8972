"""``retrieval index export``: an index's searchable images as files other tools read as they are (the rows
and their columns: ``export_rows``; the files written and put in place: ``export_files``).

Only the ``done`` rows (what a search can return) are written, in id order: ``id``, ``path`` as the API shows it
(relative to the gallery root), ``label``, a manifest's ``split`` where the catalogue kept it, ``sha256``, ``size``
(bytes), any further catalogue column (a manifest's other columns, kept per row in the ``metadata`` table; a name
that clashes with a column already written gets a ``manifest_`` prefix, and ``_2``, ``_3``... if that is taken too:
every column name is written once), and the stored (L2-normalised, float32) embedding. Building from a manifest
refuses such names (``sources.RESERVED_COLUMNS``); the renaming is for catalogues written before that. Two formats:

``parquet``
    ``OUT.parquet`` (one file) or ``OUT/`` (a folder of ``part-NNNNN.parquet`` files of ``rows_per_file`` rows):
    columns ``id, path, label[, split], sha256, size, ..., embedding``; ``embedding`` is a fixed-size list of
    float32 (``pyarrow.FixedSizeListArray``; pyarrow's stored schema keeps the type through parquet), which
    ``pandas.read_parquet`` reads as one array per row and LanceDB takes as its vector type. The index's facts
    (``model_hash``, ``embedding_dim``, similarity, ``index_key``...) are in the schema metadata under ``retrieval``
    (JSON; ``read_facts``).
``npy``
    ``OUT/embeddings/part-NNNNN.npy`` (float32 [n, d]) and ``OUT/metadata/part-NNNNN.parquet`` (the same rows'
    id/path/label... in the same order): the layout of clip-retrieval's inference output (``img_emb/``,
    ``metadata/``), and ``autofaiss build_index --embeddings OUT/embeddings`` reads the ``.npy`` folder in file-name
    order (the names are zero-padded: file-name order is row order).

A folder export also holds ``_export.json`` (the facts and the files; the ``_`` keeps parquet readers of the folder
from taking it for data). Memory stays bounded: rows are read from the catalogue page by page (one SQLite read
transaction, so the whole export is one consistent view) and vectors shard by shard, ``chunk_rows`` at a time
(default: ``CHUNK_BYTES`` of vectors; the last few shards read are kept: an image re-added after a remove sits in
a later shard than its id neighbours).
Everything is written under a temporary name beside ``out`` and renamed into place at the end: a killed export
leaves no half file under the final name (the next export there removes the leftovers).

Read side: imports neither the index writer nor torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import pyarrow.parquet as pq

from retrieval.errors import ParameterError
from retrieval.index.catalogue import CatalogueReader, Status
from retrieval.index.formats.export_files import ExportSink, fsync_tree, part_ranges, publish, remove_path, remove_stale
from retrieval.index.formats.export_rows import SCHEMA_KEY, ExportRows
from retrieval.index.layout import IndexLayout, describe_writer
from retrieval.index.search import gallery_root
from retrieval.index.sources import printable_path
from retrieval.records.index_info import IndexInfo
from retrieval.utils.progress import progress_bar

log = logging.getLogger(__name__)

FORMATS = ("parquet", "npy")
EXPORT_FORMAT = "retrieval-index-export/1"
MANIFEST = "_export.json"  # "_": pyarrow's dataset discovery (pandas.read_parquet of the folder) skips it
RELATIVE_PATHS = "relative to gallery_root"  # the facts' ``paths`` of an export whose paths are relative
CHUNK_BYTES = 16 * 2**20  # vectors read and written at a time (a parquet row group); peak memory: a few times it
DEFAULT_ROWS_PER_FILE = 1_000_000  # rows per part file of a folder export
PROGRESS_MIN_ROWS = 50_000  # smaller exports take a second or two: no bar


def export_index(
    index_dir: str | Path,
    out: str | Path,
    fmt: str = "parquet",
    *,
    overwrite: bool = False,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    chunk_rows: int | None = None,
    absolute_paths: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Write the index's searchable rows (ids, paths, labels, metadata, embeddings) as parquet or npy; a summary."""
    started = time.perf_counter()
    fmt = _check_format(fmt)
    if isinstance(rows_per_file, bool) or int(rows_per_file) < 1:
        raise ValueError(f"rows_per_file must be at least 1, got {rows_per_file!r}")
    if chunk_rows is not None and (isinstance(chunk_rows, bool) or int(chunk_rows) < 1):
        raise ValueError(f"chunk_rows must be at least 1, got {chunk_rows!r}")
    layout = IndexLayout(index_dir)
    info = _require_complete(layout)
    out = Path(os.path.abspath(Path(out).expanduser()))  # absolute: "." has no name to put a temporary one beside
    single_file = fmt == "parquet" and out.suffix.lower() == ".parquet"
    _check_out(out, layout.root, overwrite)
    with CatalogueReader(layout.catalogue) as reader, _read_snapshot(reader.db):
        _require_no_pending(layout, reader)
        count = reader.indexed_count()
        recorded = info.vectors.count
        if recorded is not None and int(recorded) != count:  # no faiss read: the number it recorded
            raise layout.inconsistent(
                f"its faiss part holds {recorded} vectors but the catalogue has {count} indexed images"
            )
        facts = _facts(layout, info, reader, count, absolute_paths)
        root = None if absolute_paths else PurePath(facts["gallery_root"])
        rows = ExportRows(layout, reader, int(facts["embedding_dim"]), root)
        chunk = int(chunk_rows) if chunk_rows is not None else max(1, CHUNK_BYTES // (4 * rows.dim))
        plan = part_ranges(count, max(count, 1) if single_file else int(rows_per_file))
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        log.info("exporting %d images of %s to %s (%s)", count, layout.root, out, fmt)
        sink = None
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(out)
            sink = ExportSink(tmp, out.name, fmt, single_file, rows.schema(facts), len(plan))
            bar = progress_bar(total=count, desc="export", unit="img", file=sys.stderr, dynamic_ncols=True,
                       disable=not progress or count < PROGRESS_MIN_ROWS)
            with bar:
                for part, (start, stop) in enumerate(plan):
                    sink.open(part, stop - start)
                    done = start
                    while done < stop:
                        table, vectors = rows.next(min(chunk, stop - done))
                        sink.write(table, vectors)
                        done += len(vectors)
                        bar.update(len(vectors))
                    sink.close()
            if rows.read != count:  # the pages of one read transaction: cannot differ, unless the file is damaged
                raise layout.inconsistent(f"{rows.read} indexed rows were read but the catalogue counts {count}")
            files = sink.files
            if not single_file:
                manifest = facts | {"layout": "npy" if fmt == "npy" else "parquet folder", "files": files,
                                    "columns": rows.columns}
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            fsync_tree(tmp)
            publish(tmp, out)
        except BaseException as exc:
            if sink is not None:
                sink.abort()
            remove_path(tmp)
            if isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, FileExistsError)):
                # disk full, no permission...: one clear line (the command line shows RuntimeErrors without a trace)
                raise RuntimeError(f"the export to {out} failed: {exc}; nothing was written under that name (check "
                                   "the free space and permissions there, or choose another `out`)") from exc
            raise
    size = out.stat().st_size if single_file else sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return {
        "index_dir": str(layout.root),
        "out": str(out),
        "format": fmt,
        "layout": "file" if single_file else "folder",
        "rows": count,
        "embedding_dim": facts["embedding_dim"],
        "model_hash": info.model.hash,
        "columns": rows.columns,
        "files": files,
        "bytes": int(size),
        "paths": facts["paths"],
        "gallery_root": facts["gallery_root"],
        "seconds": round(time.perf_counter() - started, 2),
    }


def read_facts(path: str | Path) -> dict[str, Any]:
    """The index facts an export recorded: a parquet file's schema metadata, or a folder's ``_export.json``."""
    path = Path(path)
    if path.is_dir():
        return json.loads((path / MANIFEST).read_text())
    metadata = pq.read_schema(path).metadata or {}
    return json.loads(metadata[SCHEMA_KEY.encode()])


# --- checks -------------------------------------------------------------------------------------------------------
def _check_format(fmt: str) -> str:
    name = str(fmt).strip().lower().lstrip(".")
    if name not in FORMATS:
        raise ParameterError("fmt", f"{printable_path(str(fmt), 40)!r} is an unknown export format: use parquet (one "
                                    "table with the embeddings, for pandas and vector databases) or npy "
                                    "(embeddings/*.npy + metadata/*.parquet, for autofaiss)")
    return name


def _check_out(out: Path, index_root: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that would lose data or write into the index; ``overwrite`` replaces only a file or an
    earlier export folder (one holding ``_export.json``), never a folder of unknown content."""
    shown = printable_path(out)
    target, root = out.resolve(), index_root.expanduser().resolve()
    if target == root or target.is_relative_to(root) or root.is_relative_to(target):
        raise ParameterError("out", f"{shown} is the index folder {printable_path(root)}, inside it or around it; "
                                    "choose a path outside the index folder")
    if out.is_symlink():
        raise ParameterError("out", f"{shown} is a symbolic link; give the path it points to, or another path")
    if not out.exists():
        return
    if out.is_dir():
        if not any(out.iterdir()):
            return
        if not overwrite:
            raise FileExistsError(f"`out` {shown} exists and is not empty; choose another `out`, or pass `overwrite` "
                                  "to replace an earlier export there")
        if not (out / MANIFEST).is_file():
            raise FileExistsError(f"`out` {shown} is a folder that holds no earlier export (no {MANIFEST}): "
                                  "`overwrite` replaces only exports; choose another `out` or empty it yourself")
        return
    if not out.is_file():
        raise ParameterError("out", f"{shown} is not a regular file or folder; choose another path")
    if out.stat().st_size and not overwrite:
        raise FileExistsError(f"`out` {shown} exists and is not empty; choose another `out`, or pass `overwrite` to "
                              "replace it")


def _require_complete(layout: IndexLayout) -> IndexInfo:
    """index.json of a finished index that no writer holds (what it records must match the catalogue)."""
    layout.require_finished()
    writer = layout.writer()
    if writer is not None:
        raise RuntimeError(f"the index in {layout.root} is being written by {describe_writer(writer)}; export it when "
                           "that finishes")
    return layout.read_record()


def _require_no_pending(layout: IndexLayout, reader: CatalogueReader) -> None:
    if reader.get_meta("state") != "complete" or reader.counts()[Status.PENDING.value]:
        raise layout.unfinished()


@contextlib.contextmanager
def _read_snapshot(db: sqlite3.Connection) -> Iterator[None]:
    """One read transaction for the whole export: every page of rows comes from the same committed state, even if a
    writer commits meanwhile (WAL). It never writes: it ends with a rollback."""
    db.execute("BEGIN")
    try:
        yield
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _facts(
    layout: IndexLayout, info: IndexInfo, reader: CatalogueReader, count: int, absolute: bool
) -> dict[str, Any]:
    root, model = gallery_root(info, reader), info.model
    return {
        "format": EXPORT_FORMAT,
        "index_dir": str(layout.root.resolve()),
        "model_hash": model.hash,
        "model_path": model.path,
        "embedding_dim": int(model.embedding_dim),  # type: ignore[arg-type]  # a finished index records it
        "dtype": "float32",
        "normalized": True,  # the index L2-normalises every vector it stores (retrieval.index.query_embedder)
        "metric": "cosine",  # = inner product of these unit vectors (faiss METRIC_INNER_PRODUCT, "ip")
        "similarity": model.similarity,
        "model_normalized": model.normalized,
        "index_key": info.vectors.index_key,
        "count": int(count),
        "gallery_root": str(root),
        "paths": "absolute" if absolute else RELATIVE_PATHS,
        # the build's --split and --label-from: one value for the gallery, not recorded per row
        "gallery_split": reader.get_meta("gallery_split"),
        "label_from": reader.get_meta("label_from"),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
