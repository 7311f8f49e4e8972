"""The linear probe: how well a logistic-regression classifier separates the classes of frozen embeddings.

A measure beside the retrieval metrics (as in DCDL): fitted on one labelled set of embeddings [n, d], scored as its
accuracy on another [m, d]; scikit-learn (the train extra) does the fitting, on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from retrieval.metrics.inputs import as_embeddings, as_label_array


def linear_probe(
    train_emb: Any,
    train_labels: Any,
    test_emb: Any,
    test_labels: Any,
    C: float = 1.0,
    max_iter: int = 1000,
    seed: int = 0,
) -> float:
    """Test accuracy of a logistic-regression classifier on standardised frozen embeddings (DCDL).

    ``train_emb`` [n, d] with ``train_labels`` [n] (two classes at least) fit the scaler and the classifier;
    ``test_emb`` [m, d] with ``test_labels`` [m] score it: the share of test rows it labels right, in [0, 1].
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x_train = as_embeddings(train_emb, "train_emb").numpy()
    x_test = as_embeddings(test_emb, "test_emb").numpy()
    if x_train.shape[1] != x_test.shape[1]:
        raise ValueError(f"train_emb has dimension {x_train.shape[1]} but test_emb has {x_test.shape[1]}")
    y_train = as_label_array(train_labels, len(x_train), "train_labels")
    y_test = as_label_array(test_labels, len(x_test), "test_labels")
    if len(np.unique(y_train)) < 2:
        raise ValueError("linear_probe needs at least two classes in train_labels")
    scaler = StandardScaler().fit(x_train)
    classifier = LogisticRegression(C=C, max_iter=max_iter, random_state=seed)
    classifier.fit(scaler.transform(x_train), y_train)
    return float((classifier.predict(scaler.transform(x_test)) == y_test).mean())
