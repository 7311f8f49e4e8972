"""The input of a build from embeddings (``writer.build_from_embeddings``): vectors someone already has, read as
hostile input, chunk by chunk.

The layout is what ``retrieval index export --format npy`` writes and clip-retrieval's inference writes:
``DIR/embeddings/*.npy`` (clip-retrieval: ``DIR/img_emb/*.npy``), float [n, d] parts read in file-name order, as
autofaiss reads them, and optionally ``DIR/metadata/*.parquet``, one part per ``.npy`` part (paired in file-name
order), holding the same rows in the same order.

Checked before anything is read: each ``.npy`` header (a ``.npy`` file of version 1 or 2 holding a 2-D array of
floats, never Python objects: nothing is unpickled; d at most ``MAX_DIM`` and the same in every part; a file as
long as its header says), each metadata part's row count against its ``.npy`` part's, the columns it has, and each
column chunk's uncompressed size against what its rows' values can take at their bounds
(``check_column_sizes``: a compressed bomb is refused from the file's metadata). Then the values, chunk by
chunk from a memory map (``CHUNK_BYTES`` of vectors at a time, never the whole set): every value finite and no row
all zeros, each error naming the file and the row. The vectors are stored L2-normalised as the index expects
(``query_embedder.l2_normalize_rows``); float32 rows of unit length already (an export's) are kept bit for bit.

Catalogue rows (``plan``, one transaction: all rows or none): the id from an integer ``id`` column (what the
export writes), else the row's place in the input from 1; the path from a ``path``, ``image_path`` or ``url``
column (a relative path is taken from the gallery root: the one an export recorded in ``_export.json``, else DIR;
a URL is kept as it is), else a name made from the part and row (``embeddings/part-00000.npy#12``, under DIR); the
label from a ``label`` column; ``sha256`` and ``size`` where the columns have those types; every other column of
text or numbers is kept as a manifest's are (``sources.extra_columns``): a search's ``where`` filters on them. A
path that resolves outside the gallery root (absolute, ``..``, through a symlink) is refused unless
``allow_outside_paths``: a server sends every catalogued file to whoever searches. A label or a kept column's text
over its bound (``MAX_LABEL_CHARS``, ``MAX_EXTRA_CHARS``) is refused, never cut.

Write side: ``writer`` imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import sqlite3
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.std import tqdm

from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue, Outcome, PlannedRow, Status
from retrieval.index.query_embedder import l2_normalize_rows
from retrieval.index.shards import ShardStore
from retrieval.index.sources import (
    MAX_EXTRA_CHARS,
    MAX_LABEL_CHARS,
    MAX_PATH_BYTES,
    extra_columns,
    extra_values,
    is_url,
    path_problem,
    printable_path,
)
from retrieval.utils.io import read_capped
from retrieval.utils.progress import progress_bar

log = logging.getLogger(__name__)

EMBEDDING_FOLDERS = ("embeddings", "img_emb")  # ours (``index export --format npy``), clip-retrieval's
METADATA_FOLDER = "metadata"
PATH_COLUMNS = ("path", "image_path", "url")  # the first one a metadata part has names its rows
CHUNK_BYTES = 16 * 2**20  # float32 vectors read at a time; the checks hold a float64 copy and a few masks
PLAN_BATCH_ROWS = 4096  # metadata rows read at a time while planning
MAX_DIM = 65_536  # d of one embedding: models give hundreds to a few thousand; a larger d is a file to refuse
MAX_HEADER_BYTES = 10_000  # numpy's own limit on a .npy header: a larger one is not a plain array's
MAX_EXPORT_RECORD_BYTES = 2**20  # _export.json: kilobytes
UNIT_TOLERANCE = 1e-6  # a float32 row whose norm is this close to 1 is of unit length already
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
MAX_ID = 2**63 - 1
# A metadata column chunk's uncompressed bytes, bounded from its file's metadata before any value is read (a few KB
# of zstd can hold gigabytes): per row, its value at its bound with a 4-byte length, up to VALUE_COPIES times, and
# PAGE_BYTES; per chunk, COLUMN_CHUNK_BYTES more. pyarrow's worst layout (a page per value) writes each value 3 times
# (itself, its page's min and max) and about 40 bytes of header and levels per page.
BYTES_PER_CHAR = 4  # UTF-8's longest character
SHA256_CHARS = 64
NUMBER_BYTES = 8  # an integer or float column's value, at its widest
VALUE_COPIES = 5  # the value, its page's min and max, and the deprecated min and max some writers fill too
PAGE_BYTES = 128  # a data page's header and levels, or a dictionary page's header and the value's index
COLUMN_CHUNK_BYTES = 4096  # the chunk's own headers and statistics
MAX_CACHED_FOLDERS = 65_536  # resolved folders kept while metadata paths are checked


@dataclass(frozen=True)
class Columns:
    """The metadata columns a part's rows are read from (``path``: the column that names each row, if any)."""

    path: str | None = None
    label: bool = False
    id: bool = False
    sha256: bool = False
    size: bool = False
    extras: tuple[str, ...] = ()

    def names(self) -> list[str]:
        """The columns to read, the kept extras last."""
        own = (self.path, "label" if self.label else None, "id" if self.id else None,
               "sha256" if self.sha256 else None, "size" if self.size else None)
        return [name for name in own if name] + list(self.extras)

    def identity(self) -> tuple[Any, ...]:
        """What every part must agree on (its kept extras may differ: a column missing from one part is empty)."""
        return self.path, self.label, self.id, self.sha256, self.size


@dataclass(frozen=True)
class Part:
    """One ``.npy`` part and its metadata part."""

    vectors: Path
    name: str  # "embeddings/part-00000.npy": how a generated path names its rows
    rows: int
    offset: int  # the input's row number of its first row: ids by position are offset + row + 1
    dtype: np.dtype
    metadata: Path | None = None
    columns: Columns | None = None

    @property
    def shown(self) -> str:
        """The ``.npy`` file as messages name it."""
        return printable_path(self.vectors)

    @property
    def metadata_shown(self) -> str:
        """The metadata part as messages name it."""
        return printable_path(self.metadata) if self.metadata is not None else self.shown


def _text(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _integer(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(kind)


def _number(name: str) -> int | None:
    """The number a part's file name ends with (``img_emb_3.npy``: 3), if any."""
    match = re.search(r"(\d+)$", Path(name).stem)
    return int(match.group(1)) if match else None


def read_header(path: Path) -> tuple[tuple[int, ...], np.dtype, int]:
    """A ``.npy`` file's shape, dtype and data offset, read from its header alone (no data, nothing unpickled)."""
    shown = printable_path(path)
    try:
        with open(path, "rb") as handle:
            try:
                version = np.lib.format.read_magic(handle)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(handle, max_header_size=MAX_HEADER_BYTES)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(handle, max_header_size=MAX_HEADER_BYTES)
                else:
                    shape, dtype = None, None
            except ValueError as exc:  # numpy's words for a file that is not a .npy, or a damaged header
                raise ValueError(f"{shown} is not a .npy file numpy can read ({exc}); write each part with "
                                 "numpy.save") from exc
            start = handle.tell()
            size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise ValueError(f"{shown} cannot be read ({exc.strerror or exc}); make it readable") from exc
    if shape is None:
        raise ValueError(f"{shown} is a .npy file of version {version[0]}.{version[1]}, which plain float arrays "
                         "never need; write it with numpy.save(path, vectors.astype(numpy.float32))")
    if dtype.hasobject:
        raise ValueError(f"{shown} holds Python objects (a pickle), not numbers; nothing is unpickled here: save "
                         "the vectors as a float array, numpy.save(path, vectors.astype(numpy.float32))")
    if len(shape) != 2:
        raise ValueError(f"{shown} holds a {len(shape)}-D array of shape {tuple(shape)}; a part is a 2-D array "
                         "[rows, d], one embedding per row: reshape it to (-1, d) before saving")
    if dtype.kind != "f":
        raise ValueError(f"{shown} holds {dtype} values, not floats; save the vectors as float32")
    if shape[1] < 1:
        raise ValueError(f"{shown} holds vectors of 0 dimensions (shape {tuple(shape)}); save the embeddings "
                         "themselves")
    if shape[1] > MAX_DIM:  # refused before the size check reads anything or a row of that d is allocated
        raise ValueError(f"{shown} holds {shape[1]}-d vectors (shape {tuple(shape)}); an embedding has at most "
                         f"{MAX_DIM} dimensions here (models give hundreds to a few thousand): save [rows, d] "
                         "arrays, one embedding per row")
    expected = start + shape[0] * shape[1] * dtype.itemsize
    if size != expected:
        raise ValueError(f"{shown} holds {size} bytes, but its header declares {shape[0]} x {shape[1]} {dtype} "
                         f"values ({expected} bytes with the header): it was cut short or changed; write it again "
                         "with numpy.save")
    return (int(shape[0]), int(shape[1])), dtype, start


def _columns(schema: Any, shown: str) -> Columns:
    """The columns a metadata part's rows are read from; ValueError naming the file for a column of a wrong type."""
    types = {field.name: field.type for field in schema}
    path = next((name for name in PATH_COLUMNS if name in types), None)
    if path is not None and not _text(types[path]):
        raise ValueError(f"{shown}: column {path!r} holds {types[path]}, not text; it names each row's image: write "
                         "it as strings, or rename it to keep it as a column of its own")
    label = "label" in types
    if label and not (_text(types["label"]) or _integer(types["label"])):
        raise ValueError(f"{shown}: column 'label' holds {types['label']}, not text or integers; write the labels "
                         "as strings, or rename the column")
    chosen = Columns(path=path, label=label, id="id" in types and _integer(types["id"]),
                     sha256="sha256" in types and _text(types["sha256"]),
                     size="size" in types and _integer(types["size"]))
    used = set(chosen.names())
    # text and numbers only, as a parquet manifest's; an id, sha256 or size of another type is refused there
    scalar = [field.name for field in schema if field.name not in used
              and (_text(field.type) or _integer(field.type) or _float(field.type))]
    return dataclasses.replace(chosen, extras=tuple(extra_columns(scalar, shown)))


def _float(kind: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_floating(kind)


def _value_bound(columns: Columns, name: str, kind: Any) -> tuple[int, str]:
    """The most bytes one value of column ``name`` may take, and that bound as people read it."""
    if _integer(kind) or _float(kind):
        return NUMBER_BYTES, "a number"
    if name == columns.path:  # a path is at most MAX_PATH_BYTES once joined to its folder
        return MAX_PATH_BYTES, f"{MAX_PATH_BYTES} bytes"
    chars = MAX_LABEL_CHARS if name == "label" and columns.label else \
        SHA256_CHARS if name == "sha256" and columns.sha256 else MAX_EXTRA_CHARS
    return BYTES_PER_CHAR * chars, f"{chars} characters"


def check_column_sizes(handle: Any, columns: Columns, names: list[str], shown: str) -> None:
    """Refuse a metadata part whose column chunks (of the columns ``names`` to read) hold more bytes uncompressed
    than their rows' values can take at their bounds, from the file's metadata alone: no value is read."""
    metadata = handle.metadata
    kinds = {field.name: field.type for field in handle.schema_arrow}
    place = {metadata.schema.column(j).path: j for j in range(metadata.num_columns)}
    bounds = {name: _value_bound(columns, name, kinds[name]) for name in names if name in place and name in kinds}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        rows = row_group.num_rows
        for name, (value_bytes, said) in bounds.items():
            size = row_group.column(place[name]).total_uncompressed_size
            bound = rows * (VALUE_COPIES * (value_bytes + 4) + PAGE_BYTES) + COLUMN_CHUNK_BYTES
            if size > bound:
                raise ValueError(
                    f"{shown}: column {name!r} of row group {group} ({rows:,} rows) holds {size:,} bytes, more than "
                    f"the {bound:,} that {rows:,} values of at most {said} take however they are laid out: a "
                    f"compressed bomb, or values over their bound; write the part again with every {name!r} value "
                    f"within {said} (nothing of it was read)")


def _parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own errors for a damaged file)
        raise ValueError(f"{printable_path(path)} is not a readable parquet file ({exc}); write the metadata part "
                         "again") from exc


def _gallery_root(root: Path) -> str:
    """The folder relative paths are taken from: the gallery root an export recorded (its paths are relative to
    it), else the input folder itself."""
    from retrieval.index.table_export import MANIFEST, RELATIVE_PATHS  # pyarrow: loaded when a build reads parquet

    record = root / MANIFEST
    if record.is_file():
        try:
            facts = json.loads(read_capped(record, MAX_EXPORT_RECORD_BYTES, "export record"))
        except (OSError, ValueError) as exc:
            log.warning("%s is not an export record (%s): relative paths are taken from %s", printable_path(record),
                        exc, printable_path(root))
            facts = None
        recorded = facts.get("gallery_root") if isinstance(facts, dict) else None
        if (isinstance(recorded, str) and facts.get("paths") == RELATIVE_PATHS and os.path.isabs(recorded)
                and path_problem(recorded) is None):
            return os.path.normpath(recorded)
    return str(root.resolve())


@dataclass
class EmbeddingsInput:
    """A checked input folder: its parts, their dimension, the gallery root; ``plan`` and ``copy_pending`` read
    it (``check_values`` first, for a new build)."""

    root: Path  # as given
    folder: Path  # the folder of .npy parts
    parts: list[Part]
    dim: int
    rows: int
    gallery_root: str
    chunk_rows: int
    fingerprint: str  # the parts' names, sizes and modification times: a resumed build must read the same input
    allow_outside_paths: bool = False  # catalogue metadata paths that resolve outside the gallery root too
    at: tuple[Part, int, PlannedRow | None] | None = None  # the row being planned (for an IntegrityError)
    real_folders: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)  # folder -> resolved

    @functools.cached_property
    def real_root(self) -> str:
        """The gallery root with its symlinks resolved: what a metadata path must resolve under."""
        return os.path.realpath(self.gallery_root)

    # --- the vectors
    def load(self, part: Part) -> np.ndarray:
        """``part``'s vectors as a read-only memory map (nothing read yet), checked against its header."""
        try:
            array = np.load(part.vectors, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{part.shown} cannot be read as a .npy array ({exc}); write it again with "
                             "numpy.save") from exc
        if array.shape != (part.rows, self.dim) or array.dtype != part.dtype:
            raise ValueError(f"{part.shown} changed while it was being read (now {array.shape} {array.dtype}, was "
                             f"{(part.rows, self.dim)} {part.dtype}); leave the input alone while a build reads it")
        return array

    def vectors(self, part: Part, array: np.ndarray, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of ``part`` as unit float32 vectors; ValueError naming the file and the row for a value
        that is not finite or a row of zeros."""
        block = array[start:stop]
        wide = np.asarray(block, dtype=np.float64)  # read from the map; float64: no overflow in the checks below
        finite = np.isfinite(wide).all(axis=1)
        if not finite.all():
            row = start + int(np.flatnonzero(~finite)[0])
            raise ValueError(f"{part.shown} row {row} holds a value that is not finite (NaN or infinity); fix that "
                             "row, or drop it and its metadata row")
        scale = np.abs(wide).max(axis=1)
        if not scale.all():
            row = start + int(np.flatnonzero(scale == 0)[0])
            raise ValueError(f"{part.shown} row {row} is all zeros: it has no direction to compare by cosine; drop "
                             "it and its metadata row")
        if part.dtype.itemsize == 4:  # float32 rows of unit length already (an export's): kept bit for bit
            norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))
            if np.all(np.abs(norms - 1.0) <= UNIT_TOLERANCE):
                return np.ascontiguousarray(block, dtype=np.float32)
        wide = wide / scale[:, None]  # largest component 1 first: a float64 vector's norm can overflow float32
        return l2_normalize_rows(wide)

    def chunks(self, part: Part) -> Iterator[tuple[int, int]]:
        """[start, stop) of ``part``'s chunks of ``chunk_rows`` rows."""
        for start in range(0, part.rows, self.chunk_rows):
            yield start, min(start + self.chunk_rows, part.rows)

    def check_values(self, progress: bool = True) -> None:
        """Read every vector once, chunk by chunk: a value that is not finite or a row of zeros is refused, naming
        its file and row, before the build records anything."""
        with _bar(self.rows, "check", progress) as bar:
            for part in self.parts:
                if not part.rows:
                    continue
                array = self.load(part)
                for start, stop in self.chunks(part):
                    self.vectors(part, array, start, stop)
                    bar.update(stop - start)
                del array

    # --- the catalogue rows
    def plan(self, catalogue: Catalogue, meta: dict[str, str]) -> int:
        """Catalogue every row as ``pending`` with ``meta`` (the build's record), in one transaction; a row whose
        metadata cannot be catalogued is refused, naming its file and row, and nothing is recorded."""
        try:
            return catalogue.plan_rows(self.planned_rows(), meta)
        except sqlite3.IntegrityError as exc:
            if self.at is None or self.at[2] is None:
                raise
            part, row, planned = self.at
            where = f"{part.metadata_shown} row {row}"
            if "images.path" in str(exc):
                raise ValueError(f"{where}: its path {printable_path(planned.path)} is another row's too; each row "
                                 "needs a path of its own (two rows of one image: drop one of them, with its "
                                 "embedding)") from exc
            if "images.id" in str(exc):
                raise ValueError(f"{where}: its id {planned.id} is another row's too; ids must be unique (or drop "
                                 "the id column: the rows are then numbered by their place)") from exc
            raise
        finally:
            self.at = None

    def planned_rows(self) -> Iterator[PlannedRow]:
        """Every row's catalogue entry, in input order, read a batch at a time."""
        for part in self.parts:
            columns = part.columns.names() if part.columns is not None else []
            if not columns:
                for row in range(part.rows):
                    planned = PlannedRow(part.offset + row + 1, self.generated_path(part, row))
                    self.at = (part, row, planned)
                    yield planned
                continue
            row = 0
            for batch in self._batches(part, columns, PLAN_BATCH_ROWS):
                values = batch.to_pydict()
                for n in range(batch.num_rows):
                    self.at = (part, row, None)
                    planned = self._planned(part, row, {name: values[name][n] for name in columns})
                    self.at = (part, row, planned)
                    yield planned
                    row += 1

    def generated_path(self, part: Part, row: int) -> str:
        """The name of a row no metadata names: its part and row, under the input folder."""
        return os.path.join(str(self.root.resolve()), f"{part.name}#{row}")

    def _planned(self, part: Part, row: int, values: dict[str, Any]) -> PlannedRow:
        columns = part.columns
        assert columns is not None
        where = f"{part.metadata_shown} row {row}"
        if columns.id:
            image_id = values["id"]
            if image_id is None or not 0 <= int(image_id) < MAX_ID:
                raise ValueError(f"{where}: its id is {image_id}; ids are whole numbers from 0 to 2^63 - 2 (or drop "
                                 "the id column: the rows are then numbered by their place)")
        else:
            image_id = part.offset + row + 1
        path = self._path(where, columns.path, values[columns.path]) if columns.path else \
            self.generated_path(part, row)
        return PlannedRow(int(image_id), path, _label(where, values.get("label")) if columns.label else None,
                          _sha256(where, values.get("sha256")) if columns.sha256 else None,
                          _size(where, values.get("size")) if columns.size else None,
                          extra_values(_bounded(where, values, columns.extras), columns.extras))

    def _path(self, where: str, column: str, value: Any) -> str:
        text = "" if value is None else str(value)
        if not text.strip():
            raise ValueError(f"{where}: its {column!r} is empty; give every row a path (or drop the column: the "
                             "rows are then named by their part and place)")
        path = text if is_url(text) else os.path.normpath(os.path.join(self.gallery_root, text))
        problem = path_problem(path)
        if problem is not None:
            raise ValueError(f"{where}: {printable_path(text, 80)}: {problem}")
        real = None if is_url(path) or self.allow_outside_paths else self._outside(path)
        if real is not None:  # a server sends any catalogued file to whoever searches
            raise ValueError(
                f"{where}: its {column} {printable_path(text)} resolves to {printable_path(real)}, outside "
                f"{printable_path(self.real_root)}, the folder this input's paths are taken from; a server sends "
                "every catalogued file to whoever searches it: move the files into that folder, or give "
                "`allow_outside_paths` if every file the metadata names may be sent")
        return path

    def _outside(self, path: str) -> str | None:
        """What ``path`` resolves to (its folders' symlinks and its own followed) when that is outside the gallery
        root, else None. Folders are resolved once each: a gallery has far fewer folders than images."""
        folder, name = os.path.split(path)
        real_folder = self.real_folders.get(folder)
        if real_folder is None:
            if len(self.real_folders) >= MAX_CACHED_FOLDERS:
                self.real_folders.clear()
            real_folder = self.real_folders[folder] = os.path.realpath(folder)
        real = os.path.join(real_folder, name)
        if os.path.islink(real):
            real = os.path.realpath(real)
        inside = _within(real, self.real_root)
        return None if inside else real

    def _batches(self, part: Part, columns: list[str], size: int) -> Iterator[Any]:
        """The metadata part's ``columns``, ``size`` rows at a time (fewer at a row group's end); its row count
        checked again against the ``.npy`` part's."""
        assert part.metadata is not None and part.columns is not None
        handle = _parquet(part.metadata)
        check_column_sizes(handle, part.columns, columns, part.metadata_shown)  # checked again: this is what is read
        try:
            batches = handle.iter_batches(batch_size=size, columns=columns)
        except Exception as exc:  # noqa: BLE001  (pyarrow's own errors)
            raise _unreadable(part, exc) from exc
        count = 0
        while True:
            try:
                batch = next(batches, None)
            except Exception as exc:  # noqa: BLE001  (a damaged page is found as it is read)
                raise _unreadable(part, exc) from exc
            if batch is None:
                break
            count += batch.num_rows
            if count > part.rows:
                break
            yield batch
        if count != part.rows:
            raise ValueError(f"{part.metadata_shown} changed while it was being read ({count} rows read, "
                             f"{part.rows} when the build started); leave the input alone while a build reads it")

    def ids(self, part: Part) -> Iterator[tuple[int, np.ndarray]]:
        """(first row, catalogue ids) of ``part``'s rows, about ``chunk_rows`` at a time."""
        if part.columns is None or not part.columns.id:
            for start, stop in self.chunks(part):
                yield start, np.arange(part.offset + start + 1, part.offset + stop + 1, dtype=np.int64)
            return
        start = 0
        for batch in self._batches(part, ["id"], self.chunk_rows):
            column = batch.column(0)
            if column.null_count:
                raise ValueError(f"{part.metadata_shown} changed while it was being read (an id is missing now); "
                                 "leave the input alone while a build reads it")
            yield start, column.to_numpy(zero_copy_only=False).astype(np.int64)
            start += batch.num_rows

    # --- the shards
    def copy_pending(self, catalogue: Catalogue, store: ShardStore, shard_size: int, progress: bool = True) -> int:
        """Write the vectors of the catalogue's ``pending`` rows into shards, ``shard_size`` rows each: each shard is
        written whole, then its rows are recorded ``done`` in one transaction (an interrupted copy resumes from the
        rows still pending, as an image build's ingest does); returns how many rows it copied."""
        pending = catalogue.counts()[Status.PENDING.value]
        if not pending:
            return 0
        buffer = _Buffer()
        with _bar(pending, "copy", progress) as bar:
            for part in self.parts:
                if not part.rows:
                    continue
                array = self.load(part)
                for start, ids in self.ids(part):
                    statuses = catalogue.status_of(ids.tolist())
                    wanted = np.fromiter((statuses.get(int(i)) == Status.PENDING for i in ids), bool, len(ids))
                    if not wanted.any():
                        continue
                    vectors = self.vectors(part, array, start, start + len(ids))[wanted]
                    rows = catalogue.rows(ids[wanted].tolist())
                    buffer.add(ids[wanted], vectors, [Outcome(int(i), Status.DONE, rows[int(i)]["sha256"],
                                                              rows[int(i)]["size"]) for i in ids[wanted]])
                    if len(buffer) >= shard_size:
                        bar.update(buffer.flush(catalogue, store, shard_size))
                del array
            bar.update(buffer.flush(catalogue, store, shard_size, last=True))
        left = catalogue.counts()[Status.PENDING.value]
        if left:  # the fingerprint makes this unlikely: rows planned from an input that no longer holds them
            raise ValueError(f"{left} catalogued rows were not found in {printable_path(self.root)}, the input they "
                             "were planned from; build from it into another folder")
        return pending


class _Buffer:
    """Rows copied and not yet written as a shard."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.vectors: list[np.ndarray] = []
        self.outcomes: list[Outcome] = []

    def __len__(self) -> int:
        return len(self.outcomes)

    def add(self, ids: np.ndarray, vectors: np.ndarray, outcomes: list[Outcome]) -> None:
        self.ids.append(ids)
        self.vectors.append(vectors)
        self.outcomes += outcomes

    def flush(self, catalogue: Catalogue, store: ShardStore, shard_size: int, last: bool = False) -> int:
        """Write every full shard of ``shard_size`` rows (``last``: the rest too), each written whole, then its rows
        recorded; returns how many rows. One concatenation for them all: a chunk may fill many shards."""
        if not self.outcomes:
            return 0
        ids, vectors, outcomes = np.concatenate(self.ids), np.concatenate(self.vectors), self.outcomes
        end = len(outcomes) if last else len(outcomes) - len(outcomes) % shard_size
        for start in range(0, end, shard_size):
            stop = min(start + shard_size, end)
            name = store.write(ids[start:stop], vectors[start:stop], outcomes[start:stop])
            catalogue.record([dataclasses.replace(o, shard=name) for o in outcomes[start:stop]])
        self.ids, self.vectors, self.outcomes = [ids[end:]], [vectors[end:]], outcomes[end:]
        return end


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return progress_bar(total=total, desc=desc, unit="vec", file=sys.stderr, dynamic_ncols=True,
                        disable=not progress)


def _unreadable(part: Part, exc: Exception) -> ValueError:
    return ValueError(f"{part.metadata_shown} cannot be read as parquet ({exc}); write the metadata part again")


def _label(where: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    label = str(value)
    if len(label) > MAX_LABEL_CHARS:
        raise ValueError(f"{where}: its label {printable_path(label, 60)} has {len(label)} characters, more than "
                         f"{MAX_LABEL_CHARS}; shorten it (labels are kept whole, never cut)")
    return label


def _bounded(where: str, values: dict[str, Any], extras: tuple[str, ...]) -> dict[str, Any]:
    """``values``, each kept column's text within ``MAX_EXTRA_CHARS`` (a longer one is refused, never cut)."""
    for name in extras:
        value = values.get(name)
        if isinstance(value, str) and len(value) > MAX_EXTRA_CHARS:
            raise ValueError(f"{where}: its {name} {printable_path(value, 60)} has {len(value)} characters, more "
                             f"than {MAX_EXTRA_CHARS}; shorten it (a column's values are kept whole, never cut)")
    return values


def _sha256(where: str, value: Any) -> str | None:
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise ValueError(f"{where}: its sha256 {printable_path(str(value), 80)} is not one (64 hex digits); fix it, "
                         "or rename the column to keep it as a column of its own")
    return value.lower()


def _size(where: str, value: Any) -> int | None:
    if value is None:
        return None
    if int(value) < 0:
        raise ValueError(f"{where}: its size is {value}, a file size is never negative; fix it, or rename the "
                         "column to keep it as a column of its own")
    return int(value)


def _metadata_parts(root: Path, count: int) -> list[Path] | None:
    """``DIR/metadata/*.parquet`` in file-name order (None: no metadata), one per ``.npy`` part."""
    folder = root / METADATA_FOLDER
    if not folder.exists():
        return None
    if not folder.is_dir():
        raise ParameterError("embeddings", f"{printable_path(root)}: {METADATA_FOLDER} is not a folder; it holds "
                                           "the metadata parts (.parquet), or leave it out")
    parts = sorted((p for p in folder.iterdir() if p.suffix == ".parquet" and p.is_file()), key=lambda p: p.name)
    if len(parts) != count:
        raise ValueError(f"{printable_path(folder)} holds {len(parts)} .parquet parts for {count} .npy parts; each "
                         ".npy part needs its metadata part (the same rows in the same order, paired in file-name "
                         "order), or remove the metadata folder to build without metadata")
    return parts


def open_embeddings(directory: str | Path, chunk_rows: int | None = None,
                    allow_outside_paths: bool = False) -> EmbeddingsInput:
    """The input folder ``directory``, its headers, metadata row counts and column sizes checked (no vector or
    metadata value read yet). ``chunk_rows``: rows read at a time (default: ``CHUNK_BYTES`` of float32 vectors);
    ``allow_outside_paths``: catalogue metadata paths that resolve outside the gallery root too."""
    root = Path(directory).expanduser()
    shown = printable_path(root)
    if not root.exists():
        raise ParameterError("embeddings", f"{shown} does not exist")
    if not root.is_dir():
        raise ParameterError("embeddings", f"must be a folder holding embeddings/*.npy (or img_emb/*.npy) and "
                                           f"optionally metadata/*.parquet, got the file {shown}")
    folders = [root / name for name in EMBEDDING_FOLDERS if (root / name).is_dir()]
    if len(folders) > 1:
        raise ParameterError("embeddings", f"{shown} holds both {' and '.join(EMBEDDING_FOLDERS)}; keep the one "
                                           "that holds the parts")
    if not folders:
        here = any(p.suffix == ".npy" for p in root.iterdir())
        hint = (f"it holds .npy files itself: move them into {shown}/embeddings/ (with their metadata parts in "
                f"{shown}/metadata/), or give the folder that holds both" if here else
                "give the folder that `retrieval index export` wrote, or clip-retrieval's output folder")
        raise ParameterError("embeddings", f"{shown} holds no {' or '.join(EMBEDDING_FOLDERS)} folder of .npy "
                                           f"parts; {hint}")
    folder = folders[0]
    files = sorted((p for p in folder.iterdir() if p.suffix == ".npy" and p.is_file()), key=lambda p: p.name)
    if not files:
        raise ParameterError("embeddings", f"{printable_path(folder)} holds no .npy files; it needs the embeddings "
                                           "as float arrays [rows, d] saved with numpy.save")
    metadata = _metadata_parts(root, len(files))
    parts, offset, dim = [], 0, None
    digest = hashlib.sha256()
    for position, path in enumerate(files):
        (rows, d), dtype, _ = read_header(path)
        if dim is not None and d != dim:
            raise ValueError(f"{printable_path(path)} holds {d}-d vectors but {printable_path(files[0])} holds "
                             f"{dim}-d ones; every part must hold embeddings of one size (of one model)")
        dim = d
        meta, columns = (metadata[position], None) if metadata is not None else (None, None)
        if meta is not None:
            a, b = _number(path.name), _number(meta.name)
            if a is not None and b is not None and a != b:
                raise ValueError(f"{printable_path(meta)} is paired with {printable_path(path)} by file-name order, "
                                 f"but their numbers differ ({b} and {a}): a part is missing from one of the "
                                 "folders; give every .npy part its metadata part")
            handle = _parquet(meta)
            if handle.metadata.num_rows != rows:
                raise ValueError(f"{printable_path(meta)} holds {handle.metadata.num_rows} rows but "
                                 f"{printable_path(path)} holds {rows} vectors; a metadata part holds the same rows "
                                 "as its .npy part, in the same order")
            columns = _columns(handle.schema_arrow, printable_path(meta))
            check_column_sizes(handle, columns, columns.names(), printable_path(meta))
            if parts and parts[0].columns is not None and columns.identity() != parts[0].columns.identity():
                raise ValueError(f"{printable_path(meta)} has other path, label or id columns than "
                                 f"{printable_path(parts[0].metadata)} ({columns.names()[:5]} against "
                                 f"{parts[0].columns.names()[:5]}); give every metadata part the same columns")
        parts.append(Part(path, f"{folder.name}/{path.name}", rows, offset, dtype, meta, columns))
        offset += rows
        for file in (path, meta):
            if file is not None:
                stat = file.stat()
                digest.update(f"{file.parent.name}/{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if offset == 0:
        raise ValueError(f"{printable_path(folder)} holds no embeddings: every .npy part has 0 rows")
    assert dim is not None
    chunk = int(chunk_rows) if chunk_rows is not None else max(1, CHUNK_BYTES // (4 * dim))
    if chunk < 1:
        raise ParameterError("chunk_rows", f"must be >= 1, got {chunk_rows}")
    gallery_root = _gallery_root(root)
    if not allow_outside_paths and not _within(os.path.realpath(gallery_root), os.path.realpath(root)):
        # an _export.json is as hostile as the rest of the input: a root it names ("/") must not widen what may be
        # catalogued, and so served
        raise ValueError(f"{printable_path(root / '_export.json')} takes the input's paths from "
                         f"{printable_path(gallery_root)}, outside {printable_path(os.path.realpath(root))}; a "
                         "server sends every catalogued file to whoever searches: give `allow_outside_paths` if "
                         "this export is yours (or one you trust) and every file under that folder may be sent")
    return EmbeddingsInput(root, folder, parts, dim, offset, gallery_root, chunk, digest.hexdigest(),
                           allow_outside_paths)


def _within(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` is ``folder`` or lies under it."""
    return path == folder or path.startswith(folder if folder.endswith(os.sep) else folder + os.sep)
