"""Files written whole or not at all (the one write-to-a-temporary-file-then-rename helper), and files read
only if they are regular files."""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMPORARY_GLOB = ".*.tmp-*"  # the temporary files atomic_write leaves behind when the process is killed mid-write


def fsync_dir(folder: Path) -> None:
    """Make a rename durable (no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str | Callable[[Path], object]) -> None:
    """Write ``path`` so that it is always either the old file or the complete new one.

    ``data`` is the content (bytes, or str written as UTF-8) or a writer called with a temporary path in the same
    folder (``lambda tmp: torch.save(obj, tmp)``). The temporary file is fsynced and renamed over ``path``
    (``os.replace`` is atomic), then the folder is fsynced; on any error it is removed and ``path`` is untouched.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        # a plain open (not mkstemp) so the file gets the usual permissions under the umask
        with open(tmp, "xb") as handle:
            if not callable(data):
                handle.write(data.encode() if isinstance(data, str) else data)
        if callable(data):
            data(tmp)
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class NotRegularFileError(OSError):
    """A path that names a device, a FIFO, a socket or a folder where a file was expected."""


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for reading only if it is a regular file, as seen on the opened descriptor (no race)."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFileError(f"{os.fsdecode(path)!r} is not a regular file")
    return os.fdopen(fd, "rb")


def read_capped(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """A regular file's bytes; ValueError naming ``what`` when it holds more than ``limit`` bytes."""
    with open_regular(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{os.fsdecode(path)} is larger than {limit // 2**20} MiB: not a {what}")
    return data
