"""One ranked list from a text query's vector hits and its keyword hits (``retrieval.text.keywords``), each hit
saying where it came from: ``"vector"``, ``"keyword"`` or ``"both"``. Plain functions over arrays (NumPy only).

Plain reciprocal-rank fusion treats every keyword hit as evidence, so a query whose words one title shares by
chance pulls that title above what a good text tower found. This fusion keeps the vector order and adds a bounded
boost for real keyword matches only:

    fused_i = cosine_i + keyword_weight * relevance_i        where the hit's text holds at least ``min_matched``
                                                            of the query's content words, else fused_i = cosine_i
    relevance_i = matched_i * bm25_i / max_j bm25_j         (in [0, 1])

``cosine_i`` is the hit's cosine with the query: the vector search's, or, for a keyword hit the vector candidates
lack, the one measured for it (``keyword_cosines``; unknown: the lowest candidate's, a stand-in no candidate is
below). A query whose words match nothing (or nothing enough) leaves the vector order as it was. Without vector
hits (an index with no text model) the keyword hits are ranked by ``relevance`` alone. ``FusionParams``' defaults
are measured (``benchmarks/keyword_fusion.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VECTOR, KEYWORD, BOTH = "vector", "keyword", "both"


@dataclass(frozen=True)
class FusionParams:
    """How keyword hits move the vector order (module docstring); defaults measured on the demo's emoji."""

    keyword_weight: float = 0.5  # the boost of a full, best-scored keyword match, in cosine units
    min_matched: float = 0.5  # the share of the query's content words a hit's text must hold to count

    def __post_init__(self) -> None:
        if not (np.isfinite(self.keyword_weight) and self.keyword_weight >= 0):
            raise ValueError(f"keyword_weight must be a finite number >= 0, got {self.keyword_weight!r}")
        if not 0 < self.min_matched <= 1:
            raise ValueError(f"min_matched must be in (0, 1], got {self.min_matched!r}")


@dataclass(frozen=True)
class Fused:
    """The fused list, best first: ids (int64), the order's scores, each hit's cosine (NaN: unknown, keywords
    alone) and its source."""

    ids: np.ndarray
    scores: np.ndarray
    cosines: np.ndarray
    sources: list[str]


def keyword_relevance(scores: np.ndarray, matched: np.ndarray) -> np.ndarray:
    """Each keyword hit's ``matched * score / max(score)`` in [0, 1] (scores: higher is better; <= 0 counts 0)."""
    scores = np.maximum(np.asarray(scores, dtype=np.float64), 0.0)
    top = scores.max(initial=0.0)
    share = scores / top if top > 0 else np.ones_like(scores)
    return np.clip(np.asarray(matched, dtype=np.float64), 0.0, 1.0) * share


def fuse(vector_ids: np.ndarray, vector_scores: np.ndarray, keyword_ids: np.ndarray, keyword_scores: np.ndarray,
         keyword_matched: np.ndarray, params: FusionParams = FusionParams(), keyword_cosines: np.ndarray | None = None,
         limit: int | None = None) -> Fused:
    """The vector hits (ids, cosines; -1 ids ignored) and the keyword hits (ids, scores, matched shares; optionally
    their cosines, NaN where unknown) as one list of at most ``limit`` hits, best first (module docstring). Ties keep
    the vector order, then the keyword order."""
    vector_ids = np.asarray(vector_ids, dtype=np.int64).ravel()
    vector_scores = np.asarray(vector_scores, dtype=np.float64).ravel()
    valid = vector_ids >= 0
    vector_ids, vector_scores = vector_ids[valid], vector_scores[valid]
    keyword_ids = np.asarray(keyword_ids, dtype=np.int64).ravel()
    relevance = keyword_relevance(keyword_scores, keyword_matched)
    if not len(vector_ids):  # keywords alone
        order = np.argsort(-relevance, kind="stable")[:limit]
        known = np.full(len(keyword_ids), np.nan) if keyword_cosines is None else \
            np.asarray(keyword_cosines, dtype=np.float64).ravel()
        return Fused(keyword_ids[order], relevance[order], known[order], [KEYWORD] * len(order))
    real = np.asarray(keyword_matched, dtype=np.float64) >= params.min_matched - 1e-9
    keyword_ids, relevance = keyword_ids[real], relevance[real]
    cosines = (np.full(len(real), np.nan) if keyword_cosines is None
               else np.asarray(keyword_cosines, dtype=np.float64).ravel())[real]
    # the vector candidates first (in their order), then the keyword hits they lack
    vector_ids, first = np.unique(vector_ids, return_index=True)  # a repeated id keeps its first (best) score
    position = np.argsort(first, kind="stable")
    vector_ids, vector_scores = vector_ids[position], vector_scores[np.sort(first)]
    in_vector = np.isin(keyword_ids, vector_ids)
    extra_ids = keyword_ids[~in_vector]
    floor = vector_scores.min()
    extra_cosines = np.where(np.isnan(cosines[~in_vector]), floor, cosines[~in_vector])
    ids = np.concatenate([vector_ids, extra_ids])
    cos = np.concatenate([vector_scores, extra_cosines])
    boost = np.zeros(len(ids))
    index_of = {int(i): n for n, i in enumerate(ids.tolist())}
    for kid, rel in zip(keyword_ids.tolist(), relevance.tolist(), strict=True):
        boost[index_of[kid]] = max(boost[index_of[kid]], rel)
    fused = cos + params.keyword_weight * boost
    order = np.argsort(-fused, kind="stable")[:limit]
    keyword_set = set(keyword_ids.tolist())
    vector_count = len(vector_ids)
    sources = [BOTH if n < vector_count and int(ids[n]) in keyword_set else VECTOR if n < vector_count else KEYWORD
               for n in order.tolist()]
    return Fused(ids[order], fused[order], cos[order], sources)


def reciprocal_rank_fusion(vector_ids: np.ndarray, keyword_ids: np.ndarray, k: int = 60,
                           limit: int | None = None) -> np.ndarray:
    """Plain reciprocal-rank fusion (Cormack et al., 2009: sum of 1 / (k + rank)), the baseline the benchmark
    compares with: the fused ids, best first."""
    scores: dict[int, float] = {}
    for ranked in (vector_ids, keyword_ids):
        for rank, i in enumerate(int(x) for x in np.asarray(ranked).ravel() if x >= 0):
            scores[i] = scores.get(i, 0.0) + 1.0 / (k + rank + 1)
    order = sorted(scores, key=lambda i: -scores[i])
    return np.asarray(order[:limit], dtype=np.int64)
