"""A micro-batcher: embedding requests that arrive within a few milliseconds run as one model call.

Callers reserve a slot before they preprocess their image and submit the preprocessed batch after.
The worker thread takes the first waiting request and keeps collecting while more requests are
reserved (being preprocessed right now) and the wait budget lasts, so a lone request is never held
back waiting for company that is not coming.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass
class _Request:
    batch: np.ndarray
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)


@dataclass
class BatchResult:
    embeddings: np.ndarray
    batch_size: int  # rows embedded together in the model call that served this request
    wait_ms: float  # from submission to the start of that model call
    run_ms: float  # the model call itself


class MicroBatcher:
    """Runs ``fn(batch [n, ...]) -> [n, d]`` on one worker thread over concatenated requests."""

    def __init__(
        self,
        fn: Callable[[np.ndarray], np.ndarray],
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        name: str = "embed-batcher",
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.fn, self.max_batch, self.max_wait = fn, max_batch, max_wait_ms / 1000
        self._queue: deque[_Request] = deque()
        self._reserved = 0
        self._closed = False
        self._cond = threading.Condition()
        self.calls = self.requests = self.largest_batch = 0
        # model calls per batch size (rows), the last slot for batches over max_batch; rows embedded in all:
        # /metrics reads them as a histogram (fixed size, so a reader never sees it resized)
        self.batch_sizes = [0] * (max_batch + 2)
        self.rows = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- callers
    @contextmanager
    def reservation(self) -> Iterator[Callable[[np.ndarray], Future]]:
        """``with batcher.reservation() as submit: batch = prepare(); future = submit(batch)``."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._reserved += 1
        state = {"open": True}

        def submit(batch: np.ndarray) -> Future:
            request = _Request(np.asarray(batch))
            with self._cond:
                if self._closed:
                    raise RuntimeError("the batcher is closed")
                self._queue.append(request)
                self._reserved -= 1
                state["open"] = False
                self._cond.notify_all()
            return request.future

        try:
            yield submit
        finally:
            if state["open"]:  # the caller failed before submitting: release its slot
                with self._cond:
                    self._reserved -= 1
                    self._cond.notify_all()

    def run(self, batch: np.ndarray, timeout: float | None = 60.0) -> BatchResult:
        """Submit an already prepared batch and wait for its result."""
        with self.reservation() as submit:
            future = submit(batch)
        return future.result(timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)

    # --- worker
    def _collect(self) -> list[_Request] | None:
        with self._cond:
            while not self._queue and not self._closed:
                self._cond.wait()
            if not self._queue:
                return None  # closed and drained
            taken = [self._queue.popleft()]
            rows = len(taken[0].batch)
            deadline = time.perf_counter() + self.max_wait
            while rows < self.max_batch:
                if self._queue:
                    if rows + len(self._queue[0].batch) > self.max_batch:
                        break
                    taken.append(self._queue.popleft())
                    rows += len(taken[-1].batch)
                    continue
                remaining = deadline - time.perf_counter()
                if self._reserved == 0 or remaining <= 0 or self._closed:
                    break  # nobody else is on the way, or the wait budget is spent
                self._cond.wait(remaining)
            return taken

    def _run(self) -> None:
        while (taken := self._collect()) is not None:
            started = time.perf_counter()
            try:
                out = np.asarray(self.fn(np.concatenate([r.batch for r in taken])))
            except BaseException as exc:  # noqa: BLE001  (every waiting caller gets the error)
                for request in taken:
                    request.future.set_exception(exc)
                continue
            run_ms = (time.perf_counter() - started) * 1000
            rows = sum(len(r.batch) for r in taken)
            self.calls += 1
            self.requests += len(taken)
            self.largest_batch = max(self.largest_batch, rows)
            self.batch_sizes[min(rows, self.max_batch + 1)] += 1
            self.rows += rows
            offset = 0
            for request in taken:
                n = len(request.batch)
                request.future.set_result(
                    BatchResult(out[offset : offset + n], rows, (started - request.submitted) * 1000, run_ms)
                )
                offset += n

    @property
    def queued(self) -> int:
        """Requests submitted and waiting for a model call (a racy read: for monitoring)."""
        return len(self._queue)

    def stats(self) -> dict[str, float]:
        return {
            "model_calls": self.calls,
            "requests": self.requests,
            "largest_batch": self.largest_batch,
            "mean_requests_per_call": round(self.requests / self.calls, 3) if self.calls else 0.0,
            "max_batch": self.max_batch,
            "max_wait_ms": self.max_wait * 1000,
        }
