"""Label noise: seeded, statistically right rates, flips only to other classes / along transitions."""

from __future__ import annotations

import json

import numpy as np
import pytest

from retrieval.data import FASHION_MNIST_ASYMMETRIC, inject_label_noise
from retrieval.data.builtin import FASHION_MNIST_CLASSES


def test_symmetric_rate_and_uniform_other_class():
    clean = np.random.default_rng(0).integers(0, 10, size=50_000)
    noisy, info = inject_label_noise(clean, "symmetric", 0.4, num_classes=10, seed=3)
    flipped = noisy != clean
    # Binomial(50000, 0.4): std of the rate is 0.0022; 5 sigma tolerance.
    assert abs(flipped.mean() - 0.4) < 0.011
    assert info["flipped"] == int(flipped.sum()) and info["actual_rate"] == pytest.approx(flipped.mean())
    # Among flipped labels of class 0, the 9 other classes are equally likely and 0 never appears.
    targets = np.bincount(noisy[flipped & (clean == 0)], minlength=10)
    assert targets[0] == 0
    expected = targets.sum() / 9
    chi2 = (((targets[1:] - expected) ** 2) / expected).sum()
    assert chi2 < 27.9  # chi-square, 8 dof, p = 0.0005
    assert np.array_equal(clean, np.random.default_rng(0).integers(0, 10, size=50_000))  # input untouched
    assert noisy.dtype == np.int64


def test_seeded_and_json_able():
    clean = np.arange(1000) % 7
    a, info_a = inject_label_noise(clean, "symmetric", 0.2, seed=5)
    b, _ = inject_label_noise(clean, "symmetric", 0.2, seed=5)
    c, _ = inject_label_noise(clean, "symmetric", 0.2, seed=6)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert json.loads(json.dumps(info_a))["num_classes"] == 7
    assert info_a["mode"] == "symmetric" and info_a["seed"] == 5 and info_a["rate"] == 0.2


def test_rate_zero_and_one():
    clean = np.arange(300) % 3
    assert np.array_equal(inject_label_noise(clean, "symmetric", 0.0)[0], clean)
    assert (inject_label_noise(clean, "symmetric", 1.0)[0] != clean).all()


def test_asymmetric_follows_transitions_only():
    clean = np.repeat(np.arange(10), 5000)
    noisy, info = inject_label_noise(clean, "asymmetric", 0.3, transitions=FASHION_MNIST_ASYMMETRIC, seed=1)
    changed = noisy != clean
    for src in range(10):
        moved = noisy[(clean == src) & changed]
        if src in FASHION_MNIST_ASYMMETRIC:
            assert (moved == FASHION_MNIST_ASYMMETRIC[src]).all()
            assert abs(len(moved) / 5000 - 0.3) < 0.035  # 5 sigma of Binomial(5000, 0.3)
        else:
            assert len(moved) == 0
    assert info["actual_rate_among_eligible"] == pytest.approx(changed.sum() / 20000)
    assert info["actual_rate"] == pytest.approx(changed.mean())
    assert info["transitions"] == [[0, 6], [2, 4], [6, 0], [7, 5]]
    json.dumps(info)


def test_fashion_mnist_transition_names():
    named = {FASHION_MNIST_CLASSES[s]: FASHION_MNIST_CLASSES[t] for s, t in FASHION_MNIST_ASYMMETRIC.items()}
    assert named == {"shirt": "t-shirt", "t-shirt": "shirt", "pullover": "coat", "sneaker": "sandal"}


def test_bad_arguments():
    labels = np.array([0, 1, 2])
    with pytest.raises(ValueError, match="mode"):
        inject_label_noise(labels, "pairflip", 0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        inject_label_noise(labels, "symmetric", 1.5)
    with pytest.raises(ValueError, match="transitions="):
        inject_label_noise(labels, "asymmetric", 0.1)
    with pytest.raises(ValueError, match="outside 0..2"):
        inject_label_noise(labels, "asymmetric", 0.1, transitions={0: 5})
    with pytest.raises(ValueError, match="at least 2 classes"):
        inject_label_noise(np.zeros(4, int), "symmetric", 0.1)
    with pytest.raises(ValueError, match="num_classes=2"):
        inject_label_noise(labels, "symmetric", 0.1, num_classes=2)
