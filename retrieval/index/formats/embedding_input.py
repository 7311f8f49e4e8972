"""The input of a build from embeddings (``writer.build_from_embeddings``): vectors someone already has, read as
hostile input, chunk by chunk (the checks on its files and values: ``embedding_checks``).

The layout is what ``retrieval index export --format npy`` writes and clip-retrieval's inference writes:
``DIR/embeddings/*.npy`` (clip-retrieval: ``DIR/img_emb/*.npy``), float [n, d] parts read in file-name order, as
autofaiss reads them, and optionally ``DIR/metadata/*.parquet``, one part per ``.npy`` part (paired in file-name
order), holding the same rows in the same order.

``open_embeddings`` checks the files before anything is read. Then the values, chunk by chunk from a memory map
(``CHUNK_BYTES`` of vectors at a time, never the whole set): every value finite and no row all zeros, each error
naming the file and the row. The vectors are stored L2-normalised as the index expects
(``query_embedder.l2_normalize_rows``); float32 rows of unit length already (an export's) are kept bit for bit.

Catalogue rows (``plan``, one transaction: all rows or none): the id from an integer ``id`` column (what the
export writes), else the row's place in the input from 1; the path from a ``path``, ``image_path`` or ``url``
column (a relative path is taken from the gallery root: the one an export recorded in ``_export.json``, else DIR;
a URL is kept as it is), else a name made from the part and row (``embeddings/part-00000.npy#12``, under DIR); the
label from a ``label`` column; ``sha256`` and ``size`` where the columns have those types; every other column of
text or numbers is kept as a manifest's are (``sources.extra_columns``): a search's ``where`` filters on them. A
path that resolves outside the gallery root (absolute, ``..``, through a symlink) is refused unless
``allow_outside_paths``: a server sends every catalogued file to whoever searches.

Write side: ``writer`` imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
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
from retrieval.index.formats.embedding_checks import (
    EMBEDDING_FOLDERS,
    Part,
    bounded_extras,
    check_column_sizes,
    checked_label,
    checked_sha256,
    checked_size,
    column_bounds,
    input_gallery_root,
    is_within,
    metadata_columns,
    metadata_parts,
    open_parquet,
    part_number,
    read_header,
)
from retrieval.index.parquet_bounds import check_unpacked_sizes
from retrieval.index.query_embedder import l2_normalize_rows
from retrieval.index.shards import ShardStore
from retrieval.index.sources import extra_values, is_url, path_problem, printable_path
from retrieval.utils.progress import progress_bar

CHUNK_BYTES = 16 * 2**20  # float32 vectors read at a time; the checks hold a float64 copy and a few masks
PLAN_BATCH_ROWS = 4096  # metadata rows read at a time while planning
UNIT_TOLERANCE = 1e-6  # a float32 row whose norm is this close to 1 is of unit length already
MAX_ID = 2**63 - 1
MAX_CACHED_FOLDERS = 65_536  # resolved folders kept while metadata paths are checked


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
        return PlannedRow(int(image_id), path, checked_label(where, values.get("label")) if columns.label else None,
                          checked_sha256(where, values.get("sha256")) if columns.sha256 else None,
                          checked_size(where, values.get("size")) if columns.size else None,
                          extra_values(bounded_extras(where, values, columns.extras), columns.extras))

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
        inside = is_within(real, self.real_root)
        return None if inside else real

    def _batches(self, part: Part, columns: list[str], size: int) -> Iterator[Any]:
        """The metadata part's ``columns``, ``size`` rows at a time (fewer at a row group's end); its row count
        checked again against the ``.npy`` part's."""
        assert part.metadata is not None and part.columns is not None
        # text kept dictionary-encoded as it is read: a batch's unpacked size is checked before any value is unpacked
        handle = open_parquet(part.metadata, read_dictionary=columns)
        with handle:  # closed when the reading ends, read whole or not
            bounds = column_bounds(handle, part.columns, columns)
            check_column_sizes(handle, part.columns, columns, part.metadata_shown)  # again: this is what is read
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
                check_unpacked_sizes(batch, bounds, part.metadata_shown, count, "the part")
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
    metadata = metadata_parts(root, len(files))
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
            a, b = part_number(path.name), part_number(meta.name)
            if a is not None and b is not None and a != b:
                raise ValueError(f"{printable_path(meta)} is paired with {printable_path(path)} by file-name order, "
                                 f"but their numbers differ ({b} and {a}): a part is missing from one of the "
                                 "folders; give every .npy part its metadata part")
            handle = open_parquet(meta)
            if handle.metadata.num_rows != rows:
                raise ValueError(f"{printable_path(meta)} holds {handle.metadata.num_rows} rows but "
                                 f"{printable_path(path)} holds {rows} vectors; a metadata part holds the same rows "
                                 "as its .npy part, in the same order")
            columns = metadata_columns(handle.schema_arrow, printable_path(meta))
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
    gallery_root = input_gallery_root(root)
    if not allow_outside_paths and not is_within(os.path.realpath(gallery_root), os.path.realpath(root)):
        # an _export.json is as hostile as the rest of the input: a root it names ("/") must not widen what may be
        # catalogued, and so served
        raise ValueError(f"{printable_path(root / '_export.json')} takes the input's paths from "
                         f"{printable_path(gallery_root)}, outside {printable_path(os.path.realpath(root))}; a "
                         "server sends every catalogued file to whoever searches: give `allow_outside_paths` if "
                         "this export is yours (or one you trust) and every file under that folder may be sent")
    return EmbeddingsInput(root, folder, parts, dim, offset, gallery_root, chunk, digest.hexdigest(),
                           allow_outside_paths)
