"""A folder (or manifest) without a split of its own, split by protocol: class-disjoint halves, or every class in
training with a seeded share of each class's images held out for test."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retrieval.data import load_dataset
from retrieval.data.dataset import held_out_per_class


def catalogue(root: Path, sizes: dict[str, int]) -> Path:
    """``sizes[name]`` tiny PNGs in each class folder."""
    for name, count in sizes.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            Image.new("RGB", (6 + i % 3, 5), (i * 10 % 255, 40, 90)).save(root / name / f"{i:03d}.png")
    return root


def by_class(dataset) -> Counter:
    return Counter(dataset.class_names[label] for label in dataset.labels)


def test_standard_trains_every_class_and_holds_out_a_seeded_share_of_each_classes_images(tmp_path):
    root = catalogue(tmp_path / "shop", {"bags": 10, "cups": 20, "hats": 5, "solo": 1, "pair": 2})
    train = load_dataset("folder", root, "train", protocol="standard")
    test = load_dataset("folder", root, "test", protocol="standard")
    assert set(by_class(train)) == {"bags", "cups", "hats", "solo", "pair"}
    # 20 % of each class, 2 at least, none from a class too small to keep one for training
    assert by_class(test) == {"bags": 2, "cups": 4, "hats": 2}  # "pair" and "solo": too small
    assert by_class(train) == {"bags": 8, "cups": 16, "hats": 3, "solo": 1, "pair": 2}
    assert not set(train.samples) & set(test.samples)
    assert "protocol=standard" in train.split_note and "the catalogue case" in train.split_note
    # the same seed gives the same split; another seed another one
    assert load_dataset("folder", root, "test", protocol="standard").samples == test.samples
    other = load_dataset("folder", root, "test", protocol="standard", seed=1)
    assert other.samples != test.samples and by_class(other) == by_class(test)
    wider = load_dataset("folder", root, "test", protocol="standard", test_size=0.5)
    assert by_class(wider) == {"bags": 5, "cups": 10, "hats": 2}


def test_a_class_keeps_its_test_images_when_other_classes_change(tmp_path):
    root = catalogue(tmp_path / "shop", {"bags": 10, "cups": 20})
    before = load_dataset("folder", root, "test", protocol="standard")
    catalogue(root, {"lamps": 7})
    after = load_dataset("folder", root, "test", protocol="standard")
    assert [s for s in after.samples if "/bags/" in s or "/cups/" in s] == before.samples


def test_disjoint_stays_the_default_and_says_what_it_means_for_a_catalogue(tmp_path):
    root = catalogue(tmp_path / "shop", {name: 3 for name in "abcd"})
    train = load_dataset("folder", root, "train")
    assert set(by_class(train)) == {"a", "b"}
    assert train.split_note.startswith("protocol=disjoint") and "protocol=standard" in train.split_note
    assert load_dataset("folder", root, "train", protocol="disjoint").samples == train.samples


def test_the_csv_manifest_without_a_split_column_takes_the_same_protocols(tmp_path):
    root = catalogue(tmp_path / "shop", {"bags": 10, "cups": 20})
    rows = ["path,label"] + [f"{p.relative_to(root)},{p.parent.name}" for p in sorted(root.rglob("*.png"))]
    (root / "manifest.csv").write_text("\n".join(rows) + "\n")
    from_csv = load_dataset("csv", root, "test", protocol="standard")
    from_folder = load_dataset("folder", root, "test", protocol="standard")
    assert [Path(s).resolve() for s in from_csv.samples] == [Path(s).resolve() for s in from_folder.samples]


@pytest.mark.parametrize("options, message", [
    ({"protocol": "random"}, "unknown protocol 'random'"),
    ({"protocol": "standard", "test_size": 1.5}, "test_size=1.5 must lie strictly between 0 and 1"),
    ({"protocol": "standard", "test_size": "a lot"}, "test_size='a lot'"),
    ({"protocol": "standard", "seed": "x"}, "seed='x' must be a whole number"),
    ({"test_size": 0.3}, "give protocol=standard too"),
    ({"seed": 1}, "give protocol=standard too"),
])
def test_bad_protocol_options_are_refused_with_the_fix(tmp_path, options, message):
    root = catalogue(tmp_path / "shop", {"bags": 4, "cups": 4})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("+", r"\+")):
        load_dataset("folder", root, "train", **options)


def test_a_folder_with_its_own_split_refuses_a_protocol(tmp_path):
    catalogue(tmp_path / "data" / "train", {"bags": 3})
    catalogue(tmp_path / "data" / "test", {"bags": 3})
    with pytest.raises(ValueError, match="has train/ and test/ folders, which are its split"):
        load_dataset("folder", tmp_path / "data", "train", protocol="standard")


def test_held_out_per_class_matches_a_plain_loop():
    names = ["a"] * 9 + ["b"] * 4 + ["c"] * 2 + ["d"]
    held = held_out_per_class(names, 0.25, seed=3, at_least=2, keep=2)
    counts = Counter(name for name, h in zip(names, held, strict=True) if h)
    expected = {}
    for name, n in Counter(names).items():
        count = max(2, round(0.25 * n))
        expected[name] = count if n - count >= 2 else 0
    assert counts == +Counter(expected) and held.dtype == np.bool_


def test_the_evaluation_split_takes_the_data_sets_own_seed(tmp_path):
    from retrieval.metrics.evaluation import load_eval_sets

    root = catalogue(tmp_path / "shop", {"bags": 10, "cups": 20})
    sets = load_eval_sets("folder", str(root), "test", None, None, 0, protocol="standard", seed=1)
    assert sets.query.samples == load_dataset("folder", root, "test", protocol="standard", seed=1).samples


def test_a_standard_split_with_fewer_than_two_tested_classes_is_refused(tmp_path):
    root = catalogue(tmp_path / "shop", {"bags": 10, "tiny": 2})
    with pytest.raises(ValueError, match="holds test images out of 1 of the 2 classes; a test needs 2 classes"):
        load_dataset("folder", root, "test", protocol="standard")


def test_the_linear_probe_reads_test_labels_by_class_name():
    from retrieval.data import ImageDataset
    from retrieval.metrics.evaluation import probe_test_labels

    images = [np.zeros((2, 2), np.uint8)] * 4
    train = ImageDataset(images, [0, 1, 2, 2], ["a", "b", "c"])
    test = ImageDataset(images[:3], [0, 1, 1], ["b", "c"])  # "a" had no test image: the test numbers from "b"
    keep, labels = probe_test_labels(test.labels, test, train)
    assert keep.all() and labels.tolist() == [1, 2, 2]
    other = ImageDataset(images[:2], [0, 1], ["b", "z"])  # "z" is not trained: its rows are left out
    keep, labels = probe_test_labels(other.labels, other, train)
    assert keep.tolist() == [True, False] and labels.tolist() == [1]
