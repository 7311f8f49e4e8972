"""Re-ranking (``retrieval.rerank``): each method against a slow float64 loop of its paper's formula, the shortlist
mechanics (ties, padding, results beyond the shortlist), degenerate shortlists, the declared bounds, the API's form,
``reranked_metrics`` against metrics computed from the re-ranked lists by hand, and what one query costs: the memory
bound measured with tracemalloc, the work units, the cancellation between queries."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from retrieval.rerank import (
    MAX_CANDIDATES,
    MAX_QUERY_BYTES,
    RERANKERS,
    Cancelled,
    RerankConfig,
    RerankTooLarge,
    alpha_query_expansion,
    augment_database,
    database_side_augmentation,
    k_reciprocal_distances,
    method_names,
    methods,
    peak_bytes,
    rerank_candidates,
    rerank_from_json,
    rerank_lists,
    shortlists,
    work_units,
)


def unit_rows(count: int, dim: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).normal(size=(count, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def clustered(count: int, dim: int, seed: int, clusters: int = 4) -> np.ndarray:
    """Unit vectors around a few centres: neighbourhoods with structure, as embeddings have."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(clusters, dim))
    points = centres[rng.integers(0, clusters, count)] + 0.6 * rng.normal(size=(count, dim))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


def unit64(vector) -> np.ndarray:
    vector = np.asarray(vector, dtype=np.float64)
    return vector / math.sqrt(float(vector @ vector))


# --- slow references, one formula each -------------------------------------------------------------------------
def alpha_qe_reference(query, candidates, k, alpha):
    """Radenović et al.: q' = q + sum over the top-k x_i of (q . x_i)^alpha x_i, normalised; score q' . x."""
    q = unit64(query)
    xs = [unit64(x) for x in candidates]
    sims = [float(q @ x) for x in xs]
    top = sorted(range(len(xs)), key=lambda i: (-sims[i], i))[:k]
    expanded = q.copy()
    for i in top:
        expanded += max(sims[i], 0.0) ** alpha * xs[i]
    expanded = unit64(expanded)
    return np.array([float(expanded @ x) for x in xs])


def dba_reference(query, candidates, k, alpha):
    """Each x_j replaced by x_j + sum over its top-k other x_i of (x_j . x_i)^alpha x_i, normalised; score q . x_j'."""
    q = unit64(query)
    xs = [unit64(x) for x in candidates]
    scores = []
    for j, x in enumerate(xs):
        sims = {i: float(x @ other) for i, other in enumerate(xs) if i != j}
        top = sorted(sims, key=lambda i: (-sims[i], i))[:k]
        augmented = x.copy()
        for i in top:
            augmented += max(sims[i], 0.0) ** alpha * xs[i]
        scores.append(float(q @ unit64(augmented)))
    return np.array(scores)


def k_reciprocal_reference(query, candidates, k1, k2, lambda_value):
    """Zhong et al.'s re-ranking as their published code computes it, loop by loop, over {query} + candidates."""
    nodes = [unit64(query)] + [unit64(x) for x in candidates]
    m = len(nodes)
    dist = np.array([[float((a - b) @ (a - b)) for b in nodes] for a in nodes])
    dist = np.array([row / row.max() for row in dist])
    rank = [sorted(range(m), key=lambda j, i=i: (dist[i][j], j)) for i in range(m)]

    def reciprocal(i, k):
        forward = rank[i][: k + 1]
        return [j for j in forward if i in rank[j][: k + 1]]

    V = np.zeros((m, m))
    for i in range(m):
        r_set = reciprocal(i, k1)
        expansion = set(r_set)
        for candidate in r_set:
            half = reciprocal(candidate, int(np.around(k1 / 2)))
            if len(set(half) & set(r_set)) > 2 / 3 * len(half):
                expansion |= set(half)
        weights = {j: math.exp(-dist[i][j]) for j in expansion}
        total = sum(weights.values())
        for j, w in weights.items():
            V[i][j] = w / total
    if k2 != 1:
        V = np.array([np.mean([V[j] for j in rank[i][:k2]], axis=0) for i in range(m)])
    out = []
    for g in range(1, m):
        low = sum(min(V[0][j], V[g][j]) for j in range(m))
        high = sum(max(V[0][j], V[g][j]) for j in range(m))
        out.append((1 - lambda_value) * (1 - low / high) + lambda_value * dist[0][g])
    return np.array(out)


@pytest.mark.parametrize("k,alpha", [(1, 3.0), (5, 3.0), (8, 0.0), (40, 1.5)])
def test_alpha_query_expansion_is_the_papers_formula(k, alpha):
    candidates, query = unit_rows(30, 12, 1), unit_rows(1, 12, 2)[0]
    np.testing.assert_allclose(alpha_query_expansion(query, candidates, k, alpha),
                               alpha_qe_reference(query, candidates, k, alpha), atol=1e-5)


@pytest.mark.parametrize("k,alpha", [(1, 3.0), (4, 3.0), (6, 0.0), (50, 2.0)])
def test_database_side_augmentation_is_the_papers_formula(k, alpha):
    candidates, query = clustered(25, 10, 3), unit_rows(1, 10, 4)[0]
    np.testing.assert_allclose(database_side_augmentation(query, candidates, k, alpha),
                               dba_reference(query, candidates, k, alpha), atol=1e-5)


def test_augment_database_ignores_missing_neighbours():
    vectors = unit_rows(3, 4, 5)
    neighbours = np.array([[1, -1], [-1, -1], [0, 2]])
    similarities = np.array([[0.5, 9.0], [9.0, 9.0], [0.25, 0.5]], dtype=np.float32)
    augmented = augment_database(vectors, neighbours, similarities, 2.0)
    np.testing.assert_allclose(augmented[1], vectors[1], atol=1e-6)
    expected = unit64(vectors[0] + 0.25 * vectors[1])
    np.testing.assert_allclose(augmented[0], expected, atol=1e-6)


@pytest.mark.parametrize("k1,k2,lambda_value", [(20, 6, 0.3), (5, 1, 0.0), (8, 3, 1.0), (3, 2, 0.5), (60, 6, 0.3)])
@pytest.mark.parametrize("seed", [6, 7])
def test_k_reciprocal_is_the_papers_formula(k1, k2, lambda_value, seed):
    candidates, query = clustered(40, 8, seed), clustered(1, 8, seed + 50)[0]
    np.testing.assert_allclose(k_reciprocal_distances(query, candidates, k1, k2, lambda_value),
                               k_reciprocal_reference(query, candidates, k1, k2, lambda_value), atol=1e-5)


@pytest.mark.parametrize("method", list(RERANKERS))
@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_tiny_shortlists_are_re_ranked_without_errors(method, count):
    """A gallery of one image, a filter matching one or two: every method answers, scores are finite."""
    config = RerankConfig(method=method, k=1, k1=1, k2=1)
    order, scores = rerank_candidates(unit_rows(1, 6, 8)[0], unit_rows(count, 6, 9), config)
    assert sorted(order.tolist()) == list(range(count)) and np.isfinite(scores).all()


@pytest.mark.parametrize("method", list(RERANKERS))
def test_parameters_larger_than_the_shortlist_use_what_there_is(method):
    """k = 100 over 5 candidates (a small gallery): every candidate is a neighbour, nothing fails."""
    config = RerankConfig(method=method, k=100, k1=100, k2=100, candidates=1000)
    order, scores = rerank_candidates(unit_rows(1, 6, 10)[0], unit_rows(5, 6, 11), config)
    assert sorted(order.tolist()) == list(range(5)) and np.isfinite(scores).all()


def test_duplicates_keep_their_shortlist_order():
    """Equal scores (the same vector twice) keep the order the search gave them, as the metrics order ties."""
    candidates = np.repeat(unit_rows(1, 6, 12), 4, axis=0)
    for method in RERANKERS:
        order, scores = rerank_candidates(unit_rows(1, 6, 13)[0], candidates, RerankConfig(method=method, k=2,
                                                                                          k1=1, k2=1))
        assert order.tolist() == [0, 1, 2, 3] and np.isfinite(scores).all(), method


def test_rerank_lists_reorders_the_shortlist_only_and_keeps_padding():
    gallery = clustered(50, 8, 14)
    queries = clustered(3, 8, 15)
    lists = np.argsort(-(queries @ gallery.T), axis=1)[:, :12]
    lists[2, 9:] = -1  # a query with fewer results (a filter)
    config = RerankConfig(method="kreciprocal", candidates=6, k1=4, k2=2)
    ids, scores = rerank_lists(queries, lists, lambda wanted: gallery[wanted], config)
    for row in range(3):
        assert sorted(ids[row, :6]) == sorted(lists[row, :6])
        assert ids[row, 6:].tolist() == lists[row, 6:].tolist()
        assert np.isfinite(scores[row, :6]).all() and np.isnan(scores[row, 6:]).all()
        order, expected = rerank_candidates(queries[row], gallery[lists[row, :6]], config)
        assert ids[row, :6].tolist() == lists[row, :6][order].tolist()
        np.testing.assert_allclose(scores[row, :6], expected[order])


def test_rerank_lists_asks_for_each_vector_once():
    gallery = unit_rows(20, 4, 16)
    asked = []
    lists = np.array([[3, 5, 7], [5, 3, -1]])

    def vectors(wanted):
        asked.append(wanted.tolist())
        return gallery[wanted]

    rerank_lists(unit_rows(2, 4, 17), lists, vectors, RerankConfig(method="qe", k=2))
    assert asked == [[3, 5, 7]]


# --- the declared bounds -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("values,message", [
    ({"method": "nope"}, "--rerank must be one of none, qe, dba, kreciprocal, got 'nope'"),
    ({"candidates": MAX_CANDIDATES + 1}, f"--rerank-candidates must be in [1, {MAX_CANDIDATES}] results"),
    ({"candidates": 0}, "--rerank-candidates must be in [1, 1000] results, got 0"),
    ({"k": 0}, "--rerank-k must be in [1, 100], got 0"),
    ({"alpha": -1.0}, "--rerank-alpha must be in [0, 10], got -1.0"),
    ({"alpha": float("nan")}, "--rerank-alpha must be in [0, 10], got nan"),
    ({"lambda_value": 1.5}, "--rerank-lambda must be in [0, 1], got 1.5"),
])
def test_out_of_bounds_parameters_are_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError) as caught:
        RerankConfig(**values)
    assert message in str(caught.value)


def test_the_choices_are_the_registry():
    assert method_names() == ["none", "qe", "dba", "kreciprocal"]
    assert not RerankConfig().active and RerankConfig(method="dba").params() == {"candidates": 100, "k": 10,
                                                                                 "alpha": 3.0}


@pytest.mark.parametrize("value,expected", [
    ("none", RerankConfig()), ({"method": "none", "k": 3}, RerankConfig(k=3)), ("qe", RerankConfig(method="qe")),
    ({"method": "kreciprocal", "k1": 10.0, "k2": 3, "lambda_value": 0.5},
     RerankConfig(method="kreciprocal", k1=10, k2=3, lambda_value=0.5)),
])
def test_the_api_form(value, expected):
    assert rerank_from_json(value) == expected


@pytest.mark.parametrize("value,message", [
    ("sift", '"rerank.method" must be one of none, qe, dba, kreciprocal'),
    ({"method": "qe", "k": 10**9}, '"rerank.k" must be in [1, 100], got 1000000000'),
    ({"method": "qe", "k": True}, '"rerank.k" must be a whole number, got True'),
    ({"method": "qe", "depth": 3}, "unknown keys 'depth'; its keys are method, candidates, k"),
    ({"k": 3}, '"rerank" needs "method"'),
    (["qe"], '"rerank" must be a method name'),
    (None, '"rerank" must be a method name'),
    ({"method": "qe", "candidates": 5000}, '"rerank.candidates" must be in [1, 1000] results'),
    ({"method": "x" * 100_000}, "… (cut)"),
])
def test_the_api_form_names_the_key_at_fault(value, message):
    with pytest.raises(ValueError) as caught:
        rerank_from_json(value)
    assert message in str(caught.value) and len(str(caught.value)) < 400


# --- evaluation reads the same re-ranked lists --------------------------------------------------------------------
def metrics_by_hand(lists: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Recall@1 and MAP@R of full leave-one-out lists, query by query."""
    hits, precisions = [], []
    for row, ranked in enumerate(lists):
        relevant = [labels[j] == labels[row] for j in ranked]
        r = int(sum(labels == labels[row])) - 1
        hits.append(float(relevant[0]))
        found, total = 0, 0.0
        for position, good in enumerate(relevant[:r], 1):
            found += good
            total += found / position if good else 0.0
        precisions.append(total / r)
    return {"recall@1": float(np.mean(hits)), "map@r": float(np.mean(precisions))}


@pytest.mark.parametrize("method", list(RERANKERS))
def test_reranked_metrics_are_the_metrics_of_the_re_ranked_lists(method):
    pytest.importorskip("torch")
    from retrieval.metrics.evaluation import reranked_metrics

    embeddings = clustered(60, 8, 18, clusters=5)
    labels = np.random.default_rng(19).integers(0, 5, 60)
    config = RerankConfig(method=method, candidates=15, k=3, k1=6, k2=2)
    scores = embeddings @ embeddings.T
    np.fill_diagonal(scores, -np.inf)
    lists = np.argsort(-scores, axis=1, kind="stable")[:, :59]
    reranked, _ = rerank_lists(embeddings, lists, lambda wanted: embeddings[wanted], config)
    block = reranked_metrics(embeddings, labels, None, None, config, ks=(1,))
    expected = metrics_by_hand(reranked, labels)
    assert block["method"] == method and block["params"]["candidates"] == 15
    assert block["metrics"]["recall@1"] == pytest.approx(expected["recall@1"])
    assert block["metrics"]["map@r"] == pytest.approx(expected["map@r"])


# --- what one query costs ----------------------------------------------------------------------------------------
def measured_peak(config: RerankConfig, dim: int) -> int:
    """The most bytes NumPy held at once while ``rerank_candidates`` re-ranked a shortlist of ``config.candidates``
    vectors of ``dim`` (the shortlist's own vectors included, as ``peak_bytes`` counts them)."""
    query, candidates = unit_rows(1, dim, 40)[0], clustered(config.candidates, dim, 41)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        rerank_candidates(query, candidates, config)
        return tracemalloc.get_traced_memory()[1] - before + candidates.nbytes
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("method", list(RERANKERS))
@pytest.mark.parametrize("candidates,dim,neighbours", [(100, 64, 6), (100, 64, 100), (1000, 64, 100),
                                                       (1000, 512, 20), (300, 2048, 100)])
def test_a_query_holds_no_more_memory_than_its_stated_bound(method, candidates, dim, neighbours):
    config = RerankConfig(method=method, candidates=candidates, k=min(neighbours, 100), k1=neighbours, k2=6)
    measured = measured_peak(config, dim)
    assert measured <= peak_bytes(config, dim), (measured, peak_bytes(config, dim))
    assert peak_bytes(config, dim) <= 3 * measured + 2**20  # a bound, not a guess far above what is held


def test_dba_sums_the_neighbours_without_a_candidates_by_neighbours_by_dimension_array():
    """At 1,000 candidates, k = 100, d = 512 an [m, k, d] float32 array is 205 MB; the shortlist is 2 MB."""
    config = RerankConfig(method="dba", candidates=1000, k=100)
    assert measured_peak(config, 512) < 40 * 2**20


def test_k_reciprocal_expansion_in_blocks_gives_the_same_distances(monkeypatch):
    query, candidates = unit_rows(1, 16, 42)[0], clustered(120, 16, 43)
    whole = k_reciprocal_distances(query, candidates, 30, 6, 0.3)
    monkeypatch.setattr(methods, "PAIR_BLOCK", 7)
    np.testing.assert_array_equal(k_reciprocal_distances(query, candidates, 30, 6, 0.3), whole)


def test_work_units_follow_the_methods_cost():
    default, cap = RerankConfig(method="kreciprocal"), RerankConfig(method="kreciprocal", candidates=1000, k1=100)
    assert work_units(RerankConfig(), 512) == 0 and work_units(RerankConfig(method="qe"), 512) == 1
    assert work_units(default, 512) == 1  # a default shortlist costs as a search does
    # n^2 d / 100 + n^2 (k2 + 40) + 7 n (k1 + 1)(h + 1) ns at n = 1,001, d = 512, k1 = 100 (h = 50), k2 = 6, in ms
    assert work_units(cap, 512) == math.ceil((1001**2 * 512 / 100 + 1001**2 * 46 + 7 * 1001 * 101 * 51) / 1e6) == 88
    assert work_units(cap, 512) < work_units(cap, 2048) < 1.5 * work_units(cap, 512)  # the sets, not the Gram, dominate
    assert work_units(RerankConfig(method="dba", candidates=1000), 512) > 10 * work_units(
        RerankConfig(method="qe", candidates=1000), 512)


def test_a_re_ranking_over_its_memory_bound_is_refused_before_any_vector_is_read():
    config = RerankConfig(method="qe", candidates=1000)
    dim = 65_536  # 1,000 candidates of 65,536 floats: 262 MB before the method starts
    assert peak_bytes(config, dim) > MAX_QUERY_BYTES
    asked = []
    with pytest.raises(RerankTooLarge, match=r"ask for at most (\d+) candidates") as refused:
        rerank_lists(np.ones((1, dim), np.float32), np.arange(1000)[None], lambda ids: asked.append(ids), config)
    assert asked == []
    fits = int(refused.value.args[0].split("ask for at most ")[1].split()[0])
    assert peak_bytes(RerankConfig(method="qe", candidates=fits), dim) <= MAX_QUERY_BYTES
    assert peak_bytes(RerankConfig(method="qe", candidates=fits + 1), dim) > MAX_QUERY_BYTES


def test_rerank_lists_stops_between_queries_once_cancelled():
    gallery = unit_rows(30, 8, 44)
    lists = np.tile(np.arange(10), (5, 1))
    done = []
    real = shortlists.rerank_candidates

    def counted(*args):
        done.append(1)
        return real(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shortlists, "rerank_candidates", counted)
        with pytest.raises(Cancelled):
            rerank_lists(unit_rows(5, 8, 45), lists, lambda ids: gallery[ids], RerankConfig(method="qe"),
                         cancelled=lambda: len(done) >= 2)
    assert len(done) == 2


def test_a_batch_reads_its_vectors_in_blocks_and_answers_as_in_one(monkeypatch):
    gallery, queries = clustered(60, 8, 46), clustered(7, 8, 47)
    lists = np.argsort(-(queries @ gallery.T), axis=1)[:, :10]
    config = RerankConfig(method="kreciprocal", candidates=10, k1=4, k2=2)
    whole = rerank_lists(queries, lists, lambda ids: gallery[ids], config)
    asked = []
    monkeypatch.setattr(shortlists, "VECTOR_BLOCK_BYTES", 3 * 10 * 8 * 4)  # three queries' shortlists a block

    def vectors(ids):
        asked.append(len(ids))
        return gallery[ids]

    blocked = rerank_lists(queries, lists, vectors, config)
    assert len(asked) == 3 and max(asked) <= 30
    np.testing.assert_array_equal(blocked[0], whole[0])
    np.testing.assert_array_equal(blocked[1], whole[1])
