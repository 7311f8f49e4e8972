"""Measuring an index against exact search: exact neighbours over the stored vectors, recall and latency.

Shared by the read side (``index stats``, the server's leave-one-out diagnostics) and the build's tuning.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import faiss
import numpy as np


def exact_knn(
    queries: np.ndarray, shards: Iterable[tuple[np.ndarray, np.ndarray]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product over (ids, vectors) chunks, never holding the whole gallery."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for ids, vectors in shards:
        if len(ids) == 0:
            continue
        scores, positions = faiss.knn(queries, vectors, min(k, len(ids)), metric=faiss.METRIC_INNER_PRODUCT)
        labels = np.where(positions >= 0, ids[np.clip(positions, 0, None)], -1)
        pad = k - scores.shape[1]
        if pad:
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
            labels = np.pad(labels, ((0, 0), (0, pad)), constant_values=-1)
        heap.add_result(np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(labels))
    heap.finalize()
    return heap.D, heap.I


def recall_at(found: np.ndarray, exact: np.ndarray, n_true: int, r: int) -> float:
    """``n_true``-recall@``r``: share of the exact top ``n_true`` found among the first ``r`` results."""
    truth, got = exact[:, :n_true], found[:, :r]
    hits = [
        len(set(t[t >= 0]) & set(g[g >= 0])) / max(1, int((t >= 0).sum()))
        for t, g in zip(truth, got, strict=True)
    ]
    return float(np.mean(hits)) if hits else float("nan")


def latency_ms(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, repeats: int = 200
) -> dict[str, float]:
    """p50/p99 wall time of single-query searches, in milliseconds."""
    times = []
    for i in range(min(repeats, len(queries))):
        start = time.perf_counter()
        search(queries[i : i + 1])
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


def drop_self(ids: np.ndarray, self_ids: np.ndarray | None, k: int) -> np.ndarray:
    """Results without each query's own id (queries taken from the gallery act as held-out queries)."""
    if self_ids is None:
        return ids[:, :k]
    out = np.full((len(ids), k), -1, dtype=np.int64)
    for row, (found, own) in enumerate(zip(ids, self_ids, strict=True)):
        kept = found[found != own][:k]
        out[row, : len(kept)] = kept
    return out
