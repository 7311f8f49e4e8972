"""A long-running reader's view of an index folder that writers change: consistent snapshots, swapped in live.

``Snapshot`` is an ``Index`` opened at one moment with a seqlock (no writer holds the lock and the watched files
are unchanged before and after the open, and faiss holds exactly the catalogue's indexed ids). It remembers the
ids it holds and answers from them alone, not from the live catalogue status: until it is replaced, it answers
as the index was when it was opened (a writer's remove does not leave it with fewer than k results; the rows a
writer adds, or a writer killed mid-run left, are not among its filters, items or statistics). What it cannot
answer from itself raises ``InconsistentIndexError``, never a lookup error of faiss.

``LiveIndex`` holds the current state built on a snapshot (any object with ``identity``, ``close()`` and
``len()``) and a watcher thread that polls the folder's files (``folder_identity``) every ``interval_s`` seconds:
once a writer has finished, it opens a new state and swaps it in with one reference assignment. A request takes
the state once (``acquire``) and uses only it; a replaced state is closed once no request holds it (and a short
grace has passed, for callers that peek at ``current`` without holding it). A failed open keeps the old state,
logs one line and is retried only when the folder's files change again (at the next tick if a writer raced the
open): opening damaged files again costs as much as the first time and cannot succeed.

Read side only: nothing here writes the folder or imports the writer (nor torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from retrieval.index.catalogue_schema import Status
from retrieval.index.faiss_backend import faiss_params
from retrieval.index.layout import IndexLayout, describe_writer
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.search import Index
from retrieval.index.stats import opened_index_stats

log = logging.getLogger(__name__)

RELOAD_INTERVAL_S = 1.0  # how often a server looks for a writer's changes
RETIRE_GRACE_S = 10.0  # a replaced state stays open this long after its last user, for callers that only peeked

# (device, inode, mtime_ns, size) per watched file, None where it is missing. Writers replace index.faiss and
# then index.json atomically at the end of every run (build, add, remove, repair); a new catalogue file is a new
# index altogether. Only the catalogue's inode counts: its mtime moves with every WAL checkpoint.
Identity = tuple[tuple[int, ...] | None, ...]


def folder_identity(layout: IndexLayout) -> Identity:
    """The stat identity of the files a writer replaces: it changes when any writer finishes."""

    def identity(path: Path, full: bool) -> tuple[int, ...] | None:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size) if full else (info.st_dev, info.st_ino)

    return identity(layout.info, True), identity(layout.faiss, True), identity(layout.catalogue, False)


class IndexChanging(RuntimeError):
    """A writer holds the folder, or changed it while it was being opened: try again later."""


class Snapshot(Index):
    """An ``Index`` opened consistently, answering for the ids it held when opened (``ids``, sorted int64)."""

    ids: np.ndarray
    identity: Identity

    @classmethod
    def open(
        cls, directory: str | Path, embedder: ImageEmbedder | None = None, gpu: bool = False, writer_free: bool = True,
        gallery_root: str | Path | None = None,
    ) -> Snapshot:
        """Open under a seqlock: IndexChanging if the files changed meanwhile, or (``writer_free``) if a writer
        holds the folder, even one whose index is still consistent (a server's first open takes that one).
        ``gallery_root``: where the gallery is now, if it moved elsewhere (``Index.open``)."""
        layout = IndexLayout(directory)
        before = folder_identity(layout)
        if writer_free:
            _require_no_writer(layout)
        try:
            snapshot = super().open(directory, embedder, gpu, gallery_root)
        except Exception as exc:  # a writer that started meanwhile explains an inconsistent or missing file
            if writer_free:
                _require_unchanged(layout, before, writer_free, exc)
            raise
        try:
            snapshot.ids = np.sort(faiss_params.index_ids(snapshot.faiss_index))
            done = np.asarray(snapshot.catalogue.ids_with_status(Status.DONE), dtype=np.int64)
            _require_unchanged(layout, before, writer_free)
            if not np.array_equal(snapshot.ids, done):  # the same count (Index.open) but other ids
                raise layout.inconsistent("the ids in its faiss part differ from the catalogue's indexed images")
        except BaseException:
            snapshot.close()
            raise
        snapshot.identity = before
        return snapshot

    def indexed_rows(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """Catalogue rows of the ids held when opened, whatever a writer marked them since."""
        held = [int(i) for i, kept in zip(ids, self.holds(ids), strict=True) if kept]
        return self.catalogue.rows(held)

    def indexed_by_sha256(self, sha256: str) -> dict[str, Any] | None:
        """The held row (lowest id) whose file has this sha256."""
        sql = "SELECT id FROM images WHERE sha256 = ? ORDER BY id"
        ids = [row[0] for row in self.catalogue.db.execute(sql, (sha256,))]
        held = [i for i, kept in zip(ids, self.holds(ids), strict=True) if kept]
        return self.catalogue.rows(held[:1]).get(held[0]) if held else None

    def filter_rows(self) -> tuple[list[int], list[str], list[str | None], dict[int, str]]:
        """The rows of the ids held when opened, whatever a writer marked them since (its relabels show)."""
        return self.catalogue.filter_rows(within=self.ids, status=None)

    def stats(self, queries: int = 500, seed: int = 1) -> dict[str, Any]:
        """``index stats`` of this snapshot: its own faiss index and the ids it holds, the folder not opened again
        (InconsistentIndexError when the catalogue no longer records the vectors of some of them)."""
        return opened_index_stats(self, self.ids, queries=queries, seed=seed)


def _require_no_writer(layout: IndexLayout) -> None:
    writer = layout.writer()
    if writer is not None:
        raise IndexChanging(f"the index in {layout.root} is being written by {describe_writer(writer)}")


def _require_unchanged(
    layout: IndexLayout, before: Identity, writer_free: bool, cause: BaseException | None = None
) -> None:
    """IndexChanging (from ``cause``) if the folder's files changed since ``before``, or a writer holds it now."""
    if writer_free:
        _require_no_writer(layout)
    if folder_identity(layout) != before:
        raise IndexChanging(f"the index in {layout.root} changed while it was being opened") from cause


class State(Protocol):
    """What ``LiveIndex`` holds: anything opened on a ``Snapshot``."""

    identity: Identity

    def __len__(self) -> int: ...

    def close(self) -> None: ...


S = TypeVar("S", bound=State)


def _first_open(open_state: Callable[[S | None], S], attempts: int = 5) -> S:
    """The first state; tried again if a writer finished during the open."""
    for _ in range(attempts - 1):
        try:
            return open_state(None)
        except IndexChanging:
            time.sleep(0.2)
    return open_state(None)


@dataclass(eq=False)
class _Held(Generic[S]):
    state: S
    users: int = 0  # requests holding it now
    retired_at: float | None = None  # when it was replaced (monotonic)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def rested_since(self) -> float:
        """Since when nobody used it: its last release or its retirement, whichever came later."""
        return max(self.last_used, self.retired_at or 0.0)


class LiveIndex(Generic[S]):
    """The current state of an index folder, replaced by a fresh one (``open_state(previous)``) after each writer."""

    def __init__(
        self,
        directory: str | Path,
        open_state: Callable[[S | None], S],
        interval_s: float | None = RELOAD_INTERVAL_S,
        grace_s: float = RETIRE_GRACE_S,
        identity: Callable[[], Any] | None = None,
    ) -> None:
        self.layout = IndexLayout(directory)
        # what is watched: the folder's files, or (an index elsewhere, a Milvus collection) the caller's identity
        self._identity = identity or (lambda: folder_identity(self.layout))
        self._open, self.grace_s = open_state, grace_s
        self._lock = threading.Lock()  # guards the current state and the users counts
        self._reload_lock = threading.Lock()  # one open at a time (the watcher, a manual reload)
        self._held: _Held[S] = _Held(_first_open(open_state))
        self._retired: list[_Held[S]] = []
        self._failed: tuple[Identity, str, float] | None = None  # the last failed open: identity, message, when
        self._stop = threading.Event()
        self._closed = False
        self._watcher: threading.Thread | None = None
        if interval_s:
            self._watcher = threading.Thread(target=self._watch, args=(interval_s,), name="index-watcher", daemon=True)
            self._watcher.start()

    @property
    def current(self) -> S:
        """The current state, not held: for quick facts (a count); a request uses ``acquire``."""
        return self._held.state

    @contextlib.contextmanager
    def acquire(self) -> Iterator[S]:
        """The current state, kept open for the block even if a newer one is swapped in meanwhile."""
        with self._lock:
            held = self._held
            held.users += 1
        try:
            yield held.state
        finally:
            with self._lock:
                held.users -= 1
                held.last_used = time.monotonic()
            if self._closed:
                self._sweep(force=True)

    def reload(self) -> bool:
        """Swap in the folder's new state if a writer changed it and finished; whether it swapped."""
        with self._reload_lock:
            self._sweep()
            if self._closed:
                return False
            previous = self._held.state
            identity = self._identity()  # None: it cannot be told now (an index elsewhere, unreachable)
            if identity is None or identity == previous.identity or self._failed_lately(identity):
                return False
            try:
                state = self._open(previous)
            except IndexChanging:
                return False  # a writer is at work: its last step changes the folder again, retried next tick
            except Exception as exc:  # noqa: BLE001  (whatever the folder holds, the old state keeps serving)
                self._log_failure(identity, exc, previous)
                return False
            self._failed = None
            self._swap(state)
            log.info("index %s reloaded: %d vectors (was %d)", self.layout.root, len(state), len(previous))
            return True

    def _failed_lately(self, identity: Identity) -> bool:
        """Whether these very files failed to open (they are tried again once they change: opening is not free,
        a damaged file can make faiss allocate what it declares, and unchanged files fail the same way)."""
        failed = self._failed
        return failed is not None and failed[0] == identity

    def _log_failure(self, identity: Identity, exc: Exception, previous: S) -> None:
        """One line per distinct problem, not one per attempt."""
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if self._failed is None or self._failed[1] != message:
            try:  # a state elsewhere (a Milvus collection) may not answer either
                served = f"{len(previous)} vectors"
            except Exception:  # noqa: BLE001
                served = "its size unknown now"
            log.warning("cannot reload the index in %s, still serving the previous one (%s): %s",
                        self.layout.root, served, message)
        self._failed = (identity, message, time.monotonic())

    def _swap(self, state: S) -> None:
        with self._lock:
            old, self._held = self._held, _Held(state)  # requests from now on take the new state
            old.retired_at = time.monotonic()
            self._retired.append(old)
        self._sweep()

    def _sweep(self, force: bool = False) -> None:
        """Close the replaced states that no request holds (and, unless ``force``, that rested a grace period)."""
        now = time.monotonic()
        with self._lock:
            idle = [h for h in self._retired if h.users == 0 and (force or now - h.rested_since >= self.grace_s)]
            self._retired = [h for h in self._retired if h not in idle]
        for held in idle:
            try:
                held.state.close()
            except Exception:  # noqa: BLE001
                log.exception("closing a replaced index state failed")

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.reload()
            except Exception:  # noqa: BLE001  (the watcher never dies: the next tick tries again)
                log.exception("watching the index in %s failed", self.layout.root)

    def close(self) -> None:
        """Stop watching; close every state once no request holds it."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=10)
        with self._reload_lock, self._lock:
            self._closed = True
            self._held.retired_at = time.monotonic()
            self._retired.append(self._held)
        self._sweep(force=True)
