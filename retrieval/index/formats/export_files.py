"""The files of one ``retrieval index export`` (``table_export``): the parquet or ``.npy`` + metadata parquet
part files written under a temporary name, part by part, made durable, then renamed into place (a killed export
leaves no half file under the final name; the next export there removes the leftovers).

Read side: imports neither the index writer nor torch.
"""

from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from retrieval.utils.io import fsync_dir


def part_ranges(count: int, rows_per_file: int) -> list[tuple[int, int]]:
    """[start, stop) row ranges of the part files; one (maybe empty) part at least."""
    return [(start, min(start + rows_per_file, count)) for start in range(0, count, rows_per_file)] or [(0, 0)]


class ExportSink:
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
        """Start part file(s) number ``part``, which will hold ``rows`` rows."""
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
        """Append rows to the open part: their metadata ``table`` and their vectors [n, d]."""
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
        """Finish the open part; RuntimeError when its ``.npy`` file got other than the rows it declares."""
        self.writer.close()
        self.writer = None
        if self.npy is not None:
            self.npy.close()
            self.npy = None
            if self.npy_written != self.npy_rows:
                raise RuntimeError(f"wrote {self.npy_written} rows into a .npy file that declares {self.npy_rows}")


def fsync_tree(path: Path) -> None:
    """Make every file written durable before the rename publishes it."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    for folder in [p for p in path.rglob("*") if p.is_dir()] + ([path] if path.is_dir() else []):
        fsync_dir(folder)


def publish(tmp: Path, out: Path) -> None:
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
        remove_path(aside)


def remove_path(path: Path) -> None:
    """Delete a file or a folder and what it holds, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_stale(out: Path) -> None:
    """Delete what an export to ``out`` that was killed left behind (its process is gone)."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        pid = stale.name.rpartition(".tmp-")[2].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            remove_path(stale)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
