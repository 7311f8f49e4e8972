"""Cross-model evaluation (BCT's new/old/cross-model blocks) against slow loops of the metrics' definitions."""

from __future__ import annotations

import numpy as np
import pytest

import retrieval.compatibility as compatibility
from retrieval.compatibility import (
    COMPATIBLE,
    MIN_QUERIES,
    NOT_COMPATIBLE,
    TOO_FEW,
    bootstrap_means,
    compatibility_metrics,
    compatibility_sentence,
    compatibility_verdict,
)
from retrieval.metrics import evaluate, mean_metrics, per_query_metrics


def _clusters(seed: int, n_classes: int = 6, per_class: int = 5, dim: int = 8, spread: float = 0.6):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_classes, dim))
    labels = np.repeat(np.arange(n_classes), per_class)
    return centres[labels] + spread * rng.standard_normal((len(labels), dim)), labels


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _slow_cross_model(query: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """Recall@1 and MAP@R of query i against gallery rows j != i, by loops over the definitions (float64)."""
    q, g = _unit(query.astype(np.float64)), _unit(gallery.astype(np.float64))
    hits, precisions = [], []
    for i in range(len(q)):
        others = [j for j in range(len(g)) if j != i]
        order = sorted(others, key=lambda j: (-float(q[i] @ g[j]), j))  # ties by gallery index
        relevant = [labels[j] == labels[i] for j in order]
        r = sum(labels[j] == labels[i] for j in others)
        if r == 0:  # nothing to find: left out
            continue
        hits.append(float(relevant[0]))
        found, total = 0, 0.0
        for rank, is_relevant in enumerate(relevant[:r], 1):
            if is_relevant:
                found += 1
                total += found / rank
        precisions.append(total / r)
    return {"recall@1": float(np.mean(hits)), "map@r": float(np.mean(precisions))}


def test_cross_model_leave_one_out_equals_the_loop_and_leaves_out_the_query_own_old_embedding():
    new, labels = _clusters(0)
    old = new + 0.5 * np.random.default_rng(1).standard_normal(new.shape)
    fast = evaluate(new, labels, old, labels, ks=(1,), metrics=["recall", "map@r"], same_items=True)
    slow = _slow_cross_model(new, old, labels)
    assert fast["recall@1"] == pytest.approx(slow["recall@1"], abs=1e-12)
    assert fast["map@r"] == pytest.approx(slow["map@r"], abs=1e-9)
    # without leaving it out, the query's own old embedding (nearly the same vector) is the top hit
    kept = evaluate(new, labels, old, labels, ks=(1,), metrics=["recall"])
    assert kept["recall@1"] >= fast["recall@1"]


def test_a_model_is_compatible_with_itself_and_all_three_blocks_agree():
    embeddings, labels = _clusters(2)
    blocks = compatibility_metrics(embeddings, embeddings, labels)
    assert blocks["new"] == blocks["old"] == blocks["cross_model"] and blocks["verdict"] == COMPATIBLE
    # the same queries in every resample: the difference is exactly zero, not an interval around it
    assert blocks["interval"]["difference"] == {"recall@1": [0.0, 0.0], "map@r": [0.0, 0.0]}
    assert compatibility_sentence(blocks).startswith("compatible: ")


def test_an_unrelated_model_is_not_compatible():
    new, labels = _clusters(3, per_class=8)
    rotation, _ = np.linalg.qr(np.random.default_rng(4).standard_normal((new.shape[1],) * 2))
    old = new @ rotation  # as good on its own, but another space
    blocks = compatibility_metrics(new, old, labels)
    assert blocks["old"]["recall@1"] == pytest.approx(blocks["new"]["recall@1"])
    assert blocks["cross_model"]["recall@1"] < blocks["old"]["recall@1"] and blocks["verdict"] == NOT_COMPATIBLE
    sentence = compatibility_sentence(blocks)
    low, high = blocks["interval"]["difference"]["recall@1"]
    assert sentence.startswith("not compatible: ") and f"on {len(labels)} queries" in sentence
    assert f"{blocks['cross_model']['recall@1']:.3f} vs {blocks['old']['recall@1']:.3f}" in sentence
    assert f"95% interval {low:+.3f} to {high:+.3f}" in sentence and high < 0


def test_a_separate_gallery_is_searched_by_new_queries_in_the_old_gallery():
    query, labels = _clusters(5)
    gallery, gallery_labels = _clusters(5, spread=0.7)
    old_gallery = gallery + 0.1
    blocks = compatibility_metrics(query, query, labels, gallery, old_gallery, gallery_labels)
    assert blocks["cross_model"] == evaluate(query, labels, old_gallery, gallery_labels, ks=(1, 2, 4, 8),
                                             metrics=["recall", "map@r", "r_precision"])


def test_same_items_refuses_a_gallery_of_other_images():
    embeddings, labels = _clusters(6)
    with pytest.raises(ValueError, match="same_items needs the gallery to be the query set's images"):
        evaluate(embeddings, labels, embeddings[:-1], labels[:-1], same_items=True)


def _slow_bootstrap(columns: list[np.ndarray], resamples: int, seed: int) -> np.ndarray:
    """Each resample's mean of each column, one resample and one query at a time (the same generator's draws)."""
    rng = np.random.default_rng(seed)
    n = len(columns[0])
    out = []
    for _ in range(resamples):
        drawn = rng.integers(0, n, size=n)
        out.append([sum(float(column[i]) for i in drawn) / n for column in columns])
    return np.asarray(out)


def _slow_percentile(values: np.ndarray, share: float) -> float:
    """The percentile by sorting and interpolating between the two nearest ranks (NumPy's default 'linear')."""
    ordered = sorted(float(v) for v in values)
    position = share * (len(ordered) - 1)
    below = int(np.floor(position))
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


@pytest.mark.parametrize("chunk", [1, 64, 2**22])  # one resample per draw, a few, all at once
def test_bootstrap_means_equal_a_loop_over_resamples(monkeypatch, chunk):
    rng = np.random.default_rng(7)
    values = np.stack([rng.random(23), rng.integers(0, 2, 23), rng.normal(size=23)], axis=1)
    monkeypatch.setattr(compatibility, "RESAMPLE_CHUNK", chunk)
    fast = bootstrap_means(values, resamples=40, seed=3)
    slow = _slow_bootstrap([values[:, 0], values[:, 1], values[:, 2]], resamples=40, seed=3)
    np.testing.assert_allclose(fast, slow, rtol=0, atol=1e-12)


def _per_query(seed: int, n: int, shift: float) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-query recall@1 and MAP@R of an old model near 0.38, and of the cross-model retrieval whose mean differs
    by exactly ``shift`` (noise of a real query set around it); NaN for two queries with nothing to find."""
    rng = np.random.default_rng(seed)
    old_map = rng.beta(2.0, 3.2, n)
    noise = rng.normal(0.0, 0.08, n)
    old = {"recall@1": (rng.random(n) < 0.5).astype(float), "map@r": old_map}
    cross = {"recall@1": old["recall@1"].copy(), "map@r": old_map + noise - noise[2:].mean() + shift}
    flips = rng.choice(n, 6, replace=False)  # three queries gain their top hit, three lose it
    cross["recall@1"][flips[:3]], cross["recall@1"][flips[3:]] = 1.0, 0.0
    old["recall@1"][flips[:3]], old["recall@1"][flips[3:]] = 0.0, 1.0
    for series in (old, cross):
        for values in series.values():
            values[[0, 1]] = np.nan
    return cross, old


def _slow_verdict(cross: dict[str, np.ndarray], old: dict[str, np.ndarray], resamples: int, seed: int) -> tuple:
    """The intervals and verdict by loops: resample the measured queries, take each mean, read the percentiles."""
    kept = [i for i in range(len(old["map@r"])) if not np.isnan(old["map@r"][i])]
    columns = [np.asarray([series[name][i] for i in kept]) for name in ("recall@1", "map@r") for series in (cross, old)]
    means = _slow_bootstrap(columns, resamples, seed)
    intervals = {}
    for i, name in enumerate(("recall@1", "map@r")):
        difference = [row[2 * i] - row[2 * i + 1] for row in means]
        intervals[name] = [_slow_percentile(difference, 0.025), _slow_percentile(difference, 0.975)]
    if len(kept) < MIN_QUERIES:
        verdict = TOO_FEW
    elif any(high < 0 for _, high in intervals.values()):
        verdict = NOT_COMPATIBLE
    elif all(low >= 0 for low, _ in intervals.values()):
        verdict = COMPATIBLE
    else:
        verdict = TOO_FEW
    return intervals, verdict, len(kept)


@pytest.mark.parametrize("shift", [-0.2, -0.001, 0.001, 0.2])
def test_the_verdict_and_its_interval_equal_the_loop(shift):
    cross, old = _per_query(11, 80, shift)
    fast = compatibility_verdict(cross, old, resamples=200, seed=5)
    intervals, verdict, queries = _slow_verdict(cross, old, resamples=200, seed=5)
    assert fast["verdict"] == verdict and fast["interval"]["queries"] == queries == 78
    for name, (low, high) in intervals.items():
        assert fast["interval"]["difference"][name] == pytest.approx([low, high], abs=1e-12)


@pytest.mark.parametrize("shift", [0.001, -0.001])
def test_a_difference_of_0_001_on_99_queries_is_too_few_queries_to_tell(shift):
    # before: map@r 0.380 vs 0.379 said "compatible" in one place and 0.378 vs 0.379 "not compatible" in another
    cross, old = _per_query(1, 101, shift)
    blocks = {"cross_model": mean_metrics(cross), "old": mean_metrics(old), **compatibility_verdict(cross, old)}
    assert blocks["interval"]["queries"] == 99
    assert blocks["cross_model"]["map@r"] - blocks["old"]["map@r"] == pytest.approx(shift)
    assert blocks["verdict"] == TOO_FEW
    low, high = blocks["interval"]["difference"]["map@r"]
    assert low < 0 < high
    assert compatibility_sentence(blocks).startswith("too few queries to tell: ")


@pytest.mark.parametrize(("shift", "expected"), [(0.1, COMPATIBLE), (-0.1, NOT_COMPATIBLE)])
def test_a_clear_difference_is_a_verdict(shift, expected):
    cross, old = _per_query(2, 300, shift)
    cross["recall@1"] = np.where(np.isnan(old["recall@1"]), np.nan, 1.0 if shift > 0 else 0.0)
    assert compatibility_verdict(cross, old)["verdict"] == expected


def test_under_min_queries_there_is_no_verdict_however_clear():
    cross, old = _per_query(3, MIN_QUERIES + 1, 0.3)  # two of them have nothing to find: MIN_QUERIES - 1 measured
    cross["recall@1"] = np.where(np.isnan(old["recall@1"]), np.nan, 1.0)
    blocks = {"cross_model": mean_metrics(cross), "old": mean_metrics(old), **compatibility_verdict(cross, old)}
    assert blocks["verdict"] == TOO_FEW and blocks["interval"]["difference"]["map@r"][0] > 0
    assert f"fewer than {MIN_QUERIES} queries" in compatibility_sentence(blocks)


def test_the_verdict_refuses_two_sets_of_queries():
    cross, old = _per_query(4, 40, 0.0)
    cross["map@r"][5] = np.nan  # a query the old/old retrieval measured and the cross-model one did not
    with pytest.raises(ValueError, match="same queries"):
        compatibility_verdict(cross, old)


def test_per_query_metrics_average_to_evaluate_and_leave_out_queries_with_nothing_to_find():
    embeddings, labels = _clusters(6)
    labels = labels.copy()
    labels[0] = 99  # a class of one: nothing to find
    per_query = per_query_metrics(embeddings, labels, ks=(1, 2), metrics=["recall", "map@r"])
    assert set(per_query) == {"recall@1", "recall@2", "map@r"}
    assert all(np.isnan(values[0]) and not np.isnan(values[1:]).any() for values in per_query.values())
    assert mean_metrics(per_query) == evaluate(embeddings, labels, ks=(1, 2), metrics=["recall", "map@r"])
    slow = _slow_cross_model(embeddings, embeddings, labels)
    assert float(np.nanmean(per_query["map@r"])) == pytest.approx(slow["map@r"], abs=1e-9)
    with pytest.raises(ValueError, match="per-query values"):
        per_query_metrics(embeddings, labels, metrics=["nmi"])


def test_an_old_report_without_an_interval_gets_no_verdict():
    old_report = {"new": {"recall@1": 0.5, "map@r": 0.4}, "old": {"recall@1": 0.5, "map@r": 0.379},
                  "cross_model": {"recall@1": 0.5, "map@r": 0.380}, "compatible": True}
    assert compatibility_sentence(old_report).startswith("no verdict: ")
