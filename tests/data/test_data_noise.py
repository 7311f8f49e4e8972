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


# --- per data set transitions: by class name, a known table, a user's table, or a clear refusal ----------------
def test_known_tables_by_class_name():
    from retrieval.data import asymmetric_transitions
    from retrieval.data.builtin import DIGITS_CLASSES

    mapping, info = asymmetric_transitions("fashion-mnist", list(FASHION_MNIST_CLASSES))
    assert mapping == FASHION_MNIST_ASYMMETRIC  # shirt <-> t-shirt, pullover -> coat, sneaker -> sandal
    assert ["sneaker", "sandal"] in info["transitions_by_name"]
    digits, _ = asymmetric_transitions("digits", list(DIGITS_CLASSES))
    assert digits == {2: 7, 3: 8, 5: 6, 6: 5, 7: 1}  # Patrini et al. 2017's MNIST table
    # a class-disjoint half keeps only the pairs with both classes in it (re-indexed by name, not by number)
    half, info = asymmetric_transitions("fashion-mnist", ["t-shirt", "trouser", "pullover", "dress", "coat"])
    assert half == {2: 4} and info["transitions_by_name"] == [["pullover", "coat"]]


def test_unknown_dataset_is_refused_with_the_fix():
    from retrieval.data import asymmetric_transitions

    with pytest.raises(ValueError, match="table is needed.*JSON object"):
        asymmetric_transitions("folder", ["cat", "dog", "fox"])


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_transitions_file(tmp_path, suffix):
    from retrieval.data import asymmetric_transitions

    path = tmp_path / f"t{suffix}"
    path.write_text('{"cat": "fox", "dog": "wolf"}' if suffix == ".json" else "from,to\ncat,fox\ndog,wolf\n")
    mapping, info = asymmetric_transitions("folder", ["cat", "dog", "fox", "wolf"], path)
    assert mapping == {0: 2, 1: 3} and info["transitions_source"] == str(path)
    # the file wins over a known table; a name outside the split is an error naming the classes
    path.write_text('{"cat": "lion"}' if suffix == ".json" else "cat,lion\n")
    with pytest.raises(ValueError, match="not in the training split.*lion"):
        asymmetric_transitions("fashion-mnist", ["cat", "dog"], path)
    with pytest.raises(ValueError, match="no file"):
        asymmetric_transitions("folder", ["cat"], tmp_path / "missing.json")
