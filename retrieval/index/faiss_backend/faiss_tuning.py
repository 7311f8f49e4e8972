"""Tuning an index's search-time parameters: the cheapest setting reaching the recall target (within a time per
query when one is given). The write side: the build tunes, readers apply what ``index.json`` recorded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np

from retrieval.index.faiss_backend.faiss_measure import drop_self, latency_ms, recall_at
from retrieval.index.faiss_backend.faiss_params import refine_of, search_param_grid, set_search_params


@dataclass
class Tuning:
    """A setting tuning tried, with the recall (and, under a time budget, the latency) it reached."""

    params: dict[str, Any]
    recall_1_at_1: float
    recall_10_at_10: float
    target_met: bool
    latency_ms: float | None = None  # p50 of one query at these params (measured under a --max-query-ms budget)
    latency_met: bool | None = None


def tune_search_params(
    index: faiss.Index,
    queries: np.ndarray,
    exact_ids: np.ndarray,
    target: float = 0.95,
    k: int = 10,
    self_ids: np.ndarray | None = None,
    max_query_ms: float | None = None,
) -> Tuning:
    """The cheapest setting whose 10-recall@10 against exact search reaches ``target`` (within ``max_query_ms``
    per query when given: ``_tune_within_latency``).

    Parameters are tried from cheapest to most expensive; when none reaches the target the most
    expensive one is kept and ``target_met`` is False. With ``self_ids`` (queries that are gallery
    vectors), each query's own id is dropped from the results, so that they measure like unseen
    queries (``exact_ids`` must be prepared the same way).
    """
    if max_query_ms is not None:
        return _tune_within_latency(index, queries, exact_ids, target, k, self_ids, max_query_ms)
    last = None
    for params in search_param_grid(index, k):
        set_search_params(index, params)
        _, found = index.search(queries, k + (self_ids is not None))
        found = drop_self(found, self_ids, k)
        last = Tuning(params, recall_at(found, exact_ids, 1, 1), recall_at(found, exact_ids, k, k), False)
        if last.recall_10_at_10 >= target:
            last.target_met = True
            return last
    return last


def _tune_within_latency(index: faiss.Index, queries: np.ndarray, exact_ids: np.ndarray, target: float, k: int,
                         self_ids: np.ndarray | None, max_query_ms: float) -> Tuning:
    """Under a latency budget: the cheapest setting reaching ``target`` within ``max_query_ms`` (p50 of single
    queries), else the best recall within it, else (nothing is that fast) the fastest setting, marked unmet."""
    within: list[Tuning] = []
    fastest: Tuning | None = None
    for params in search_param_grid(index, k):
        set_search_params(index, params)
        _, found = index.search(queries, k + (self_ids is not None))
        found = drop_self(found, self_ids, k)
        latency = latency_ms(lambda q: index.search(q, k), queries, repeats=100)["p50_ms"]
        tuning = Tuning(params, recall_at(found, exact_ids, 1, 1), recall_at(found, exact_ids, k, k),
                        False, round(latency, 4), latency <= max_query_ms)
        tuning.target_met = tuning.recall_10_at_10 >= target
        fastest = tuning if fastest is None or latency < fastest.latency_ms else fastest
        if not tuning.latency_met:
            if within and refine_of(index) is None:  # one nprobe/efSearch axis: settings only get slower from here
                break
            continue
        within.append(tuning)
        if tuning.target_met:
            break
    chosen = max(within, key=lambda t: (t.target_met, t.recall_10_at_10, -t.latency_ms)) if within else fastest
    set_search_params(index, chosen.params)
    return chosen
