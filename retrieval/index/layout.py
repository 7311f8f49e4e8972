"""The files of an index folder, the JSON record of how the index was built, and the writer's lock.

One writer at a time: ``build``, ``add``, ``remove`` and ``repair`` hold an exclusive ``flock`` on
``INDEX_DIR/writer.lock`` for their whole run; a second writer is refused at once with the holder's PID
and command. The kernel drops the lock when its holder dies (even by kill -9), so it never goes stale.
Readers (search, serve) take no lock: every file they read is replaced atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import stat
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from retrieval.index.sources import printable_path
from retrieval.records.index_info import FORMAT, IndexInfo
from retrieval.utils.io import NotRegularFileError, atomic_write, read_capped

LOCK_NAME = "writer.lock"
UPGRADE_LOCK_NAME = "upgrade.lock"  # held for a whole upgrade, which takes the writer lock only to publish
# A refused writer retries this long first: a reader's probe (``IndexLayout.writer``) holds the lock
# for microseconds, and must not make a writer give up.
LOCK_RETRY_SECONDS = 0.3
# index.json holds the build's record (key, model, tuning): kilobytes. Anything far larger is not one, and is not
# read whole (a sparse file of a gigabyte would cost that much memory at every open).
MAX_INFO_BYTES = 4 * 2**20
# index.json's (and the catalogue meta's) key of an index whose vectors are in a Milvus collection, not in the
# folder (``milvus_build``: a Ray build into a collection): {"milvus": URI, "collection": NAME, "physical": ...}
VECTORS_IN = "vectors_in"

# Lock descriptors this process holds. A forked child (a DataLoader worker) closes its copies at once, so
# that the lock dies with its holder and not with the holder's last worker.
_HELD_LOCK_FDS: dict[int, Path] = {}  # descriptor -> resolved lock file


def _close_inherited_locks() -> None:
    for fd in _HELD_LOCK_FDS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCK_FDS.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class IndexLockedError(RuntimeError):
    """Another process is writing this index folder."""


class InconsistentIndexError(RuntimeError):
    """The parts of an index disagree (a writer is at work, or one was interrupted): wait for it, or repair."""


class VectorsInMilvusError(FileNotFoundError):
    """The folder's vectors are in a Milvus collection: a command that needs them here is pointed at it."""

    def __init__(self, root: Path, where: dict[str, str]) -> None:
        uri, name = shlex.quote(str(where.get("milvus"))), where.get("collection")
        super().__init__(
            f"the index in {root} keeps its vectors in the Milvus collection {name} at {where.get('milvus')} (built "
            "by the Ray engine into Milvus), not in the folder, which holds no shards and no faiss index: search it "
            f"with `retrieval serve --milvus {uri} --collection {name}`, and update it with `retrieval index "
            f"add|remove {shlex.quote(str(root))} --milvus {uri} --collection {name}`"
        )
        self.where = where


def repair_command(root: Path, rebuild: bool = False) -> str:
    """The command that finishes or mends the index in ``root`` (every message points to it); ``rebuild``: the one
    that rebuilds its faiss part from the shards."""
    return f"retrieval index repair {shlex.quote(str(root))}" + (" --rebuild" if rebuild else "")


def describe_writer(holder: dict[str, Any]) -> str:
    """'PID 123 on host, running `retrieval index build ...` since ...', from the lock file's record."""
    if holder.get("problem"):
        return f"an unknown process ({holder['problem']})"
    if not holder.get("pid"):
        return "a process that is just starting (its PID is not yet recorded)"
    command = printable_path(str(holder.get("command", "?")), limit=300)
    return f"PID {holder['pid']} on {holder.get('host', '?')}, running `{command}` since {holder.get('started', '?')}"


class IndexLayout:
    """INDEX_DIR/catalogue.sqlite, shards/shard-NNNNNN.npz or .parquet, index.faiss, index.json, writer.lock."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory).expanduser()
        self.catalogue = self.root / "catalogue.sqlite"
        self.shards = self.root / "shards"
        self.faiss = self.root / "index.faiss"
        self.info = self.root / "index.json"
        self.lock_file = self.root / LOCK_NAME
        self.upgrade_lock_file = self.root / UPGRADE_LOCK_NAME

    def require_catalogue(self) -> None:
        if not self.catalogue.is_file():
            raise FileNotFoundError(
                f"{self.root} is not an index folder (no catalogue.sqlite); "
                "build one with `retrieval index build`"
            )

    def require_finished(self, vectors_in_milvus: bool = False) -> None:
        """A finished index with its vectors here (``vectors_in_milvus``: or in the Milvus collection it names,
        which add and remove update); the error says what finishes it, or where its vectors are."""
        self.require_catalogue()
        where = self.vectors_in()
        if where is not None:
            if not vectors_in_milvus:
                raise VectorsInMilvusError(self.root, where)
            return
        if not self.info.is_file() or not self.faiss.is_file():
            writer = self.writer()
            if writer is not None:
                raise FileNotFoundError(
                    f"the index in {self.root} is being built by {describe_writer(writer)}; "
                    "use it when that finishes"
                )
            raise self.unfinished()

    def vectors_in(self) -> dict[str, str] | None:
        """The Milvus collection a finished index keeps its vectors in (``VECTORS_IN``); None: in the folder."""
        if not self.info.is_file() or self.faiss.is_file():
            return None
        try:
            where = self.read_record().vectors.vectors_in
        except ValueError:
            return None
        return where if isinstance(where, dict) else None

    def unfinished(self) -> FileNotFoundError:
        """The error for an index whose build never finished: repair finishes it."""
        return FileNotFoundError(
            f"the index in {self.root} is not finished (an interrupted build?); run "
            f"`{repair_command(self.root)}` to finish it"
        )

    def inconsistent(self, detail: str) -> InconsistentIndexError:
        """The error for an index whose parts disagree: wait for its writer, or repair it."""
        writer = self.writer()
        if writer is not None:
            return InconsistentIndexError(
                f"the index in {self.root} is being written by {describe_writer(writer)} ({detail}); "
                "try again when that finishes"
            )
        return InconsistentIndexError(
            f"the index in {self.root} is inconsistent: {detail} (a build/add/remove was interrupted, or "
            f"two writers ran at once); run `{repair_command(self.root)}` to mend it"
        )

    def read_info(self) -> dict[str, Any]:
        """index.json's record; ValueError if it is not one (too large, not JSON, another format)."""
        try:
            data = read_capped(self.info, MAX_INFO_BYTES, "index record")
        except NotRegularFileError as exc:
            raise ValueError(f"{self.info} is not a regular file; run `{repair_command(self.root)}` to write it "
                             "again") from exc
        except ValueError as exc:
            raise ValueError(f"{self.info} is larger than {MAX_INFO_BYTES // 2**20} MiB, far more than the record "
                             f"of an index: it is damaged; run `{repair_command(self.root)}` to write it again"
                             ) from exc
        info = json.loads(data)
        if not isinstance(info, dict):
            raise ValueError(f"{self.info} holds no JSON object; run `{repair_command(self.root)}` to write it again")
        if info.get("format") != FORMAT:
            raise ValueError(f"{self.info} has format {info.get('format')!r}, expected {FORMAT!r}")
        return info

    def read_record(self) -> IndexInfo:
        """index.json as its typed record (``read_info``'s errors)."""
        return IndexInfo.from_json(self.read_info())

    def write_info(self, info: IndexInfo | Mapping[str, Any]) -> None:
        """Write index.json (a record or its JSON object) atomically, its format first."""
        data = info.to_json() if isinstance(info, IndexInfo) else info
        atomic_write(self.info, (json.dumps({"format": FORMAT, **data}, indent=2) + "\n").encode())

    def size_on_disk(self) -> dict[str, int]:
        def size(path: Path) -> int:
            return path.stat().st_size if path.is_file() else 0

        catalogue = sum(size(p) for p in self.root.glob("catalogue.sqlite*"))
        shards = sum(size(p) for p in self.shards.glob("shard-*")) if self.shards.is_dir() else 0
        ivfdata = sum(size(p) for p in self.root.glob("index-*.ivfdata"))  # an IVF merged on disk (Ray engine)
        out = {
            "catalogue": catalogue, "shards": shards, "faiss": size(self.faiss) + ivfdata, "info": size(self.info)
        }
        out["total"] = sum(out.values())
        return out

    # --- the writer's lock
    def upgrade_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the folder's upgrade lock for the block: one upgrade at a time (it takes the writer lock too, but
        only while it publishes, so that servers see each step)."""
        return self.write_lock("upgrade", self.upgrade_lock_file)

    @contextlib.contextmanager
    def write_lock(self, operation: str, lock_file: Path | None = None) -> Iterator[None]:
        """Hold the folder's exclusive writer lock (or ``lock_file``) for the block; refuse at once if another
        writer has it."""
        lock_file = self.lock_file if lock_file is None else lock_file
        # O_NONBLOCK: something other than a file put in its place must not block the open (checked below)
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise IndexLockedError(f"cannot {operation} {self.root}: {lock_file} is not a regular file; "
                                       "remove it (writers create it again) and run your command again")
            deadline = time.monotonic() + LOCK_RETRY_SECONDS
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise IndexLockedError(
                            f"cannot {operation} {self.root}: it is being written by "
                            f"{describe_writer(_read_holder(fd))}; wait for that to finish (searching "
                            "the index needs no lock), then run your command again"
                        ) from None
                    time.sleep(0.02)
        except BaseException:
            os.close(fd)
            raise
        _HELD_LOCK_FDS[fd] = lock_file.resolve()
        try:
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": shlex.join(sys.argv) if sys.argv and sys.argv[0] else operation,
                "operation": operation,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # no stale holder record once released
            _HELD_LOCK_FDS.pop(fd, None)
            os.close(fd)  # releases the lock

    def writer(self) -> dict[str, Any] | None:
        """The holder's record if another process holds the writer lock now, else None.

        A probe: it holds a shared lock for an instant (a writer starting then retries, see
        ``LOCK_RETRY_SECONDS``). This process's own lock does not count. It never blocks: a lock file that is not
        a regular file (a FIFO put in its place) counts as held, by a holder that the record describes.
        """
        if self.lock_file.resolve() in _HELD_LOCK_FDS.values():
            return None
        try:
            fd = os.open(self.lock_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"problem": f"{self.lock_file} is not a regular file; remove it (writers create it again)"}
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_holder(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def _read_holder(fd: int) -> dict[str, Any]:
    try:
        record = json.loads(os.pread(fd, 8192, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
