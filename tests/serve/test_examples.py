"""The app's example queries follow one rule: the most typical image of each of the largest labels (nearest the
label's mean direction), largest first; spread evenly over an unlabelled gallery or an index without vectors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from retrieval.index.faiss_backend.faiss_search import NoStoredVectors
from retrieval.serve.examples import example_ids


def state(labels: list[str | None], vectors: np.ndarray, stores_vectors: bool = True) -> SimpleNamespace:
    """A served state as ``example_ids`` reads it: ids 10, 11, ... with these labels and vectors."""
    ids = list(range(10, 10 + len(labels)))

    def reconstructed(wanted):
        if not stores_vectors:
            raise NoStoredVectors("this index (IndexLSH) cannot give back the vectors of its results")
        return vectors[np.asarray(wanted) - 10]

    catalogue = SimpleNamespace(
        labelled=lambda: [(i, label) for i, label in zip(ids, labels, strict=True) if label is not None],
        sample=lambda count: [{"id": i} for i in ids[:: max(1, len(ids) // count)][:count]])
    return SimpleNamespace(catalogue=catalogue, index=SimpleNamespace(reconstructed_vectors=reconstructed))


def typical(ids: list[int], vectors: np.ndarray) -> int:
    """The reference: the id whose vector has the largest dot product with the mean, by a loop."""
    mean = [sum(vectors[i - 10][d] for i in ids) / len(ids) for d in range(vectors.shape[1])]
    scores = {i: sum(vectors[i - 10][d] * mean[d] for d in range(vectors.shape[1])) for i in ids}
    return max(ids, key=lambda i: (scores[i], -i))


def test_examples_are_the_typical_image_of_each_largest_label():
    rng = np.random.default_rng(0)
    labels = ["cat"] * 5 + ["dog"] * 7 + ["ant"] * 2 + ["bee"] * 2 + [None] * 3
    vectors = rng.normal(size=(len(labels), 8)).astype(np.float32)
    chosen = example_ids(state(labels, vectors), 3)
    members = {name: [10 + i for i, label in enumerate(labels) if label == name] for name in ("dog", "cat", "ant")}
    # largest first, a tie (ant, bee: 2 each) by name
    assert chosen == [typical(members["dog"], vectors), typical(members["cat"], vectors),
                      typical(members["ant"], vectors)]


def test_an_unlabelled_gallery_or_one_without_vectors_gets_images_spread_evenly():
    vectors = np.eye(12, dtype=np.float32)
    spread = [10, 13, 16, 19]
    assert example_ids(state([None] * 12, vectors), 4) == spread
    assert example_ids(state(["a"] * 12, vectors), 4) == spread  # one label: nothing to tell apart
    assert example_ids(state(["a", "b"] * 6, vectors, stores_vectors=False), 4) == spread
