"""Re-ranking a query's shortlist: alpha-weighted query expansion (αQE) and database-side augmentation (DBA), as in
Radenović, Tolias & Chum, "Fine-tuning CNN Image Retrieval with No Human Annotation" (TPAMI 2018), and k-reciprocal
re-ranking (Zhong, Zheng, Cao & Li, "Re-ranking Person Re-identification with k-reciprocal Encoding", CVPR 2017):
each method's scores, and their registry (``RERANKERS``).

Every method works on a candidate set, never on the whole gallery: the query q [d] and the vectors X [m, d] of its
top ``candidates`` results (best first, unit length, as the index stores them). It returns a new score per candidate
(higher is better); the candidates are then ordered by it, ties kept in their first order, and results beyond the
shortlist follow unchanged (``retrieval.rerank.shortlists``). The same functions re-rank ``retrieval search``, the
API, the app (``retrieval.index.search.Index.search``) and ``retrieval evaluate``
(``retrieval.metrics.evaluation.reranked_metrics``), so the numbers measured are the ones served.

Cost per query, m = candidates (at most ``retrieval.rerank.config.MAX_CANDIDATES``), d = dimension
(``shortlists.work_units`` and ``shortlists.peak_bytes`` give both as numbers, and a server charges and bounds a
request by them):

* ``qe``: one pass over the candidates, O(m d) time and memory.
* ``dba``: the candidates' Gram matrix (each candidate's neighbours among the others), O(m^2 d + m k d) time,
  O(m^2 + m d) memory (the neighbours are summed one column at a time: never an [m, k, d] array).
* ``kreciprocal``: the Gram matrix of query + candidates, then the k-reciprocal sets, O(m^2 d + m^2 k2 + m k1^2)
  time (the sets take most of it) and O(m^2 + m d) memory (at m = 1,000: a handful of 1,001^2 matrices, 8 MiB each
  in float64; the sets' expansion lists gathered 8,192 pairs at a time).

Plain NumPy (no torch, no faiss): the server imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NONE = "none"


# --- the methods -----------------------------------------------------------------------------------------------
def _unit(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length, float32 (an all-zero row stays zero: it has no direction to add)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.where(norms > 0, norms, 1.0)


def _alpha_weights(similarities: np.ndarray, alpha: float) -> np.ndarray:
    """αQE's weights sim^alpha; a negative similarity weighs 0 (a power of a negative number is undefined)."""
    return np.power(np.maximum(similarities, 0.0), alpha)


def _smallest(values: np.ndarray, count: int) -> np.ndarray:
    """Per row, the columns of its ``count`` smallest values, smallest first, ties by lower column [m, count]: a
    partition, then a sort of those alone (O(m^2) for the rows, not O(m^2 log m); which of several equal values at
    the cut is taken is arbitrary)."""
    m = values.shape[1]
    count = min(count, m)
    if count < m:
        chosen = np.sort(np.argpartition(values, count - 1, axis=1)[:, :count], axis=1)  # column order: ties stable
    else:
        chosen = np.broadcast_to(np.arange(m), values.shape)
    order = np.argsort(np.take_along_axis(values, chosen, 1), axis=1, kind="stable")
    return np.take_along_axis(chosen, order, 1)


def _top_others(gram: np.ndarray, k: int) -> np.ndarray:
    """Per row of a square Gram matrix, the columns of its k most similar other rows, best first (ties: lower
    column first) [m, min(k, m - 1)]."""
    m = len(gram)
    k = min(k, m - 1)
    if k <= 0:
        return np.zeros((m, 0), dtype=np.int64)
    others = -gram
    np.fill_diagonal(others, np.inf)
    return _smallest(others, k)


def alpha_query_expansion(query: np.ndarray, candidates: np.ndarray, k: int, alpha: float) -> np.ndarray:
    """αQE scores [m] of candidates [m, d] for query [d]: the query replaced by the unit sum of itself and its top-k
    candidates, each weighted (q . x_i)^alpha (the query's own weight is 1), and compared with every candidate."""
    query, candidates = _unit(query), _unit(candidates)
    similarities = candidates @ query
    top = np.argsort(-similarities, kind="stable")[: min(k, len(candidates))]
    expanded = query + _alpha_weights(similarities[top], alpha) @ candidates[top]
    return candidates @ _unit(expanded)


def augment_database(vectors: np.ndarray, neighbours: np.ndarray, similarities: np.ndarray,
                     alpha: float) -> np.ndarray:
    """DBA: each vector [n, d] replaced by the unit sum of itself and its neighbours (``neighbours`` [n, k] row
    numbers, -1 for none; ``similarities`` [n, k] theirs), each weighted sim^alpha, as αQE weighs a query's."""
    vectors = _unit(vectors)
    weights = np.where(neighbours >= 0, _alpha_weights(similarities, alpha), 0.0).astype(np.float32)
    summed = vectors.copy()
    for column in range(neighbours.shape[1]):  # k gathers of [n, d]: an [n, k, d] array is k times the vectors
        summed += weights[:, column, None] * vectors[np.maximum(neighbours[:, column], 0)]  # a -1 weighs 0
    return _unit(summed)


def database_side_augmentation(query: np.ndarray, candidates: np.ndarray, k: int, alpha: float) -> np.ndarray:
    """DBA scores [m]: each candidate [m, d] augmented with its top-k other candidates (``augment_database`` over the
    shortlist, the query itself not among them), then compared with the query [d]."""
    candidates = _unit(candidates)
    gram = candidates @ candidates.T
    top = _top_others(gram, k)
    augmented = augment_database(candidates, top, np.take_along_axis(gram, top, 1), alpha)
    return augmented @ _unit(query)


def k_reciprocal_distances(query: np.ndarray, candidates: np.ndarray, k1: int, k2: int,
                           lambda_value: float) -> np.ndarray:
    """Zhong et al.'s final distance d* [m] from query [d] to each candidate [m, d], over the set P = {query} +
    candidates, as the authors' published code computes it:

    * d(i, j): squared Euclidean distance, each row divided by its largest value;
    * N(i, k): the k + 1 nearest of i in P, i itself first; R(i, k) = {j in N(i, k) : i in N(j, k)} (eq. 4);
    * R*(i, k1) = R(i, k1) + every R(j, round(k1 / 2)), j in R(i, k1), that shares more than 2/3 of its members with
      R(i, k1) (eq. 6);
    * V_i,j = exp(-d(i, j)) for j in R*(i, k1), 0 otherwise, each row summing to 1 (eq. 7);
    * local query expansion: V_i = mean of V_j over the k2 nearest j of i, itself included (eq. 11);
    * d_J(i, j) = 1 - sum min(V_i, V_j) / sum max(V_i, V_j) (eq. 10); d* = (1 - lambda) d_J + lambda d (eq. 12).
    """
    nodes = np.concatenate([_unit(query)[None, :], _unit(candidates)])
    m = len(nodes)
    gram = nodes @ nodes.T
    squared = np.diag(gram)
    distance = np.maximum(squared[:, None] + squared[None, :] - 2.0 * gram, 0.0).astype(np.float64)
    largest = distance.max(axis=1, keepdims=True)
    distance /= np.where(largest > 0, largest, 1.0)
    rank = _smallest(distance, max(k1 + 1, k2))  # the nearest of each node, itself first: all the sets read
    reciprocal = _reciprocal(rank, k1)
    half = int(np.around(k1 / 2))  # the authors' code rounds half to even, as NumPy does
    half_lists, half_sizes = _members(_reciprocal(rank, half), rank, half)
    # each j in R(i, k1): its half-size set joins R*(i) when more than 2/3 of it lies in R(i, k1); the lists are
    # padded with column m, a column outside every set
    padded = np.concatenate([reciprocal, np.zeros((m, 1), dtype=bool)], axis=1)
    pairs_i, pairs_j = np.nonzero(reciprocal)
    # the pairs' lists [pairs, half + 1] a block at a time (up to m (k1 + 1) x (half + 1) ids: 41 MB at k1 = 100):
    # every block read before any is written, as R(i, k1) is read whole before R*(i) grows
    blocks = [slice(start, start + PAIR_BLOCK) for start in range(0, len(pairs_i), PAIR_BLOCK)]
    joins = np.concatenate([padded[pairs_i[b, None], half_lists[pairs_j[b]]].sum(axis=1)
                            > 2.0 / 3.0 * half_sizes[pairs_j[b]] for b in blocks] or [np.zeros(0, dtype=bool)])
    for b in blocks:
        joined = joins[b]
        padded[pairs_i[b][joined][:, None], half_lists[pairs_j[b][joined]]] = True
    expanded = padded[:, :m]
    # a node is in its own set (distance 0), also where more exact duplicates than k1 + 1 rank before it
    np.fill_diagonal(expanded, True)
    weights = np.where(expanded, np.exp(-distance), 0.0)
    weights /= weights.sum(axis=1, keepdims=True)
    if k2 > 1:
        nearest = rank[:, : min(k2, m)]
        local = np.zeros_like(weights)
        for column in range(nearest.shape[1]):  # k2 gathers of [m, m]: never an [m, k2, m] array
            local += weights[nearest[:, column]]
        weights = local / nearest.shape[1]
    smaller = np.minimum(weights[0][None, :], weights[1:]).sum(axis=1)
    larger = np.maximum(weights[0][None, :], weights[1:]).sum(axis=1)
    jaccard = 1.0 - smaller / larger
    return ((1.0 - lambda_value) * jaccard + lambda_value * distance[0, 1:]).astype(np.float32)


PAIR_BLOCK = 8192  # k-reciprocal pairs whose expansion lists are gathered at once (8,192 x 51 ids: 3.3 MB)


def _reciprocal(rank: np.ndarray, k: int) -> np.ndarray:
    """R(i, k) of every node as a boolean matrix [m, m]: j among i's k + 1 nearest and i among j's."""
    m = len(rank)
    nearest = np.zeros((m, m), dtype=bool)
    nearest[np.arange(m)[:, None], rank[:, : min(k, m - 1) + 1]] = True
    return nearest & nearest.T


def _members(sets: np.ndarray, rank: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's members of R(i, k) (``sets``, within its k + 1 nearest ``rank``) as column lists [m, k + 1] where
    m (the number of columns) pads the places of non-members, and each row's size."""
    m = sets.shape[1]
    nearest = rank[:, : min(k, m - 1) + 1]
    member = np.take_along_axis(sets, nearest, 1)
    return np.where(member, nearest, m), member.sum(axis=1)


def k_reciprocal(query: np.ndarray, candidates: np.ndarray, k1: int, k2: int, lambda_value: float) -> np.ndarray:
    """k-reciprocal scores [m]: 1 - d* (``k_reciprocal_distances``), so that higher is better as for the others."""
    return 1.0 - k_reciprocal_distances(query, candidates, k1, k2, lambda_value)


@dataclass(frozen=True)
class RerankMethod:
    """One re-ranking method: its paper, the ``RerankConfig`` fields it reads, and its scores."""

    name: str
    title: str
    paper: str
    params: tuple[str, ...]  # RerankConfig field names it uses
    scores: Callable[..., np.ndarray]  # (query [d], candidates [m, d], **params) -> [m], higher is better


RERANKERS: dict[str, RerankMethod] = {}


def register(method: RerankMethod) -> RerankMethod:
    """Add a method to ``RERANKERS`` (one entry per method)."""
    if method.name in RERANKERS or method.name == NONE:
        raise KeyError(f"re-ranking method {method.name!r} is registered twice (or is the word for no re-ranking)")
    RERANKERS[method.name] = method
    return method


RADENOVIC = "Radenović, Tolias & Chum, TPAMI 2018"
register(RerankMethod("qe", "alpha-weighted query expansion (αQE)", RADENOVIC, ("k", "alpha"),
                      alpha_query_expansion))
register(RerankMethod("dba", "database-side augmentation (DBA) of the shortlist", RADENOVIC, ("k", "alpha"),
                      database_side_augmentation))
register(RerankMethod("kreciprocal", "k-reciprocal encoding (Jaccard distance + local query expansion)",
                      "Zhong, Zheng, Cao & Li, CVPR 2017", ("k1", "k2", "lambda_value"), k_reciprocal))


def method_names() -> list[str]:
    """The choices of ``--rerank``: none, then the registered methods in registration order."""
    return [NONE, *RERANKERS]
