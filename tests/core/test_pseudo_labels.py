"""Pseudo-labels without labels (``retrieval.pseudo_labels``): the k-reciprocal Jaccard distance against
``rerank.k_reciprocal_distances`` row by row and a hand-checked case, DBSCAN's clusters recovering planted blobs,
mutual-kNN components against a brute-force loop over pairs, the numbering rule, degenerate inputs, the summary and
stability figures by hand, and ``moved_most`` finding planted moved images with training's neighbours-kept figure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

import retrieval.pseudo_labels as pseudo_labels
from retrieval.compatibility import KEPT, KEPT_K, neighbour_overlap
from retrieval.pseudo_labels import (
    cluster_pseudo_labels,
    k_reciprocal_jaccard,
    moved_most,
    mutual_neighbour_pseudo_labels,
    pseudo_label_stability,
    pseudo_label_summary,
)
from retrieval.rerank import k_reciprocal_distances


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def blobs(seed: int, noise: int = 3, spread: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """5 gaussian blobs of 30 points in 16-d around e_b + 0.5 e_5, and ``noise`` isolated points (-e_5 + 2 e_{6+j},
    label -1), rows shuffled: (embeddings [150 + noise, 16] float32, true labels)."""
    rng = np.random.default_rng(seed)
    eye = np.eye(16)
    truth = np.concatenate([np.repeat(np.arange(5), 30), -np.ones(noise, dtype=np.int64)])
    centres = np.concatenate([eye[:5] + 0.5 * eye[5], -eye[5] + 2 * eye[6:6 + noise]])
    which = np.concatenate([np.repeat(np.arange(5), 30), 5 + np.arange(noise)])
    x = centres[which] + spread * rng.normal(size=(len(which), 16))
    order = rng.permutation(len(x))
    return x[order].astype(np.float32), truth[order]


def numbered_by_size_then_first_row(groups: list[list[int]], n: int) -> np.ndarray:
    """The documented numbering, by loops: groups sorted by (-size, first row), numbered 0.. in that order."""
    labels = np.full(n, -1, dtype=np.int64)
    for number, group in enumerate(sorted(groups, key=lambda g: (-len(g), min(g)))):
        labels[group] = number
    return labels


def slow_mutual_components(x: np.ndarray, k: int) -> np.ndarray:
    """Mutual kNN components by brute force: float64 cosine, ties by lower row, every pair checked, a DFS."""
    u = unit(x.astype(np.float64))
    n = len(u)
    nearest = [set(sorted((j for j in range(n) if j != i), key=lambda j: (-float(u[i] @ u[j]), j))[:k])
               for i in range(n)]
    links = {i: [j for j in range(n) if j != i and j in nearest[i] and i in nearest[j]] for i in range(n)}
    seen, groups = set(), []
    for start in range(n):
        if start in seen:
            continue
        stack, group = [start], []
        seen.add(start)
        while stack:
            i = stack.pop()
            group.append(i)
            for j in links[i]:
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        groups.append(group)
    return numbered_by_size_then_first_row(groups, n)


# --- the k-reciprocal Jaccard distance -------------------------------------------------------------------------
def test_jaccard_rows_equal_k_reciprocal_distances_of_each_image_against_the_others():
    x, _ = blobs(0, spread=0.4)
    x = x[:60]
    for k1, k2 in ((30, 6), (8, 3), (5, 1)):
        jaccard = k_reciprocal_jaccard(x, k1, k2)
        assert jaccard.shape == (60, 60) and jaccard.dtype == np.float32
        assert np.allclose(jaccard, jaccard.T, atol=1e-6) and np.all(np.diag(jaccard) == 0)
        u = unit(x)
        for i in range(60):
            others = np.r_[0:i, i + 1:60]
            expected = k_reciprocal_distances(u[i], u[others], k1, k2, 0.0)
            assert np.allclose(jaccard[i, others], expected, atol=1e-6), (k1, k2, i)


def test_jaccard_of_two_far_pairs_is_one_minus_one_over_e_by_hand():
    # two pairs of identical images at right angles: every image in every k-reciprocal set (k1 = 30 > N), the
    # distances normalised by the row's largest (2 -> 1), so V_0 = V_1 = (1, 1, e^-1, e^-1) / Z and V_2 = V_3 the
    # mirror; sum min = 4 e^-1 / Z, sum max = 4 / Z: d_J = 1 - 1/e across pairs, 0 within
    x = np.array([[1, 0], [1, 0], [0, 1], [0, 1]], dtype=np.float32)
    expected = np.array([[0, 0, 1, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]) * (1 - math.exp(-1))
    assert np.allclose(k_reciprocal_jaccard(x, 30, 1), expected, atol=1e-6)
    assert np.allclose(k_reciprocal_jaccard(x, 30, 2), expected, atol=1e-6)  # the 2 nearest: the twin, same V
    # DBSCAN reads exactly that distance: eps just below 1 - 1/e (0.632) splits the pairs, just above joins them
    assert cluster_pseudo_labels(x, eps=0.62, min_samples=2, k2=1).tolist() == [0, 0, 1, 1]
    assert cluster_pseudo_labels(x, eps=0.64, min_samples=2, k2=1).tolist() == [0, 0, 0, 0]


# --- DBSCAN pseudo-labels --------------------------------------------------------------------------------------
def test_cluster_labels_recover_the_blobs_and_keep_noise_as_singletons():
    x, truth = blobs(1)
    labels = cluster_pseudo_labels(x)
    assert labels.dtype == np.int64 and labels.shape == (153,)
    clustered = truth >= 0
    assert adjusted_rand_score(truth[clustered], labels[clustered]) == 1.0
    assert sorted(np.unique(labels[clustered]).tolist()) == [0, 1, 2, 3, 4]  # clusters first
    assert sorted(labels[~clustered].tolist()) == [5, 6, 7]  # each noise image its own label, after them
    assert labels[~clustered].tolist() == sorted(labels[~clustered].tolist())  # singletons in row order
    firsts = [int(np.flatnonzero(labels == c)[0]) for c in range(5)]
    assert firsts == sorted(firsts)  # equal sizes: numbered by first row
    assert np.array_equal(cluster_pseudo_labels(x), labels)  # deterministic


def test_cluster_labels_of_degenerate_sets():
    rng = np.random.default_rng(2)
    assert cluster_pseudo_labels(rng.normal(size=(1, 8))).tolist() == [0]
    two = rng.normal(size=(2, 8)).astype(np.float32)
    assert cluster_pseudo_labels(two).tolist() == [0, 1]  # fewer than min_samples: singletons
    assert cluster_pseudo_labels(two, eps=0.7, min_samples=2).tolist() == [0, 0]  # d_J = 1 - 1/e for any two
    same = np.tile(rng.normal(size=(1, 8)), (40, 1))
    assert cluster_pseudo_labels(same).tolist() == [0] * 40  # collapsed embeddings: one cluster
    assert cluster_pseudo_labels(same[:3]).tolist() == [0, 1, 2]
    assert cluster_pseudo_labels(np.zeros((5, 4))).tolist() == [0, 1, 2, 3, 4]


def test_zero_rows_are_singletons_and_leave_the_others_clusters_alone():
    x, truth = blobs(3, noise=0)
    with_zeros = np.insert(x, [10, 70], 0.0, axis=0)
    zero_rows = np.array([10, 71])
    for label in (cluster_pseudo_labels, mutual_neighbour_pseudo_labels):
        labels = label(with_zeros)
        kept = np.delete(labels, zero_rows)
        assert adjusted_rand_score(label(x), kept) == 1.0
        assert np.sum(labels == labels[10]) == 1 and np.sum(labels == labels[71]) == 1


def test_bad_embeddings_are_refused_with_what_is_wrong():
    x, _ = blobs(4, noise=0)
    nan = x.copy()
    nan[7, 3] = np.nan
    inf = x.copy()
    inf[2, 0] = np.inf
    for label in (cluster_pseudo_labels, mutual_neighbour_pseudo_labels, k_reciprocal_jaccard):
        with pytest.raises(ValueError, match="NaN or inf in 1 of 150 rows .first: row 7"):
            label(nan)
        with pytest.raises(ValueError, match="NaN or inf"):
            label(inf)
        with pytest.raises(ValueError, match="2-D"):
            label(x[0])
        with pytest.raises(ValueError, match="2-D"):
            label(np.zeros((0, 4)))
    with pytest.raises(ValueError, match="NaN or inf"):
        moved_most(x, nan)


def test_clustering_too_many_images_names_the_bound_and_the_fix(monkeypatch):
    monkeypatch.setattr(pseudo_labels, "MAX_CLUSTER_IMAGES", 100)
    x, _ = blobs(5, noise=0)
    with pytest.raises(ValueError, match=r"has 150 images.*at most 100 are clustered at once: cluster a random "
                                         r"sample.*mutual_neighbour_pseudo_labels"):
        cluster_pseudo_labels(x)
    assert len(cluster_pseudo_labels(x[:100])) == 100


# --- mutual kNN pseudo-labels ----------------------------------------------------------------------------------
def test_mutual_neighbour_components_equal_the_brute_force_loop():
    rng = np.random.default_rng(6)
    for n, k, spread in ((40, 3, 0.8), (50, 5, 0.5), (25, 1, 1.0), (12, 20, 0.8)):
        centres = rng.normal(size=(4, 6))
        x = (centres[rng.integers(0, 4, n)] + spread * rng.normal(size=(n, 6))).astype(np.float32)
        labels = mutual_neighbour_pseudo_labels(x, k)
        assert labels.dtype == np.int64
        assert np.array_equal(labels, slow_mutual_components(x, min(k, n - 1))), (n, k)
        assert np.array_equal(mutual_neighbour_pseudo_labels(x, k), labels)  # deterministic
        shuffled = rng.permutation(n)  # no ties here: the same partition in any row order
        assert adjusted_rand_score(labels[shuffled], mutual_neighbour_pseudo_labels(x[shuffled], k)) == 1.0


def test_mutual_neighbours_of_degenerate_sets():
    rng = np.random.default_rng(7)
    assert mutual_neighbour_pseudo_labels(rng.normal(size=(1, 4))).tolist() == [0]
    assert mutual_neighbour_pseudo_labels(rng.normal(size=(2, 4))).tolist() == [0, 0]
    # identical images share a label (all of them, not the first k + 1 that ties would link)
    same = np.tile(rng.normal(size=(1, 4)), (30, 1))
    assert mutual_neighbour_pseudo_labels(same).tolist() == [0] * 30
    mixed = np.concatenate([same[:9], rng.normal(size=(6, 4))])
    assert len(set(mutual_neighbour_pseudo_labels(mixed, k=2)[:9].tolist())) == 1
    assert mutual_neighbour_pseudo_labels(np.zeros((3, 4))).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="k must be at least 1"):
        mutual_neighbour_pseudo_labels(same, k=0)


# --- the summary and the stability -----------------------------------------------------------------------------
def test_summary_figures_by_hand():
    labels = np.array([3, 3, 3, 3, 3, 0, 0, 7, 7, 7, 1, 2, 9])  # sizes 5, 2, 3 and four singletons
    summary = pseudo_label_summary(labels)
    assert summary == {"images": 13, "clusters": 3, "clustered_images": 10, "clustered_share": 10 / 13,
                       "singletons": 3, "largest_cluster": 5, "largest_share": 5 / 13, "median_cluster_size": 3.0,
                       "size_histogram": [("1", 3), ("2-3", 2), ("4-7", 1)]}
    alone = pseudo_label_summary(np.arange(4))
    assert (alone["clusters"], alone["singletons"], alone["largest_cluster"], alone["largest_share"],
            alone["median_cluster_size"], alone["size_histogram"]) == (0, 4, 0, 0.0, None, [("1", 4)])
    giant = pseudo_label_summary(np.r_[np.zeros(17, dtype=int), 1, 2])
    assert giant["largest_share"] == 17 / 19 and giant["size_histogram"][-1] == ("16-31", 1)
    assert pseudo_label_summary(np.array([5_000_000_000, 5_000_000_000]))["clusters"] == 1  # any ids
    with pytest.raises(ValueError, match="negative label"):
        pseudo_label_summary(np.array([0, -1, -1]))
    with pytest.raises(ValueError, match="1-D"):
        pseudo_label_summary(np.array([]))


def test_stability_is_one_for_a_relabelled_partition_and_less_for_a_changed_one():
    labels = np.array([0, 0, 0, 1, 1, 2, 3, 3, 4])
    relabelled = np.array([7, 0, 5, 1, 6, 2, 4, 3, 8])[labels]
    assert pseudo_label_stability(labels, relabelled) == 1.0
    changed = labels.copy()
    changed[[2, 6]] = [1, 9]
    assert pseudo_label_stability(labels, changed) < 1.0
    assert pseudo_label_stability(labels, changed) == pytest.approx(adjusted_rand_score(labels, changed))
    with pytest.raises(ValueError, match="same 9 images"):
        pseudo_label_stability(labels, labels[:5])
    with pytest.raises(ValueError, match="integer labels"):
        pseudo_label_stability(labels, np.array(list("abcdefghi")))


# --- moved_most ------------------------------------------------------------------------------------------------
def test_moved_most_finds_the_planted_moves_and_its_mean_is_training_s_neighbours_kept():
    from retrieval.train.evaluating import kept_neighbours

    before, truth = blobs(8, noise=0, spread=0.2)
    rng = np.random.default_rng(8)
    after = before + 0.02 * rng.normal(size=before.shape).astype(np.float32)  # everyone jitters a little
    planted = np.array([int(np.flatnonzero(truth == blob)[0]) for blob in range(4)])  # one from each of 4 blobs
    eye = np.eye(16, dtype=np.float32)
    for row, far in zip(planted, (1.0, 2.0, 3.0, 4.0), strict=True):  # each to another blob, further each time
        other = (truth[row] + 1) % 5
        after[row] = eye[other] + 0.5 * eye[5] + 0.05 * far * eye[10 + int(far)]
    result = moved_most(before, after, count=4)
    assert result["k"] == KEPT_K
    assert set(result["rows"].tolist()) == set(planted.tolist())
    assert np.all(result["rows_overlap"] == 0.0)  # none of their old neighbours left
    assert np.all(np.diff(result["rows_cosine_change"]) <= 0)  # equal overlaps: the larger move first
    expected = neighbour_overlap(unit(before), unit(after), KEPT_K)
    assert np.allclose(result["overlap"], expected) and result["mean_overlap"] == pytest.approx(expected.mean())
    rows = np.arange(len(before))
    kept = kept_neighbours(SimpleNamespace(indices=rows, embeddings=before),
                           SimpleNamespace(indices=rows, embeddings=after))
    assert result["mean_overlap"] == pytest.approx(kept[KEPT], abs=1e-12)
    # the order, by a loop: lowest overlap, then larger cosine change, then row
    change = 1 - np.sum(unit(before.astype(np.float64)) * unit(after.astype(np.float64)), axis=1)
    by_hand = sorted(rows, key=lambda i: (result["overlap"][i], -round(change[i], 9), i))[:12]
    assert moved_most(before, after)["rows"].tolist() == [int(i) for i in by_hand]


def test_moved_most_on_small_sets_and_other_sizes():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    result = moved_most(x, x)
    assert result["k"] == 4 and np.all(result["overlap"] == 1.0) and result["mean_overlap"] == 1.0
    assert result["rows"].tolist() == [0, 1, 2, 3, 4]  # nothing moved: by row
    wider = moved_most(x, rng.normal(size=(5, 6)), k=2, count=3)  # another embedding size: no cosine change
    assert wider["k"] == 2 and len(wider["rows"]) == 3 and np.all(np.isnan(wider["rows_cosine_change"]))
    with pytest.raises(ValueError, match="same 5 images"):
        moved_most(x, x[:4])
    with pytest.raises(ValueError, match="at least 2 images"):
        moved_most(x[:1], x[:1])
