"""retrieval.metrics against slow, obvious references (full score matrix, loops over queries, float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from retrieval.metrics import evaluate, kmeans_assign, knn, linear_probe, pair_f1

# ---------------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------------


def reference_scores(query: np.ndarray, gallery: np.ndarray, metric: str) -> np.ndarray:
    """Full [n, m] matrix, higher = nearer."""
    q = query.astype(np.float64)
    g = gallery.astype(np.float64)
    if metric == "cosine":
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        g = g / np.linalg.norm(g, axis=1, keepdims=True)
        return q @ g.T
    if metric == "dot":
        return q @ g.T
    return -np.sqrt(((q[:, None, :] - g[None, :, :]) ** 2).sum(-1))


def reference_ranking(scores_row: np.ndarray, skip: int | None) -> list[int]:
    """Gallery indices by descending score, ties by ascending index, ``skip`` removed."""
    candidates = [j for j in range(len(scores_row)) if j != skip]
    return sorted(candidates, key=lambda j: (-scores_row[j], j))


def reference_retrieval(query, query_labels, gallery, gallery_labels, ks, metric) -> dict[str, float]:
    leave_one_out = gallery is None
    if leave_one_out:
        gallery, gallery_labels = query, query_labels
    scores = reference_scores(query, gallery, metric)
    recall = {k: [] for k in ks}
    average_precisions, r_precisions = [], []
    for i in range(len(query)):
        ranking = reference_ranking(scores[i], i if leave_one_out else None)
        rel = [gallery_labels[j] == query_labels[i] for j in ranking]
        r = sum(rel)
        if r == 0:  # Musgrave convention: queries without a relevant item are left out
            continue
        for k in ks:
            recall[k].append(float(any(rel[:k])))
        ap = 0.0
        for rank in range(1, r + 1):
            precision_at_rank = sum(rel[:rank]) / rank
            ap += precision_at_rank * rel[rank - 1]
        average_precisions.append(ap / r)
        r_precisions.append(sum(rel[:r]) / r)
    out = {f"recall@{k}": float(np.mean(v)) for k, v in recall.items()}
    out["map@r"] = float(np.mean(average_precisions))
    out["r_precision"] = float(np.mean(r_precisions))
    return out


def reference_pair_f1(true_labels, cluster_labels) -> float:
    tp = fp = fn = 0
    n = len(true_labels)
    for i in range(n):
        for j in range(i + 1, n):
            same_class = true_labels[i] == true_labels[j]
            same_cluster = cluster_labels[i] == cluster_labels[j]
            tp += same_class and same_cluster
            fp += same_cluster and not same_class
            fn += same_class and not same_cluster
    precision = tp / (tp + fp)
    recall = tp / (tp + fn)
    return 2 * precision * recall / (precision + recall)


def reference_nmi(true_labels, cluster_labels) -> float:
    """2 I(U; V) / (H(U) + H(V)) with explicit sums (arithmetic normalisation, sklearn's default)."""
    n = len(true_labels)
    classes, clusters = sorted(set(true_labels)), sorted(set(cluster_labels))
    count = {(a, b): 0 for a in classes for b in clusters}
    for a, b in zip(true_labels, cluster_labels, strict=True):
        count[(a, b)] += 1
    p_class = {a: sum(count[(a, b)] for b in clusters) / n for a in classes}
    p_cluster = {b: sum(count[(a, b)] for a in classes) / n for b in clusters}
    mutual = sum(
        (c / n) * math.log((c / n) / (p_class[a] * p_cluster[b])) for (a, b), c in count.items() if c > 0
    )
    h_class = -sum(p * math.log(p) for p in p_class.values())
    h_cluster = -sum(p * math.log(p) for p in p_cluster.values())
    return 2 * mutual / (h_class + h_cluster)


def skewed_labels(rng: np.random.Generator, n: int, num_classes: int) -> np.ndarray:
    """Class sizes from 1 to large, so that blocks have different depths and some classes are singletons."""
    weights = np.arange(1, num_classes + 1, dtype=np.float64) ** 2
    return rng.choice(num_classes, size=n, p=weights / weights.sum())


RETRIEVAL_KEYS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision")


def assert_matches_reference(got: dict[str, float], want: dict[str, float]) -> None:
    for key in RETRIEVAL_KEYS:
        assert got[key] == pytest.approx(want[key], abs=1e-12), key


# ---------------------------------------------------------------------------------------------------
# Retrieval metrics vs reference
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "dot"])
def test_leave_one_out_matches_reference(metric):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(160, 6))
    y = skewed_labels(rng, 160, 8)
    assert np.bincount(y, minlength=8).min() <= 2 < 40 < np.bincount(y).max()  # shallow and deep blocks
    got = evaluate(x, y, metric=metric, metrics=["recall", "map@r", "r_precision"], block_size=17)
    assert_matches_reference(got, reference_retrieval(x, y, None, None, (1, 2, 4, 8), metric))


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "dot"])
def test_separate_query_gallery_matches_reference(metric):
    rng = np.random.default_rng(2)
    query, gallery = rng.normal(size=(70, 5)), rng.normal(size=(130, 5))
    query_labels = rng.integers(0, 9, size=70)  # classes 7 and 8 never occur in the gallery
    gallery_labels = rng.integers(0, 7, size=130)
    assert np.isin(query_labels, [7, 8]).any()
    knn_metrics = ["recall", "map@r", "r_precision"]
    got = evaluate(query, query_labels, gallery, gallery_labels, metric=metric, metrics=knn_metrics)
    want = reference_retrieval(query, query_labels, gallery, gallery_labels, (1, 2, 4, 8), metric)
    assert_matches_reference(got, want)


def test_singleton_class_is_left_out_of_retrieval_metrics():
    # class 2 has one item: with leave-one-out it has R = 0 and must not count as a miss
    x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [-1.0, 0.0]])
    y = np.array([0, 0, 1, 1, 2])
    got = evaluate(x, y, ks=(1,), metrics=["recall", "map@r", "r_precision"])
    assert got == {"recall@1": 1.0, "map@r": 1.0, "r_precision": 1.0}


def test_block_size_does_not_change_results():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(120, 8)).astype(np.float32)
    y = skewed_labels(rng, 120, 6)
    knn_metrics = ["recall", "map@r", "r_precision"]  # NMI/F1 do not use the kNN blocks
    one_block = evaluate(x, y, block_size=120, metrics=knn_metrics)
    assert evaluate(x, y, block_size=7, metrics=knn_metrics) == one_block
    assert evaluate(x, y, metrics=knn_metrics) == one_block
    gallery, gallery_labels = rng.normal(size=(50, 8)), rng.integers(0, 6, size=50)
    assert evaluate(x, y, gallery, gallery_labels, block_size=7, metrics=knn_metrics) == evaluate(
        x, y, gallery, gallery_labels, block_size=1000, metrics=knn_metrics
    )


# ---------------------------------------------------------------------------------------------------
# Hand-made cases with known answers
# ---------------------------------------------------------------------------------------------------


def line_gallery(scores: list[float]) -> np.ndarray:
    """Gallery rows whose dot product with the query [1, 0] are ``scores``."""
    return np.array([[s, 0.0] for s in scores])


def test_only_relevant_item_at_rank_three():
    query, query_labels = np.array([[1.0, 0.0]]), np.array(["a"])
    gallery = line_gallery([0.9, 0.8, 0.7, 0.6, 0.5])
    gallery_labels = np.array(["b", "c", "a", "b", "c"])
    got = evaluate(query, query_labels, gallery, gallery_labels, ks=(1, 2, 3, 4), metric="dot")
    assert got["recall@1"] == 0.0 and got["recall@2"] == 0.0
    assert got["recall@3"] == 1.0 and got["recall@4"] == 1.0
    assert got["map@r"] == 0.0  # R = 1 and rank 1 is not relevant
    assert got["r_precision"] == 0.0


def test_map_at_r_by_hand():
    # R = 3; ranking a, b, a, a, b, b -> (1/3) (P(1) + P(3)) = (1/3) (1 + 2/3) = 5/9; R-precision 2/3
    query, query_labels = np.array([[1.0, 0.0]]), np.array([0])
    gallery = line_gallery([0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    gallery_labels = np.array([0, 1, 0, 0, 1, 1])
    got = evaluate(query, query_labels, gallery, gallery_labels, ks=(1, 2), metric="dot",
                   metrics=["recall", "map@r", "r_precision"])
    assert got["map@r"] == pytest.approx(5 / 9, abs=1e-12)
    assert got["r_precision"] == pytest.approx(2 / 3, abs=1e-12)
    assert got["recall@1"] == 1.0
    # identical gallery rows: all scores tie, ties go by index -> the same ranking a, b, a, a, b, b
    same_rows = np.tile([[2.0, 0.0]], (6, 1))
    got_cos = evaluate(query, query_labels, same_rows, gallery_labels, ks=(1,), metrics=["map@r"])
    assert got_cos["map@r"] == pytest.approx(5 / 9, abs=1e-12)


def test_perfect_clustering_gives_one_everywhere():
    rng = np.random.default_rng(4)
    centers = np.eye(5, 16) * 10.0
    y = np.repeat(np.arange(5), 12)
    x = centers[y] + 0.01 * rng.normal(size=(60, 16))
    got = evaluate(x, y)
    assert set(got) == {"recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision", "nmi", "f1"}
    for key, value in got.items():
        assert value == pytest.approx(1.0, abs=1e-12), key


def test_random_embeddings_score_near_chance():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(400, 32))
    y = rng.integers(0, 10, size=400)
    got = evaluate(x, y)
    assert got["recall@1"] < 0.25 and got["map@r"] < 0.1 and got["nmi"] < 0.1 and got["f1"] < 0.2


def test_exact_duplicates_are_excluded_by_index_not_by_distance():
    # rows 0 and 1 are the same vector; each must find the other at rank 1
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, 0.1], [-1.0, -0.1]])
    y = np.array([0, 0, 1, 1, 2, 2])
    got = evaluate(x, y, ks=(1,), metrics=["recall", "map@r"])
    assert got == {"recall@1": 1.0, "map@r": 1.0}
    _, indices = knn(x, k=1, exclude_self=True)
    assert indices[:4, 0].tolist() == [1, 0, 3, 2]
    # a duplicate of another class sits at the same point: ties go to the lower index
    x_dup = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    _, indices = knn(x_dup, k=3, exclude_self=True)
    assert indices[0].tolist() == [1, 2, 3] and indices[2].tolist() == [0, 1, 3]


def test_ties_are_ordered_by_gallery_index():
    gallery = np.ones((9, 3))
    _, indices = knn(np.ones((2, 3)), gallery, k=9, block_size=1)
    assert indices.tolist() == [list(range(9))] * 2
    # a tie straddling the k-th position: the lower indices make the cut, whatever topk picks
    _, indices = knn(np.ones((1, 3)), gallery, k=3)
    assert indices.tolist() == [[0, 1, 2]]
    scores, indices = knn(np.array([[1.0, 0.0]]), line_gallery([0.5, 1.0, 0.5, 0.5, 1.0]), k=3, metric="dot")
    assert indices.tolist() == [[1, 4, 0]] and scores.tolist() == [[1.0, 1.0, 0.5]]


# ---------------------------------------------------------------------------------------------------
# Input types
# ---------------------------------------------------------------------------------------------------


def test_string_labels_equal_integer_labels():
    rng = np.random.default_rng(6)
    x = rng.normal(size=(90, 4))
    y = rng.integers(0, 5, size=90)
    names = np.array(["cat", "dog", "emu", "fox", "gnu"])[y]
    assert evaluate(x, names) == evaluate(x, y)
    g, gy = rng.normal(size=(40, 4)), rng.integers(0, 5, size=40)
    as_list = [str(v) for v in np.array(["cat", "dog", "emu", "fox", "gnu"])[gy]]
    assert evaluate(x, names, g, as_list) == evaluate(x, y, g, gy)


def test_torch_inputs_equal_numpy_inputs():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(80, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=80)
    from_torch = evaluate(torch.from_numpy(x).requires_grad_(), torch.from_numpy(y))
    assert from_torch == evaluate(x, y)
    scores_t, indices_t = knn(torch.from_numpy(x), k=5, exclude_self=True)
    scores_n, indices_n = knn(x, k=5, exclude_self=True)
    assert np.array_equal(indices_t, indices_n) and np.array_equal(scores_t, scores_n)


def test_float32_close_to_float64():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(100, 16))
    y = rng.integers(0, 5, size=100)
    got32 = evaluate(x.astype(np.float32), y, metrics=["map@r", "recall"])
    got64 = evaluate(x, y, metrics=["map@r", "recall"])
    for key in got64:
        assert got32[key] == pytest.approx(got64[key], abs=0.02)


# ---------------------------------------------------------------------------------------------------
# knn helper
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "dot"])
@pytest.mark.parametrize("exclude_self", [False, True])
def test_knn_matches_brute_force(metric, exclude_self):
    rng = np.random.default_rng(9)
    query = rng.normal(size=(45, 7))
    gallery = None if exclude_self else rng.normal(size=(60, 7))
    scores, indices = knn(query, gallery, k=6, exclude_self=exclude_self, metric=metric, block_size=4)
    full = reference_scores(query, query if gallery is None else gallery, metric)
    for i in range(len(query)):
        ranking = reference_ranking(full[i], i if exclude_self else None)[:6]
        assert indices[i].tolist() == ranking
        expected = full[i, ranking]
        expected = -expected if metric == "euclidean" else expected  # distances, ascending
        np.testing.assert_allclose(scores[i], expected, rtol=1e-9, atol=1e-9)
    assert scores.shape == indices.shape == (45, 6) and indices.dtype == np.int64


# ---------------------------------------------------------------------------------------------------
# Clustering metrics
# ---------------------------------------------------------------------------------------------------


def test_pair_f1_matches_pair_loop():
    rng = np.random.default_rng(10)
    for _ in range(5):
        true = rng.integers(0, 6, size=70)
        clusters = rng.integers(0, 5, size=70)
        assert pair_f1(true, clusters) == pytest.approx(reference_pair_f1(true, clusters), abs=1e-12)
    clusters = np.array([1, 1, 2, 2, 2, 0])
    true = np.array(["x", "x", "x", "y", "y", "z"])
    # pairs: same cluster {01, 23, 24, 34}; same class {01, 02, 12, 34}; both {01, 34}: P = R = 1/2
    assert pair_f1(true, clusters) == pytest.approx(0.5)


def reference_pair_f1_counts(true_labels, cluster_labels) -> float:
    """The pair loop with pair_f1's rules for 0/0: both sides all singletons -> 1, one empty side -> 0."""
    tp = same_class = same_cluster = 0
    n = len(true_labels)
    for i in range(n):
        for j in range(i + 1, n):
            a, b = true_labels[i] == true_labels[j], cluster_labels[i] == cluster_labels[j]
            tp, same_class, same_cluster = tp + (a and b), same_class + a, same_cluster + b
    if same_class == 0 and same_cluster == 0:
        return 1.0
    precision = tp / same_cluster if same_cluster else 0.0
    recall = tp / same_class if same_class else 0.0
    return 0.0 if precision + recall == 0 else 2 * precision * recall / (precision + recall)


def contingency_pair_f1(true_labels, cluster_labels) -> float:
    """pair_f1 as it was before scikit-learn's pair_confusion_matrix: pair counts from a dense contingency table."""
    _, t = np.unique(true_labels, return_inverse=True)
    _, c = np.unique(cluster_labels, return_inverse=True)
    table = np.zeros((t.max() + 1, c.max() + 1), dtype=np.int64)
    np.add.at(table, (t.ravel(), c.ravel()), 1)
    pairs = lambda counts: int((counts * (counts - 1) // 2).sum())  # noqa: E731
    together, same_cluster, same_class = pairs(table), pairs(table.sum(axis=0)), pairs(table.sum(axis=1))
    if same_cluster == 0 and same_class == 0:
        return 1.0
    precision = together / same_cluster if same_cluster else 0.0
    recall = together / same_class if same_class else 0.0
    return 0.0 if precision + recall == 0 else 2.0 * precision * recall / (precision + recall)


def test_pair_f1_keeps_its_values_on_random_and_degenerate_labelings():
    rng = np.random.default_rng(12)
    cases = [(rng.integers(0, rng.integers(1, 8), size=n), rng.integers(0, rng.integers(1, 8), size=n))
             for n in rng.integers(1, 40, size=60)]
    y = rng.integers(0, 5, size=30)
    cases += [
        (y, y), (y, 7 - y),  # the clustering is the classes (renamed): F1 = 1
        (y, np.zeros(30, int)), (np.zeros(30, int), y),  # a single cluster / a single class
        (np.zeros(30, int), np.zeros(30, int)), (np.arange(30), np.arange(30)),  # one group / all singletons
        (np.arange(30), np.zeros(30, int)), (np.array([3]), np.array([9])),  # singletons vs one cluster; one item
        (np.array(["b", "a", "b", "c"]), np.array([1, 1, 0, 0])),  # string classes
    ]
    for true, clusters in cases:
        got = pair_f1(true, clusters)
        assert got == contingency_pair_f1(true, clusters)  # the same float as before, not just close
        assert got == pytest.approx(reference_pair_f1_counts(list(true), list(clusters)), abs=1e-12)


def test_pair_f1_degenerate_cases_are_finite():
    assert pair_f1([0, 1, 2], [5, 6, 7]) == 1.0  # all singletons on both sides agree
    assert pair_f1([0, 1, 2], [0, 0, 0]) == 0.0  # no same-class pairs: recall 0/0 -> 0
    assert pair_f1([0, 0, 1, 1], [3, 3, 1, 1]) == 1.0  # cluster ids need not equal class ids


def test_nmi_and_f1_use_kmeans_on_query_set():
    rng = np.random.default_rng(11)
    y = rng.integers(0, 4, size=120)
    x = np.eye(4, 8)[y] * 2.0 + 0.8 * rng.normal(size=(120, 8))  # overlapping clusters: 0 < NMI < 1
    got = evaluate(x, y, metrics=["nmi", "f1"], seed=3)
    normalised = x / np.linalg.norm(x, axis=1, keepdims=True)
    clusters = kmeans_assign(normalised, 4, seed=3)
    assert got["nmi"] == pytest.approx(reference_nmi(list(y), list(clusters)), abs=1e-9)
    assert got["f1"] == pytest.approx(reference_pair_f1(y, clusters), abs=1e-12)
    assert 0.05 < got["nmi"] < 0.99
    assert evaluate(x, y, metrics=["nmi", "f1"], seed=3) == got  # seeded: repeatable


def test_nmi_of_perfect_clustering_is_one():
    rng = np.random.default_rng(12)
    y = np.repeat(np.arange(6), 20)
    x = np.eye(6, 10)[y] * 5.0 + 0.05 * rng.normal(size=(120, 10))
    clusters = kmeans_assign(x, 6)
    assert reference_nmi(list(y), list(clusters)) == pytest.approx(1.0)
    assert evaluate(x, y, metrics=["nmi", "f1"]) == {"nmi": pytest.approx(1.0), "f1": pytest.approx(1.0)}


# ---------------------------------------------------------------------------------------------------
# Linear probe
# ---------------------------------------------------------------------------------------------------


def test_linear_probe_on_separable_data():
    rng = np.random.default_rng(13)
    centers = rng.normal(size=(3, 20)) * 4.0
    y_train, y_test = rng.integers(0, 3, size=300), rng.integers(0, 3, size=150)
    x_train = centers[y_train] + rng.normal(size=(300, 20))
    x_test = centers[y_test] + rng.normal(size=(150, 20))
    assert linear_probe(x_train, y_train, x_test, y_test) > 0.95
    # labels shuffled relative to embeddings: chance level
    assert linear_probe(x_train, rng.permutation(y_train), x_test, y_test) < 0.6


# ---------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x, y = np.random.default_rng(0).normal(size=(20, 4)), np.arange(20) % 4
    with pytest.raises(ValueError, match="NaN"):
        evaluate(np.full((20, 4), np.nan), y)
    with pytest.raises(ValueError, match="2-D"):
        evaluate(x[:, 0], y)
    with pytest.raises(ValueError, match="entries"):
        evaluate(x, y[:5])
    with pytest.raises(ValueError, match="dimension"):
        evaluate(x, y, np.zeros((5, 3)), np.zeros(5, dtype=int))
    with pytest.raises(ValueError, match="together"):
        evaluate(x, y, gallery=x)
    with pytest.raises(ValueError, match="unknown metric"):
        evaluate(x, y, metric="manhattan")
    with pytest.raises(ValueError, match="unknown metrics"):
        evaluate(x, y, metrics=["recall", "auc"])
    with pytest.raises(ValueError, match="smaller ks"):
        evaluate(x, y, ks=(1, 20))
    with pytest.raises(ValueError, match="block_size"):
        evaluate(x, y, block_size=0)
    with pytest.raises(ValueError, match="no query has a relevant"):
        evaluate(x, np.arange(20), ks=(1,))  # every class is a singleton
    with pytest.raises(ValueError, match="both be strings"):
        evaluate(x, y, x, np.array([str(v) for v in y]))
    with pytest.raises(ValueError, match="k must be"):
        knn(x, k=20, exclude_self=True)


# ---------------------------------------------------------------------------------------------------
# Device
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["cosine", "euclidean", "dot"])
def test_explicit_cpu_device_equals_the_default(metric):
    """device="cpu" (or torch.device("cpu")) is the default path itself: bit-identical lists and metrics."""
    rng = np.random.default_rng(5)
    x = np.round(rng.normal(size=(90, 6)), 1).astype(np.float32)  # rounded: exact ties among the scores
    x[10:14] = x[3]  # repeated rows
    y = skewed_labels(rng, 90, 5)
    gallery, gallery_labels = rng.normal(size=(40, 6)).astype(np.float32), rng.integers(0, 5, size=40)
    for device in ("cpu", torch.device("cpu")):
        for exclude_self in (False, True):
            want = knn(x, k=7, exclude_self=exclude_self, metric=metric)
            got = knn(x, k=7, exclude_self=exclude_self, metric=metric, device=device)
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[0], want[0])
        names = ["recall", "map@r", "r_precision"]
        assert evaluate(x, y, metric=metric, metrics=names, device=device) == evaluate(x, y, metric=metric,
                                                                                     metrics=names)
        assert evaluate(x, y, gallery, gallery_labels, metric=metric, metrics=names, block_size=7,
                        device=device) == evaluate(x, y, gallery, gallery_labels, metric=metric, metrics=names)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_cuda_device_without_a_gpu_names_the_problem_and_the_fix():
    x, y = np.random.default_rng(0).normal(size=(20, 4)), np.arange(20) % 4
    for device in ("cuda", "cuda:0", torch.device("cuda")):
        with pytest.raises(ValueError, match=r"no CUDA GPU is available.*use device='cpu'"):
            knn(x, k=3, device=device)
        with pytest.raises(ValueError, match=r"no CUDA GPU is available.*use device='cpu'"):
            evaluate(x, y, device=device)


def test_bad_device_raises_a_clear_error():
    x, y = np.random.default_rng(0).normal(size=(20, 4)), np.arange(20) % 4
    with pytest.raises(ValueError, match="device must be None, 'cpu', 'cuda' or 'cuda:N'; got 'gpu0'"):
        knn(x, k=3, device="gpu0")
    with pytest.raises(ValueError, match="'meta' is not supported.*use device='cpu'"):
        evaluate(x, y, device="meta")
