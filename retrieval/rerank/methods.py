"""Re-ranking a query's shortlist: alpha-weighted query expansion (αQE) and database-side augmentation (DBA), as in
Radenović, Tolias & Chum, "Fine-tuning CNN Image Retrieval with No Human Annotation" (TPAMI 2018), and k-reciprocal
re-ranking (Zhong, Zheng, Cao & Li, "Re-ranking Person Re-identification with k-reciprocal Encoding", CVPR 2017).

Every method works on a candidate set, never on the whole gallery: the query q [d] and the vectors X [m, d] of its
top ``candidates`` results (best first, unit length, as the index stores them). It returns a new score per candidate
(higher is better); the candidates are then ordered by it, ties kept in their first order, and results beyond the
shortlist follow unchanged. The same functions re-rank ``retrieval search``, the API, the app
(``retrieval.index.search.Index.search``) and ``retrieval evaluate``
(``retrieval.metrics.evaluation.reranked_metrics``), so the numbers measured are the ones served.

Cost per query, m = candidates (at most ``MAX_CANDIDATES``), d = dimension (``work_units`` and ``peak_bytes`` give
both as numbers, and a server charges and bounds a request by them):

* ``qe``: one pass over the candidates, O(m d) time and memory.
* ``dba``: the candidates' Gram matrix (each candidate's neighbours among the others), O(m^2 d + m k d) time,
  O(m^2 + m d) memory (the neighbours are summed one column at a time: never an [m, k, d] array).
* ``kreciprocal``: the Gram matrix of query + candidates, then the k-reciprocal sets, O(m^2 d + m^2 k2 + m k1^2)
  time (the sets take most of it) and O(m^2 + m d) memory (at m = 1,000: a handful of 1,001^2 matrices, 8 MiB each
  in float64; the sets' expansion lists gathered 8,192 pairs at a time).

Plain NumPy (no torch, no faiss): the server imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from retrieval.options import declared_options, field_problem, hint_members, option

NONE = "none"
MAX_CANDIDATES = 1000  # the shortlist one query re-ranks at most: kreciprocal holds a few (m + 1)^2 matrices
# (8 MiB each at the cap) and takes ~0.13 s (docs/BENCHMARKS.md, "Re-ranking")
DEFAULT_CANDIDATES = 100
MAX_NEIGHBOURS = 100  # k, k1 and k2 at most: neighbour lists longer than this re-rank nothing a shortlist holds
MAX_ALPHA = 10.0  # sim^alpha: beyond 10 every weight but the nearest is ~0 (Radenović et al. use 3)


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
    blocks = [slice(start, start + _PAIR_BLOCK) for start in range(0, len(pairs_i), _PAIR_BLOCK)]
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


_PAIR_BLOCK = 8192  # k-reciprocal pairs whose expansion lists are gathered at once (8,192 x 51 ids: 3.3 MB)


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


# --- the options, declared once ----------------------------------------------------------------------------------
SECTION = "re-ranking"
# the neighbourhood sizes a request may leave unset: the gallery's typical class size sets them
# (``retrieval.rerank.defaults``); where nothing has, the papers' values, which are also the largest derived ones
PAPER_NEIGHBOURHOOD = {"k": 10, "k1": 20, "k2": 6}  # Radenović et al.'s k; Zhong et al.'s k1 and k2
FROM_GALLERY = "set by the gallery's class sizes (docs/INDEX.md)"


@dataclass(frozen=True)
class RerankConfig:
    """How a search re-ranks its shortlist. Each field is declared once: the command line's ``--rerank*`` options,
    the API's ``rerank`` object (the field names are its keys) and the docs' table are made from it."""

    method: str = option(NONE, SECTION, "re-rank each query's shortlist: qe (αQE) and dba (database-side "
                         "augmentation), Radenović et al. TPAMI 2018; kreciprocal, Zhong et al. CVPR 2017.",
                         choices=method_names, flag="--rerank")
    candidates: int = option(DEFAULT_CANDIDATES, SECTION, "the shortlist re-ranked per query: the top results, "
                             "whose stored vectors the method reads (results beyond it keep their order).", low=1,
                             high=MAX_CANDIDATES, unit="results", flag="--rerank-candidates")
    k: int | None = option(None, SECTION, "qe: the top candidates added to the query; dba: the neighbours added to "
                           "each candidate.", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k",
                           default_text=FROM_GALLERY)
    alpha: float = option(3.0, SECTION, "qe and dba: a neighbour weighs its cosine similarity to the power alpha "
                          "(0: a plain average).", low=0, high=MAX_ALPHA, flag="--rerank-alpha")
    k1: int | None = option(None, SECTION, "kreciprocal: the neighbourhood of the k-reciprocal sets (k1 / 2 for "
                            "their expansion).", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k1",
                            default_text=FROM_GALLERY)
    k2: int | None = option(None, SECTION, "kreciprocal: the neighbours averaged by the local query expansion (1: "
                            "none).", low=1, high=MAX_NEIGHBOURS, flag="--rerank-k2", default_text=FROM_GALLERY)
    lambda_value: float = option(0.3, SECTION, "kreciprocal: the weight of the original distance in the final one "
                                 "(1 - lambda for the Jaccard distance).", low=0, high=1, flag="--rerank-lambda")

    def __post_init__(self) -> None:
        problems = config_problems(dataclasses.asdict(self))
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def active(self) -> bool:
        """Whether it re-ranks anything (method is not none)."""
        return self.method != NONE

    def unset(self) -> tuple[str, ...]:
        """The neighbourhood sizes its method reads that were left unset (for the gallery to choose)."""
        return tuple(name for name in RERANKERS[self.method].params
                     if name in PAPER_NEIGHBOURHOOD and getattr(self, name) is None) if self.active else ()

    def resolved(self) -> RerankConfig:
        """Every neighbourhood size set: an unset one takes the paper's value (the largest a gallery derives, so a
        cost computed from it bounds the cost of any gallery's)."""
        return dataclasses.replace(self, **{name: value for name, value in PAPER_NEIGHBOURHOOD.items()
                                            if getattr(self, name) is None})

    def params(self) -> dict[str, Any]:
        """The parameters its method reads, with the shortlist size (what a report and an answer show)."""
        if not self.active:
            return {}
        resolved = self.resolved()
        return {"candidates": self.candidates,
                **{name: getattr(resolved, name) for name in RERANKERS[self.method].params}}

    def describe(self, defaults: str | None = None) -> dict[str, Any]:
        """Method, title, paper and parameters, as the API's answers and the evaluate report show them;
        ``defaults``: where the sizes left unset came from (``retrieval.rerank.defaults.Neighbourhood.basis``)."""
        if not self.active:
            return {"method": NONE}
        method = RERANKERS[self.method]
        return {"method": self.method, "title": method.title, "paper": method.paper, "params": self.params(),
                **({"defaults": defaults} if defaults else {})}


def config_problems(values: Mapping[str, Any], names: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with a ``RerankConfig``'s field ``values``, each problem naming its flag (or ``names[field]``
    instead): types, choices and ranges as declared. Each range is checked alone (what a JSON schema can say); a
    neighbourhood larger than the shortlist (k, k1 or k2 above the candidates a query has) takes all of it."""
    renamed = names or {}
    problems = []
    for declared in declared_options(RerankConfig):
        problem = field_problem(declared, values[declared.name])
        if problem is not None:
            problems.append(problem.replace(declared.flag, renamed.get(declared.name, declared.flag), 1))
    return problems


NO_RERANK = RerankConfig()
API_KEY = "rerank"  # the key (JSON) and query parameter of POST /search and /search/batch
MAX_PROBLEM_CHARS = 200


def rerank_from_json(value: Any) -> RerankConfig:
    """The API's ``rerank``: a method name, or an object of ``RerankConfig``'s field names (``method`` required).
    A ValueError names the JSON key at fault, the allowed values and the fix."""
    if isinstance(value, str):
        value = {"method": value}
    if not isinstance(value, dict):
        raise ValueError(f'"{API_KEY}" must be a method name ({", ".join(method_names())}) or an object such as '
                         f'{{"method": "qe", "k": 10}}, got {type(value).__name__}')
    declared = declared_options(RerankConfig)
    fields = [d.name for d in declared]
    unknown = sorted(str(key)[:40] for key in set(value) - set(fields))
    if unknown:
        raise ValueError(f'"{API_KEY}" has unknown keys {", ".join(map(repr, unknown[:5]))}; its keys are '
                         f'{", ".join(fields)}')
    if "method" not in value:
        raise ValueError(f'"{API_KEY}" needs "method": one of {", ".join(method_names())}')
    values = dataclasses.asdict(NO_RERANK) | value
    for option_ in declared:  # JSON has one number type: 5.0 is the integer 5 where an integer is declared
        given = values[option_.name]
        if int in hint_members(option_.hint) and isinstance(given, float) and given.is_integer():
            values[option_.name] = int(given)
    problems = config_problems(values, {name: f'"{API_KEY}.{name}"' for name in fields})
    if problems:  # each cut: a problem quotes the value sent, which a client may make as long as its body
        raise ValueError("; ".join(p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS] + "… (cut)"
                                   for p in problems))
    return RerankConfig(**values)


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
        held = 56 * n * n + 8 * n * d + 16 * pairs + 9 * (half + 1) * min(pairs, _PAIR_BLOCK)
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
