"""Cross-model evaluation (BCT's new/old/cross-model blocks) against slow loops of the metrics' definitions."""

from __future__ import annotations

import numpy as np
import pytest

from retrieval.compatibility import compatibility_metrics, compatibility_sentence
from retrieval.metrics import evaluate


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
    assert blocks["new"] == blocks["old"] == blocks["cross_model"] and blocks["compatible"]
    assert compatibility_sentence(blocks).startswith("compatible: ")


def test_an_unrelated_model_is_not_compatible():
    new, labels = _clusters(3)
    rotation, _ = np.linalg.qr(np.random.default_rng(4).standard_normal((new.shape[1],) * 2))
    old = new @ rotation  # as good on its own, but another space
    blocks = compatibility_metrics(new, old, labels)
    assert blocks["old"]["recall@1"] == pytest.approx(blocks["new"]["recall@1"])
    assert blocks["cross_model"]["recall@1"] < blocks["old"]["recall@1"] and not blocks["compatible"]
    sentence = compatibility_sentence(blocks)
    assert sentence.startswith("not compatible: ") and f"{blocks['cross_model']['recall@1']:.3f} <" in sentence


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
