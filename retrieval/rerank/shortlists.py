"""Re-ranking shortlists within their bounds: one query's (``rerank_candidates``), a batch's in blocks of vectors
(``rerank_lists``, cancellable between queries), and what one query costs in time (``work_units``) and memory
(``peak_bytes``, ``check_memory``).

Plain NumPy (no torch, no faiss): the server imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from retrieval.rerank.config import RerankConfig
from retrieval.rerank.methods import PAIR_BLOCK, RERANKERS


# --- re-ranking shortlists ---------------------------------------------------------------------------------------
class _OneBlasThread:
    """BLAS on one thread while any re-ranking runs (threadpoolctl, where installed; else nothing changes).

    A shortlist's matrices are small (100 x 512): BLAS threads only add hand-over cost, which on a busy machine grew a
    100 x 100 Gram matrix from 0.2 ms to 30 ms (docs/BENCHMARKS.md, "Re-ranking"). The limit is process-wide, so it
    is counted: taken by the first re-ranking and given back by the last (two threads restoring in turn could
    otherwise leave BLAS on one thread for good).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._held: contextlib.ExitStack | None = None
        self._controller: Any = None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._held = contextlib.ExitStack()
                controller = self._blas()
                if controller is not None:
                    self._held.enter_context(controller.limit(limits=1, user_api="blas"))
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0 and self._held is not None:
                    self._held.close()
                    self._held = None

    def _blas(self) -> Any:
        if self._controller is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:
                self._controller = False
            else:
                self._controller = ThreadpoolController()
        return self._controller or None


one_blas_thread = _OneBlasThread()


def rerank_candidates(query: np.ndarray, candidates: np.ndarray, config: RerankConfig
                      ) -> tuple[np.ndarray, np.ndarray]:
    """One query's shortlist re-ranked: (order [m], the positions of ``candidates`` [m, d] best first; scores [m],
    each candidate's new score, by position). Ties keep the shortlist's order; an empty shortlist gives empties."""
    m = len(candidates)
    if m == 0 or not config.active:
        return np.arange(m), np.zeros(m, dtype=np.float32)
    method, config = RERANKERS[config.method], config.resolved()
    scores = np.asarray(method.scores(query, candidates, **{p: getattr(config, p) for p in method.params}),
                        dtype=np.float32)
    return np.argsort(-scores, kind="stable"), scores


# --- what a re-ranking costs, and its bound ----------------------------------------------------------------------
WORK_UNIT_NS = 10**6  # one work unit: a millisecond of one core (the estimate below, fitted on a 2-core machine)
MAX_QUERY_BYTES = 128 * 2**20  # what one query's re-ranking may hold at once; beyond it the request is refused
VECTOR_BLOCK_BYTES = 32 * 2**20  # the candidates' vectors read back at once for a batch (one query's at least)
_OVERHEAD_BYTES = 2**16  # small arrays and NumPy's own


def work_units(config: RerankConfig, dim: int) -> int:
    """The estimated time of re-ranking one query on one core, in work units (``WORK_UNIT_NS``; at least 1; 0 when
    it re-ranks nothing): with m = candidates, n = m + 1, d = ``dim``, h = round(k1 / 2), in nanoseconds,
    qe 2 m d; dba m^2 d / 50 + 1.5 m k d + 6 m^2; kreciprocal n^2 d / 100 + n^2 (k2 + 40) + 7 n (k1 + 1)(h + 1).
    A Gram matrix's multiply-adds (BLAS) cost a fiftieth of a nanosecond or less, element-wise passes and sorts
    nanoseconds an element (fitted to 72 timings, m 200-1,000, d 64-2,048, k, k1, k2 10-100: within 35 %,
    ``benchmarks/rerank.py memory`` prints the milliseconds a unit takes)."""
    if not config.active:
        return 0
    config = config.resolved()  # an unset size costs at most the paper's
    m, d = config.candidates, int(dim)
    if config.method == "qe":
        ns = 2 * m * d
    elif config.method == "dba":
        ns = m * m * d // 50 + 3 * m * config.k * d // 2 + 6 * m * m
    else:
        n, half = m + 1, int(np.around(config.k1 / 2))
        ns = n * n * d // 100 + n * n * (config.k2 + 40) + 7 * n * (config.k1 + 1) * (half + 1)
    return max(1, -(-ns // WORK_UNIT_NS))


def peak_bytes(config: RerankConfig, dim: int) -> int:
    """An upper bound of the memory one query's re-ranking holds at once, its candidates' vectors included (bytes;
    0 when it re-ranks nothing): with m = candidates, n = m + 1, d = ``dim``, h = round(k1 / 2), B = 8,192 pairs,
    qe 8 m d + 4 k d + 16 m; dba 20 m^2 + 24 m d + 24 m k; kreciprocal 56 n^2 + 8 n d + 16 n (k1 + 1)
    + 9 (h + 1) min(n (k1 + 1), B); each plus 64 KiB (tests/core/test_rerank.py measures them with tracemalloc)."""
    if not config.active:
        return 0
    config = config.resolved()  # an unset size costs at most the paper's
    m, d = config.candidates, int(dim)
    if config.method == "qe":
        held = 8 * m * d + 4 * config.k * d + 16 * m
    elif config.method == "dba":
        held = 20 * m * m + 24 * m * d + 24 * m * config.k
    else:
        n, half = m + 1, int(np.around(config.k1 / 2))
        pairs = n * (config.k1 + 1)
        held = 56 * n * n + 8 * n * d + 16 * pairs + 9 * (half + 1) * min(pairs, PAIR_BLOCK)
    return held + _OVERHEAD_BYTES


class RerankTooLarge(ValueError):
    """A re-ranking whose memory per query would pass ``MAX_QUERY_BYTES`` (refused before anything is allocated)."""


def check_memory(config: RerankConfig, dim: int) -> None:
    """RerankTooLarge, naming the shortlist that fits, when one query's re-ranking at ``dim`` would hold more than
    ``MAX_QUERY_BYTES`` (``peak_bytes``)."""
    needed = peak_bytes(config, dim)
    if needed <= MAX_QUERY_BYTES:
        return
    fits = [m for m in range(1, config.candidates) if peak_bytes(dataclasses.replace(config, candidates=m), dim)
            <= MAX_QUERY_BYTES]
    fix = (f"ask for at most {fits[-1]} candidates" if fits else "this index's vectors are too long to re-rank")
    raise RerankTooLarge(f"re-ranking {config.candidates} candidates of {dim} dimensions with {config.method} would "
                         f"hold {needed / 2**20:.0f} MiB per query (the limit is {MAX_QUERY_BYTES / 2**20:.0f} MiB); "
                         f"{fix}")


class Cancelled(Exception):
    """The caller's ``cancelled()`` became true between two queries: the rest were not re-ranked."""


def rerank_lists(queries: np.ndarray, ids: np.ndarray, vectors: Callable[[np.ndarray], np.ndarray],
                 config: RerankConfig, cancelled: Callable[[], bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's result list [n, depth] (ids best first, -1 padding at the end) with its first
    ``config.candidates`` re-ranked, the rest as they were: (ids [n, depth], scores [n, depth], NaN where not
    re-ranked). ``vectors(unique ids)`` gives their vectors [u, d], once per block of queries whose vectors fit
    ``VECTOR_BLOCK_BYTES`` (one query's at least). RerankTooLarge before anything is read when one query would hold
    more than ``MAX_QUERY_BYTES``; ``cancelled()`` is asked before each query, and Cancelled raised once true."""
    ids = np.asarray(ids, dtype=np.int64)
    queries = np.asarray(queries, dtype=np.float32)
    out_ids, out_scores = ids.copy(), np.full(ids.shape, np.nan, dtype=np.float32)
    if not config.active or ids.size == 0:
        return out_ids, out_scores
    check_memory(config, queries.shape[1])
    shortlist = ids[:, : config.candidates]
    per_block = max(1, VECTOR_BLOCK_BYTES // (4 * queries.shape[1] * shortlist.shape[1]))
    with one_blas_thread():
        for first in range(0, len(shortlist), per_block):
            block = shortlist[first : first + per_block]
            wanted = np.unique(block[block >= 0])
            stored = np.asarray(vectors(wanted), dtype=np.float32) if len(wanted) else None
            for row in range(first, first + len(block)):
                if cancelled is not None and cancelled():
                    raise Cancelled()
                listed = shortlist[row][shortlist[row] >= 0]
                if stored is None or not len(listed):
                    continue
                order, scores = rerank_candidates(queries[row], stored[np.searchsorted(wanted, listed)], config)
                out_ids[row, : len(listed)] = listed[order]
                out_scores[row, : len(listed)] = scores[order]
            del stored
    return out_ids, out_scores
