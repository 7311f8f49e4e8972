"""``bounded_map``: a function mapped over items on a pool of threads with at most a bounded number of calls in
flight, the calling thread awake every ``wake`` seconds however long a call takes, so that Ctrl-C is answered within
the calls running rather than after the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

WAKE_SECONDS = 0.25  # the most the calling thread waits on the calls in flight before it looks for Ctrl-C again


def bounded_map(function: Callable[[T], R], items: Iterable[T], on_result: Callable[[T, R], None], workers: int,
                in_flight: int, wake: float = WAKE_SECONDS) -> None:
    """``on_result(item, function(item))`` for each of ``items``, on the calling thread as the calls finish (in any
    order), the calls made on ``workers`` threads with at most ``in_flight`` submitted at a time (items are drawn
    from ``items`` only as room frees up). On Ctrl-C (or an error a call raised) the calls not started are
    cancelled, the running ones waited for, the ones that finished handed to ``on_result``, and the exception
    raised again."""
    if workers < 1 or in_flight < 1:
        raise ValueError(f"bounded_map needs at least one worker and one call in flight, got {workers} and "
                         f"{in_flight}")
    pool = ThreadPoolExecutor(workers)
    pending: dict[Future[R], T] = {}

    def collect() -> None:
        finished, _ = wait(pending, timeout=wake, return_when=FIRST_COMPLETED)
        for future in finished:
            item = pending.pop(future)
            on_result(item, future.result())

    try:
        for item in items:
            pending[pool.submit(function, item)] = item
            while len(pending) >= in_flight:
                collect()
        while pending:
            collect()
    except BaseException:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        # what finished before the exception or while the pool wound down is kept
        for future, item in pending.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                on_result(item, future.result())
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
