"""``retrieval index export``: an index's searchable images as files other tools read as they are.

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
import glob
import json
import logging
import os
import secrets
import shutil
import sqlite3
import sys
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path, PurePath
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.errors import ParameterError
from retrieval.index.catalogue import ROW_COLUMNS, CatalogueReader, Status
from retrieval.index.layout import IndexLayout, describe_writer
from retrieval.index.search import gallery_root, public_path
from retrieval.index.shards import ShardStore
from retrieval.index.sources import printable_path
from retrieval.utils.io import fsync_dir
from retrieval.utils.progress import progress_bar

log = logging.getLogger(__name__)

FORMATS = ("parquet", "npy")
EXPORT_FORMAT = "retrieval-index-export/1"
MANIFEST = "_export.json"  # "_": pyarrow's dataset discovery (pandas.read_parquet of the folder) skips it
SCHEMA_KEY = "retrieval"  # parquet schema metadata key holding the facts (JSON)
RELATIVE_PATHS = "relative to gallery_root"  # the facts' ``paths`` of an export whose paths are relative
CHUNK_BYTES = 16 * 2**20  # vectors read and written at a time (a parquet row group); peak memory: a few times it
DEFAULT_ROWS_PER_FILE = 1_000_000  # rows per part file of a folder export
PROGRESS_MIN_ROWS = 50_000  # smaller exports take a second or two: no bar
SHARDS_CACHED = 4  # shards kept in memory: rows re-added after a remove live in later shards than their neighbours

# exported catalogue columns first, in this order; the row's state columns are the same for every done row
_EXPORTED = ("id", "path", "label", "sha256", "size")
_NOT_EXPORTED = ("status", "error", "duplicate_of", "shard")
_RESERVED = ("embedding",)


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
        if info.get("count") is not None and int(info["count"]) != count:  # no faiss read: the number it recorded
            raise layout.inconsistent(
                f"its faiss part holds {info['count']} vectors but the catalogue has {count} indexed images"
            )
        facts = _facts(layout, info, reader, count, absolute_paths)
        root = None if absolute_paths else PurePath(facts["gallery_root"])
        rows = _Rows(layout, reader, int(info["embedding_dim"]), root)
        chunk = int(chunk_rows) if chunk_rows is not None else max(1, CHUNK_BYTES // (4 * rows.dim))
        plan = _parts(count, max(count, 1) if single_file else int(rows_per_file))
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        log.info("exporting %d images of %s to %s (%s)", count, layout.root, out, fmt)
        sink = None
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale(out)
            sink = _Sink(tmp, out.name, fmt, single_file, rows.schema(facts), len(plan))
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
            _fsync_tree(tmp)
            _publish(tmp, out)
        except BaseException as exc:
            if sink is not None:
                sink.abort()
            _remove(tmp)
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
        "embedding_dim": int(info["embedding_dim"]),
        "model_hash": info.get("model_hash"),
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


def _require_complete(layout: IndexLayout) -> dict[str, Any]:
    """index.json of a finished index that no writer holds (what it records must match the catalogue)."""
    layout.require_finished()
    writer = layout.writer()
    if writer is not None:
        raise RuntimeError(f"the index in {layout.root} is being written by {describe_writer(writer)}; export it when "
                           "that finishes")
    return layout.read_info()


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


# --- what is exported ---------------------------------------------------------------------------------------------
Column = tuple[str, str, pa.DataType]  # (exported name, source name, arrow type)


def _unique(name: str, taken: set[str], prefix: str) -> str:
    """``name``, else ``prefix + name``, else that with ``_2``, ``_3``...: the first not in ``taken`` (added to it).
    Two columns of one name would make an export that pandas and pyarrow refuse to read."""
    chosen = name if name not in taken else prefix + name
    number = 2
    while chosen in taken:
        chosen, number = f"{prefix}{name}_{number}", number + 1
    taken.add(chosen)
    return chosen


def _extra_columns(db: sqlite3.Connection) -> list[Column]:
    """Columns of the ``images`` table beyond the known ones (a newer schema's), typed by their SQLite affinity."""
    known = set(ROW_COLUMNS) | set(_NOT_EXPORTED)
    taken = {*_EXPORTED, *_RESERVED}
    extras = []
    for _, name, declared, *_ in db.execute("PRAGMA table_info(images)"):
        if name in known:
            continue
        declared = (declared or "").upper()
        real = any(t in declared for t in ("REAL", "FLOA", "DOUB"))
        kind = (pa.int64() if "INT" in declared else pa.float64() if real
                else pa.binary() if "BLOB" in declared else pa.string())
        extras.append((_unique(name, taken, "catalogue_"), name, kind))
    return extras


def _has_metadata(db: sqlite3.Connection) -> bool:
    """Whether the catalogue keeps a manifest's other columns per row (``metadata``: id, JSON object)."""
    sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'metadata'"
    return db.execute(sql).fetchone() is not None


def _metadata_columns(db: sqlite3.Connection, taken: set[str]) -> list[Column]:
    """The keys of the indexed rows' ``metadata`` objects (a manifest's columns, e.g. split), in first-seen order,
    each typed by the values it holds: int64, float64, else string. One streamed pass: only the keys are kept."""
    kinds: dict[str, set[str]] = {}
    sql = "SELECT m.id, m.data FROM metadata m JOIN images i ON i.id = m.id WHERE i.status = ? ORDER BY m.id"
    for image_id, data in db.execute(sql, (Status.DONE.value,)):
        for key, value in _metadata_object(image_id, data).items():
            kinds.setdefault(key, set()).add(_kind(value))
    columns = []
    for key, seen in kinds.items():
        seen.discard("null")
        kind = pa.string() if not seen or "str" in seen else pa.int64() if seen == {"int"} else pa.float64()
        columns.append((_unique(key, taken, "manifest_"), key, kind))
    return columns


def _metadata_object(image_id: int, data: str | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        values = json.loads(data)
    except ValueError:
        values = None
    if not isinstance(values, dict):
        raise ValueError(f"the catalogue's metadata of image {image_id} is not a JSON object; rebuild the index from "
                         "its manifest")
    return values


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "str"
    if isinstance(value, int):
        return "int" if -(2**63) <= value < 2**63 else "str"
    return "float"


def _typed(values: list[Any], kind: pa.DataType, name: str) -> pa.Array:
    """One column's values as ``kind`` (strings for a column whose values mix numbers and text)."""
    if pa.types.is_string(kind):
        values = [v if v is None or isinstance(v, str) else json.dumps(v) for v in values]
    try:
        return pa.array(values, kind)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"catalogue column {name!r} holds a value that is not {kind}: {exc}") from exc


def _facts(
    layout: IndexLayout, info: dict[str, Any], reader: CatalogueReader, count: int, absolute: bool
) -> dict[str, Any]:
    root = gallery_root(info, reader)
    return {
        "format": EXPORT_FORMAT,
        "index_dir": str(layout.root.resolve()),
        "model_hash": info.get("model_hash"),
        "model_path": info.get("model_path"),
        "embedding_dim": int(info["embedding_dim"]),
        "dtype": "float32",
        "normalized": True,  # the index L2-normalises every vector it stores (retrieval.index.query_embedder)
        "metric": "cosine",  # = inner product of these unit vectors (faiss METRIC_INNER_PRODUCT, "ip")
        "similarity": info.get("similarity"),
        "model_normalized": info.get("model_normalized"),
        "index_key": info.get("index_key"),
        "count": int(count),
        "gallery_root": str(root),
        "paths": "absolute" if absolute else RELATIVE_PATHS,
        # the build's --split and --label-from: one value for the gallery, not recorded per row
        "gallery_split": reader.get_meta("gallery_split"),
        "label_from": reader.get_meta("label_from"),
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }



class _Rows:
    """The done rows in id order, ``count`` at a time: catalogue pages (keyset on id) + their vectors."""

    def __init__(self, layout: IndexLayout, reader: CatalogueReader, dim: int, root: PurePath | None) -> None:
        self.layout, self.reader, self.dim, self.root = layout, reader, dim, root
        db = reader.db
        self.extras = _extra_columns(db)
        with_metadata = _has_metadata(db)
        taken = {*_EXPORTED, *_RESERVED, *(name for name, _, _ in self.extras)}
        self.metadata = _metadata_columns(db, taken) if with_metadata else []
        self.store = ShardStore(layout.shards, read_only=True)
        self.cache: OrderedDict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self.last_id = -(2**63)
        self.read = 0
        selected = [f"i.{name}" for name in (*_EXPORTED, "shard")] + ["m.data" if with_metadata else "NULL"]
        selected += [f"i.{_quote(source)}" for _, source, _ in self.extras]
        joined = " LEFT JOIN metadata m ON m.id = i.id" if with_metadata else ""
        self.sql = (f"SELECT {', '.join(selected)} FROM images i{joined} WHERE i.status = ? AND i.id > ? "
                    "ORDER BY i.id LIMIT ?")
        fields = self.metadata_fields()
        self.metadata_schema = pa.schema(fields)
        self.columns = [f.name for f in fields]

    def metadata_fields(self) -> list[pa.Field]:
        """id, path, label, split (a manifest's, where recorded), sha256, size, then the other columns."""
        split = [c for c in self.metadata if c[0] == "split"]
        others = [c for c in self.metadata if c[0] != "split"]
        return [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("path", pa.string(), nullable=False),
            pa.field("label", pa.string()),
            *(pa.field(name, kind) for name, _, kind in split),
            pa.field("sha256", pa.string()),
            pa.field("size", pa.int64()),
            *(pa.field(name, kind) for name, _, kind in (*self.extras, *others)),
        ]

    def schema(self, facts: dict[str, Any]) -> pa.Schema:
        """Every column, the embedding last, with the facts in the schema metadata."""
        embedding = pa.field("embedding", pa.list_(pa.float32(), self.dim), nullable=False)
        return pa.schema([*self.metadata_fields(), embedding], metadata={SCHEMA_KEY: json.dumps(facts)})

    def next(self, count: int) -> tuple[pa.Table, np.ndarray]:
        """The next ``count`` rows (fewer at the end): their metadata table and their vectors [n, d]."""
        page = self.reader.db.execute(self.sql, (Status.DONE.value, self.last_id, count)).fetchall()
        if not page:
            raise self.layout.inconsistent(f"the catalogue ran out of indexed rows after {self.read}")
        self.last_id = int(page[-1][0])
        self.read += len(page)
        ids = np.fromiter((row[0] for row in page), np.int64, len(page))
        vectors = self._vectors(ids, [row[5] for row in page])
        paths = [row[1] for row in page]
        values: dict[str, pa.Array] = {
            "id": pa.array(ids, pa.int64()),
            "path": pa.array(paths if self.root is None else [public_path(p, self.root) for p in paths], pa.string()),
            "label": pa.array([row[2] for row in page], pa.string()),
            "sha256": pa.array([row[3] for row in page], pa.string()),
            "size": pa.array([row[4] for row in page], pa.int64()),
        }
        for offset, (name, source, kind) in enumerate(self.extras, start=7):
            values[name] = _typed([row[offset] for row in page], kind, source)
        if self.metadata:
            objects = [_metadata_object(row[0], row[6]) for row in page]
            for name, source, kind in self.metadata:
                values[name] = _typed([o.get(source) for o in objects], kind, source)
        return pa.Table.from_arrays([values[f.name] for f in self.metadata_schema], schema=self.metadata_schema), \
            vectors

    def _vectors(self, ids: np.ndarray, shards: list[str | None]) -> np.ndarray:
        """The vectors of ``ids``, each from the shard the catalogue names (an image removed and added again also
        has an older vector in an older shard, which must not come back)."""
        out = np.empty((len(ids), self.dim), np.float32)
        names = np.array([s or "" for s in shards], dtype=object)
        for name in dict.fromkeys(names.tolist()):
            rows = np.flatnonzero(names == name)
            sorted_ids, order, vectors = self._shard(name)
            wanted = ids[rows]
            at = np.minimum(np.searchsorted(sorted_ids, wanted), max(len(sorted_ids) - 1, 0))
            if not len(sorted_ids) or not np.array_equal(sorted_ids[at], wanted):
                missing = wanted[sorted_ids[at] != wanted] if len(sorted_ids) else wanted
                raise self.layout.inconsistent(f"shard {name} holds no vector for the indexed image(s) "
                                               f"{', '.join(map(str, missing[:5].tolist()))}")
            out[rows] = vectors[order[at]]
        return out

    def _shard(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sorted ids, their rows in the shard, vectors) of one shard, from a small LRU cache."""
        if name in self.cache:
            self.cache.move_to_end(name)
            return self.cache[name]
        if not name:
            raise self.layout.inconsistent("an indexed image has no shard recorded in the catalogue")
        try:
            shard = self.store.read(name, with_outcomes=False)
        except FileNotFoundError:
            raise self.layout.inconsistent(f"shard {name}, which the catalogue names, is missing") from None
        if shard.vectors.ndim != 2 or shard.vectors.shape[1] != self.dim:
            raise self.layout.inconsistent(f"shard {name} holds vectors of shape {shard.vectors.shape}, not "
                                           f"[n, {self.dim}] as index.json records")
        ids = np.asarray(shard.ids, np.int64)
        order = np.argsort(ids, kind="stable")
        entry = (ids[order], order, np.asarray(shard.vectors, np.float32))
        self.cache[name] = entry
        if len(self.cache) > SHARDS_CACHED:
            self.cache.popitem(last=False)
        return entry


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _parts(count: int, rows_per_file: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of the part files; one (maybe empty) part at least."""
    return [(start, min(start + rows_per_file, count)) for start in range(0, count, rows_per_file)] or [(0, 0)]


# --- writing ------------------------------------------------------------------------------------------------------
class _Sink:
    """The files of one export under the temporary path ``tmp``, part by part."""

    def __init__(self, tmp: Path, name: str, fmt: str, single_file: bool, schema: pa.Schema, parts: int) -> None:
        self.tmp, self.name, self.fmt, self.single_file, self.schema = tmp, name, fmt, single_file, schema
        self.width = max(5, len(str(parts - 1)))  # zero-padded: file-name order is row order
        self.files: list[str] = []
        # dictionary pages only where values repeat (labels, a manifest's columns): unique ids, paths, hashes and
        # float vectors would only cost memory and time before parquet falls back to plain encoding
        self.dictionary = [f.name for f in schema if f.name not in ("id", "path", "sha256", "size", "embedding")]
        self.writer: pq.ParquetWriter | None = None
        self.npy: Any = None
        self.npy_rows = self.npy_written = 0
        if not single_file:
            tmp.mkdir()
            if fmt == "npy":
                (tmp / "embeddings").mkdir()
                (tmp / "metadata").mkdir()

    def open(self, part: int, rows: int) -> None:
        name = f"part-{part:0{self.width}d}"
        if self.fmt == "parquet":
            if self.single_file:
                self.writer = pq.ParquetWriter(self.tmp, self.schema, use_dictionary=self.dictionary)
                self.files.append(self.name)
            else:
                self.writer = pq.ParquetWriter(self.tmp / f"{name}.parquet", self.schema,
                                               use_dictionary=self.dictionary)
                self.files.append(f"{name}.parquet")
            return
        metadata = self.schema.remove(self.schema.get_field_index("embedding"))
        self.writer = pq.ParquetWriter(self.tmp / "metadata" / f"{name}.parquet", metadata,
                                       use_dictionary=self.dictionary)
        self.npy = open(self.tmp / "embeddings" / f"{name}.npy", "xb")  # noqa: SIM115  (closed in close())
        dim = self.schema.field("embedding").type.list_size
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": False,
                  "shape": (rows, dim)}
        np.lib.format.write_array_header_1_0(self.npy, header)  # then the rows, streamed: no [n, d] array in memory
        self.npy_rows, self.npy_written = rows, 0
        self.files += [f"embeddings/{name}.npy", f"metadata/{name}.parquet"]

    def write(self, table: pa.Table, vectors: np.ndarray) -> None:
        if self.fmt == "parquet":
            flat = pa.array(np.ascontiguousarray(vectors, np.float32).reshape(-1), pa.float32())
            embedding = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
            table = pa.Table.from_arrays([*table.columns, embedding], schema=self.schema)
            self.writer.write_table(table)
            return
        self.writer.write_table(table)
        self.npy.write(np.ascontiguousarray(vectors, "<f4").data)  # the buffer itself: no bytes copy
        self.npy_written += len(vectors)

    def abort(self) -> None:
        """Close whatever is open (the files are deleted by the caller)."""
        for handle in (self.writer, self.npy):
            with contextlib.suppress(Exception):
                if handle is not None:
                    handle.close()
        self.writer = self.npy = None

    def close(self) -> None:
        self.writer.close()
        self.writer = None
        if self.npy is not None:
            self.npy.close()
            self.npy = None
            if self.npy_written != self.npy_rows:
                raise RuntimeError(f"wrote {self.npy_written} rows into a .npy file that declares {self.npy_rows}")


def _fsync_tree(path: Path) -> None:
    """Make every file written durable before the rename publishes it."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    for folder in [p for p in path.rglob("*") if p.is_dir()] + ([path] if path.is_dir() else []):
        fsync_dir(folder)


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished export into place. A file replaces a file atomically; anything else that is there (an
    empty folder or file, an earlier export with --overwrite) is moved aside first and deleted after."""
    aside = None
    if os.path.lexists(out):
        if tmp.is_dir() and out.is_dir() and not any(out.iterdir()):
            pass  # rename(2) replaces an empty folder
        elif not (tmp.is_file() and out.is_file()):
            aside = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(out, aside)
    try:
        os.replace(tmp, out)
    except BaseException:
        if aside is not None:
            os.rename(aside, out)  # put the earlier export back
        raise
    fsync_dir(out.parent)
    if aside is not None:
        _remove(aside)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _remove_stale(out: Path) -> None:
    """Delete what an export to ``out`` that was killed left behind (its process is gone)."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        pid = stale.name.rpartition(".tmp-")[2].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            _remove(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
