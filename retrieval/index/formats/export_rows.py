"""What ``retrieval index export`` (``table_export``) writes, read from the index: the ``done`` rows in id order,
a page of catalogue rows at a time (keyset on id) with their vectors from the shards the catalogue names, as arrow
tables, and the columns and schema they are written with.

Columns: ``id``, ``path``, ``label``, a manifest's ``split`` where the catalogue kept it, ``sha256``, ``size``, any
further catalogue column (typed by its SQLite affinity) and a manifest's other columns (the keys of the
``metadata`` table's JSON objects, typed by the values they hold); a name that clashes with a column already
written gets a prefix (``catalogue_``, ``manifest_``) and ``_2``, ``_3``... if that is taken too.

Read side: imports neither the index writer nor torch.
"""

from __future__ import annotations

import json
import sqlite3
from collections import OrderedDict
from pathlib import PurePath
from typing import Any

import numpy as np
import pyarrow as pa

from retrieval.index.catalogue import ROW_COLUMNS, CatalogueReader, Status
from retrieval.index.layout import IndexLayout
from retrieval.index.search import public_path
from retrieval.index.shards import ShardStore

SCHEMA_KEY = "retrieval"  # parquet schema metadata key holding the facts (JSON)
SHARDS_CACHED = 4  # shards kept in memory: rows re-added after a remove live in later shards than their neighbours

# exported catalogue columns first, in this order; the row's state columns are the same for every done row
_EXPORTED = ("id", "path", "label", "sha256", "size")
_NOT_EXPORTED = ("status", "error", "duplicate_of", "shard")
_RESERVED = ("embedding",)

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



class ExportRows:
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
