"""The checks on a build-from-embeddings input (read by ``embedding_input``, which is hostile): its files from their
headers and metadata before any value is read, and each metadata value against its bound.

Before anything is read (``embedding_input.open_embeddings`` applies them part by part): each ``.npy`` header
(``read_header``: a ``.npy`` file of version 1 or 2 holding a 2-D array of floats, never Python objects: nothing
is unpickled; d at most ``MAX_DIM``; a file as long as its header says), the metadata parts beside the ``.npy``
parts, the columns each has (``metadata_columns``), and each column chunk's uncompressed size against what its
rows' values can take at their bounds (``check_column_sizes``: a compressed bomb is refused from the file's
metadata). The gallery root relative paths are taken from is the one an export recorded in ``_export.json``, else
the input folder. Then, row by row: a label or a kept column's text over its bound (``MAX_LABEL_CHARS``,
``MAX_EXTRA_CHARS``) is refused, never cut; a ``sha256`` must be one, a ``size`` never negative.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.parquet_bounds import Bounds, check_chunk_sizes, number_bound, text_bound
from retrieval.index.sources import (
    MAX_EXTRA_CHARS,
    MAX_LABEL_CHARS,
    MAX_PATH_BYTES,
    extra_columns,
    path_problem,
    printable_path,
)
from retrieval.utils.io import read_capped

log = logging.getLogger(__name__)

EMBEDDING_FOLDERS = ("embeddings", "img_emb")  # ours (``index export --format npy``), clip-retrieval's
METADATA_FOLDER = "metadata"
PATH_COLUMNS = ("path", "image_path", "url")  # the first one a metadata part has names its rows
MAX_DIM = 65_536  # d of one embedding: models give hundreds to a few thousand; a larger d is a file to refuse
MAX_HEADER_BYTES = 10_000  # numpy's own limit on a .npy header: a larger one is not a plain array's
MAX_EXPORT_RECORD_BYTES = 2**20  # _export.json: kilobytes
SHA256 = re.compile(r"[0-9a-fA-F]{64}")
SHA256_CHARS = 64


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


def part_number(name: str) -> int | None:
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


def metadata_columns(schema: Any, shown: str) -> Columns:
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
        return number_bound()
    if name == columns.path:  # a path is at most MAX_PATH_BYTES once joined to its folder
        return MAX_PATH_BYTES, f"{MAX_PATH_BYTES} bytes"
    return text_bound(MAX_LABEL_CHARS if name == "label" and columns.label else
                      SHA256_CHARS if name == "sha256" and columns.sha256 else MAX_EXTRA_CHARS)


def column_bounds(handle: Any, columns: Columns, names: list[str]) -> Bounds:
    """The most bytes one value of each of the columns ``names`` of a metadata part takes, and that bound in words."""
    kinds = {field.name: field.type for field in handle.schema_arrow}
    return {name: _value_bound(columns, name, kinds[name]) for name in names if name in kinds}


def check_column_sizes(handle: Any, columns: Columns, names: list[str], shown: str) -> None:
    """Refuse a metadata part whose column chunks (of the columns ``names`` to read) hold more bytes uncompressed
    than their rows' values can take at their bounds, from the file's metadata alone: no value is read."""
    check_chunk_sizes(handle, column_bounds(handle, columns, names), shown, "the part")


def open_parquet(path: Path, read_dictionary: list[str] | None = None) -> Any:
    """A metadata part opened for reading (its footer read, no value), the text columns ``read_dictionary`` read
    dictionary-encoded; ValueError naming it when it is damaged."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, read_dictionary=read_dictionary)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own errors for a damaged file)
        raise ValueError(f"{printable_path(path)} is not a readable parquet file ({exc}); write the metadata part "
                         "again") from exc


def input_gallery_root(root: Path) -> str:
    """The folder relative paths are taken from: the gallery root an export recorded (its paths are relative to
    it), else the input folder itself."""
    from retrieval.index.formats.table_export import (  # pyarrow: loaded when a build reads parquet
        MANIFEST,
        RELATIVE_PATHS,
    )

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


def checked_label(where: str, value: Any) -> str | None:
    """A row's label (None for none), refused when longer than ``MAX_LABEL_CHARS``."""
    if value is None or value == "":
        return None
    label = str(value)
    if len(label) > MAX_LABEL_CHARS:
        raise ValueError(f"{where}: its label {printable_path(label, 60)} has {len(label)} characters, more than "
                         f"{MAX_LABEL_CHARS}; shorten it (labels are kept whole, never cut)")
    return label


def bounded_extras(where: str, values: dict[str, Any], extras: tuple[str, ...]) -> dict[str, Any]:
    """``values``, each kept column's text within ``MAX_EXTRA_CHARS`` (a longer one is refused, never cut)."""
    for name in extras:
        value = values.get(name)
        if isinstance(value, str) and len(value) > MAX_EXTRA_CHARS:
            raise ValueError(f"{where}: its {name} {printable_path(value, 60)} has {len(value)} characters, more "
                             f"than {MAX_EXTRA_CHARS}; shorten it (a column's values are kept whole, never cut)")
    return values


def checked_sha256(where: str, value: Any) -> str | None:
    """A row's sha256 in lower case (None for none), refused when it is not 64 hex digits."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not SHA256.fullmatch(value):
        raise ValueError(f"{where}: its sha256 {printable_path(str(value), 80)} is not one (64 hex digits); fix it, "
                         "or rename the column to keep it as a column of its own")
    return value.lower()


def checked_size(where: str, value: Any) -> int | None:
    """A row's file size in bytes (None for none), refused when negative."""
    if value is None:
        return None
    if int(value) < 0:
        raise ValueError(f"{where}: its size is {value}, a file size is never negative; fix it, or rename the "
                         "column to keep it as a column of its own")
    return int(value)


def metadata_parts(root: Path, count: int) -> list[Path] | None:
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


def is_within(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` is ``folder`` or lies under it."""
    return path == folder or path.startswith(folder if folder.endswith(os.sep) else folder + os.sep)
