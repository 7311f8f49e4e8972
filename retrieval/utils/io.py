"""Files written whole or not at all (the one write-to-a-temporary-file-then-rename helper), and files read
only if they are regular files (and, below a folder, only through links that stay inside it)."""

from __future__ import annotations

import errno
import os
import posixpath
import secrets
import stat
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

TEMPORARY_GLOB = ".*.tmp-*"  # the temporary files atomic_write leaves behind when the process is killed mid-write
MAX_LINKS = 40  # linked folders followed in one path at most (Linux's own limit): a loop of links ends


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


class OutsideFolderError(OSError):
    """A path that leaves its folder on the way: through a linked folder pointing elsewhere, or with ``..``."""


_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


def open_regular_within(root: str | os.PathLike, path: str | os.PathLike) -> tuple[BinaryIO, os.stat_result]:
    """Open ``path``, a file below the folder ``root``, for reading and return it with its status, walking its folders
    one at a time from ``root`` (resolved once) so that no link leads out: a linked folder is entered only where its
    target lies inside ``root``, the file itself is never opened through a link (``O_NOFOLLOW``: ELOOP) and must be a
    regular file (``NotRegularFileError``). Each step is opened relative to the folder descriptor before it, so
    nothing swapped in between two checks is followed. ``OutsideFolderError``: ``path`` is not below ``root``, or one
    of its folders links out of it."""
    real_root = os.path.realpath(root)
    normal = PurePosixPath(posixpath.normpath(os.fspath(path)))
    if not normal.is_relative_to(PurePosixPath(os.fspath(root))) and not normal.is_relative_to(real_root):
        raise OutsideFolderError(errno.EXDEV, "not inside the folder", os.fspath(path))
    start = PurePosixPath(os.fspath(root)) if normal.is_relative_to(PurePosixPath(os.fspath(root))) else real_root
    parts = list(normal.relative_to(start).parts)
    if not parts:
        raise NotRegularFileError(errno.EISDIR, "a folder, not a file", os.fspath(path))
    walked: list[str] = []  # real folders below real_root, each opened without following a link
    links = 0
    folder = os.open(real_root, _DIRECTORY)
    try:
        while len(parts) > 1:
            part = parts.pop(0)
            try:
                inner = os.open(part, _DIRECTORY | getattr(os, "O_NOFOLLOW", 0), dir_fd=folder)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) \
                        or not stat.S_ISLNK(os.stat(part, dir_fd=folder, follow_symlinks=False).st_mode):
                    raise
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "too many linked folders", os.fspath(path)) from exc
                target = posixpath.normpath(posixpath.join(real_root, *walked, os.readlink(part, dir_fd=folder)))
                if not PurePosixPath(target).is_relative_to(real_root):
                    raise OutsideFolderError(errno.EXDEV, "a linked folder leads out of the folder",
                                             os.fspath(path)) from exc
                # walk again from the root along the link's target: each of its folders is checked the same way
                os.close(folder)
                folder, walked = os.open(real_root, _DIRECTORY), []
                parts = list(PurePosixPath(target).relative_to(real_root).parts) + parts
                continue
            os.close(folder)
            folder = inner
            walked.append(part)
        # O_NONBLOCK: a FIFO in the file's place must not block the open
        fd = os.open(parts[0], os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0), dir_fd=folder)
    finally:
        os.close(folder)
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        os.close(fd)
        raise NotRegularFileError(errno.EINVAL, "not a regular file", os.fspath(path))
    return os.fdopen(fd, "rb"), status


def read_capped(path: str | os.PathLike, limit: int, what: str = "file") -> bytes:
    """A regular file's bytes; ValueError naming ``what`` when it holds more than ``limit`` bytes."""
    with open_regular(path) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{os.fsdecode(path)} is larger than {limit // 2**20} MiB: not a {what}")
    return data
