"""An index on disk: reading and writing ``index.faiss`` atomically, refusing a damaged or forged file before
faiss reads it, and the IVF lists a merged index keeps in an ``index-<time>.ivfdata`` file beside it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faiss

from retrieval.index.faiss_backend.faiss_params import ivf_of
from retrieval.index.layout import repair_command
from retrieval.utils.io import NotRegularFileError, atomic_write, open_regular

# An IVF index merged on disk (the Ray engine's ``merge_ondisk``) keeps its lists in a file beside index.faiss.
ON_DISK_LISTS = "index-*.ivfdata"


def new_lists_file(folder: str | Path) -> Path:
    """A fresh ``index-<time>.ivfdata`` path in ``folder`` (matched by ``ON_DISK_LISTS``), absolute."""
    return Path(folder).resolve() / f"index-{time.time_ns()}.ivfdata"


class DamagedIndexFileError(RuntimeError):
    """An index.faiss whose content does not fit its size or kind: refused before faiss reads it."""


# faiss' index header: fourcc, d (int32), ntotal (int64), two unused int64, is_trained (byte), metric (int32); a
# metric above 1 adds a float argument. Then per kind: IndexFlat's vectors (a count of floats, then the floats);
# IndexIDMap/IDMap2's inner index, then its ids (a count, then int64s).
_HEADER = struct.Struct("<4siqqq?i")
_COUNT = struct.Struct("<Q")
_FLAT = (b"IxFI", b"IxF2", b"IxFl")  # inner product, L2, other metric
_ID_MAPS = (b"IxM2", b"IxMp")
_IVF = (b"Iw", b"IxPT")  # IVF indexes (IndexIVF*), and a pre-transform, which only ever wraps one in our files


def _header(head: bytes, offset: int, path: Path) -> tuple[bytes, int, int, int]:
    """(fourcc, d, ntotal, the offset after the header) of the index header at ``offset``."""
    if len(head) < offset + _HEADER.size:
        raise DamagedIndexFileError(f"{path} ends inside its header")
    fourcc, d, ntotal, _, _, _, metric = _HEADER.unpack_from(head, offset)
    return fourcc, d, ntotal, offset + _HEADER.size + (4 if metric > 1 else 0)


def check_index_file(path: str | Path) -> None:
    """Refuse (``DamagedIndexFileError``) an index.faiss whose header declares more than its size can hold, before
    faiss reads it: faiss allocates what the file declares first, so a forged count costs that much memory.

    Exact for IndexFlat (alone or in an IDMap/IDMap2); for another index in an IDMap2, and for an IVF index that
    keeps the ids in its lists (alone or behind a rotation), a bound: the ids alone take 8 bytes per vector in this
    file (lists kept on disk are in another file, and then an IVF's ids are there too).
    """
    path = Path(path)
    try:
        handle = open_regular(path)
    except NotRegularFileError as exc:
        raise DamagedIndexFileError(f"{path} is not a regular file") from exc
    except OSError:
        return  # missing or unreadable: faiss says so as it always did (a writer's repair rebuilds on its error)
    with handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(2 * (_HEADER.size + 4) + _COUNT.size)
        fourcc, d, ntotal, at = _header(head, 0, path)
        if d <= 0 or ntotal < 0:
            raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d}")
        ids_at = None
        if fourcc.startswith(_IVF) and ntotal * 8 > size and not any(path.parent.glob(ON_DISK_LISTS)):
            raise DamagedIndexFileError(f"{path} declares {ntotal} vectors, whose ids alone take {ntotal * 8} "
                                        f"bytes, but the file holds {size} bytes")
        if fourcc in _ID_MAPS:
            if ntotal * 8 > size:
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors, whose ids alone take "
                                            f"{ntotal * 8} bytes, but the file holds {size} bytes")
            inner_fourcc, inner_d, inner_ntotal, inner_at = _header(head, at, path)
            if (inner_d, inner_ntotal) != (d, ntotal):
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d}, its inner index "
                                            f"{inner_ntotal} of dimension {inner_d}")
            if inner_fourcc not in _FLAT:
                return
            fourcc, at = inner_fourcc, inner_at
            ids_at = at + _COUNT.size + ntotal * d * 4
        if fourcc not in _FLAT:
            return
        expected = at + _COUNT.size + ntotal * d * 4 + (_COUNT.size + ntotal * 8 if ids_at is not None else 0)
        if size != expected:
            raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d} ({expected} bytes) "
                                        f"but the file holds {size} bytes")
        counts = [(at, ntotal * d)] + ([(ids_at, ntotal)] if ids_at is not None else [])
        for offset, wanted in counts:
            handle.seek(offset)
            (declared,) = _COUNT.unpack(handle.read(_COUNT.size))
            if declared != wanted:
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors but one of its arrays {declared} "
                                            f"entries instead of {wanted}")


def read_index(path: str | Path) -> faiss.Index:
    """Read an ``index.faiss``; lists kept on disk are mapped read-only from the file beside it.

    faiss records the lists file by absolute path; ``IO_FLAG_ONDISK_SAME_DIR`` looks for it in the folder of
    ``path`` instead, so that an index folder still opens after it was moved or copied to another machine. A file
    that cannot be the index its header declares is refused first (``check_index_file``), with the fix named.
    """
    path = Path(path).resolve()
    try:
        check_index_file(path)
    except DamagedIndexFileError as exc:
        fix = f"`{repair_command(path.parent, rebuild=True)}` to rebuild it from the shards"
        raise DamagedIndexFileError(f"{exc}: it is damaged or was not written by this program; run {fix}") from None
    if not any(path.parent.glob(ON_DISK_LISTS)):
        return faiss.read_index(str(path))
    with faiss_prints_to_stderr():
        return faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)


def on_disk_lists(index: faiss.Index) -> Any | None:
    """The ``OnDiskInvertedLists`` of an IVF index whose lists live in a file, else None."""
    ivf = ivf_of(index)
    lists = faiss.downcast_InvertedLists(ivf.invlists) if ivf is not None else None
    return lists if isinstance(lists, faiss.OnDiskInvertedLists) else None


def detach_on_disk_lists(index: faiss.Index, folder: Path, keep_entries: bool = True) -> bool:
    """Copy-on-write: give an index with on-disk lists a new lists file in ``folder`` before it is changed.

    The new file holds the old lists' entries (or none, with ``keep_entries`` False: the caller empties the
    index anyway), so changes never touch the file that the current index.faiss names and that searching
    processes map: a crash mid-update leaves the old index whole, and the old file is only deleted once the new
    index.faiss is in place (``write_index_atomic``). False, and nothing done, for lists held in memory.
    """
    old = on_disk_lists(index)
    if old is None:
        return False
    ivf = ivf_of(index)
    with faiss_prints_to_stderr():
        new = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(new_lists_file(folder)))
        if keep_entries:  # list by list: merge_from_multiple leaves the filled space in the free-slot list, so the
            # next list that grows is given space over other lists' entries (faiss 1.15)
            for number in range(ivf.nlist):
                size = old.list_size(number)
                if size:
                    ids, codes = old.get_ids(number), old.get_codes(number)
                    new.add_entries(number, size, ids, codes)
                    old.release_ids(number, ids)
                    old.release_codes(number, codes)
    ivf.replace_invlists(new, True)
    new.this.disown()  # the index owns (and frees) it now
    return True


def write_index_atomic(index: faiss.Index, path: Path) -> None:
    """Write index.faiss atomically; lists kept on disk are synced to their file first, and lists files that
    the new index.faiss does not name (replaced by ``detach_on_disk_lists``, or left by a killed build) are
    deleted after it is in place (a process that still maps one keeps reading it until it reopens)."""
    path = Path(path)
    lists = on_disk_lists(index)
    keep = Path(lists.filename).name if lists is not None else None
    if lists is not None:
        with open(lists.filename, "rb+") as handle:  # the mapped pages reach the disk before index.faiss names them
            os.fsync(handle.fileno())
    with faiss_prints_to_stderr():
        atomic_write(path, lambda tmp: faiss.write_index(index, str(tmp)))
    for stale in path.parent.glob(ON_DISK_LISTS):
        if stale.name != keep:
            with contextlib.suppress(OSError):
                stale.unlink()


@contextlib.contextmanager
def faiss_prints_to_stderr() -> Iterator[None]:
    """faiss reports on-disk list work with printf on C's stdout; send it to stderr while this block runs, so
    that stdout stays machine-readable (the CLI prints JSON there)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library to flush (not POSIX): leave stdout alone
        yield
        return
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
