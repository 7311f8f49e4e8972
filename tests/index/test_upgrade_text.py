"""An upgrade that keeps the index's text model measures it first on the index's captions, and turns it off where the
new vectors would serve it worse beyond noise."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import QUICK
from sample_images import noisy_png
from text_towers import small_text_model

from retrieval.cli.main import main
from retrieval.compatibility import MIN_DROP, MIN_QUERIES
from retrieval.index import build_index, load_model
from retrieval.index.catalogue import Catalogue
from retrieval.index.writing import upgrade_checks
from retrieval.index.writing.upgrade_text import captioned_sample, compare_found, found_within
from retrieval.text.text_index import TEXT_MODEL_OFF

COLOURS = {"red": (200, 40, 40), "green": (40, 200, 40), "blue": (40, 40, 200), "yellow": (200, 200, 40)}


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_found_within_equals_a_loop_over_each_caption():
    rng = np.random.default_rng(0)
    text, images = rng.normal(size=(30, 8)), rng.normal(size=(30, 8))
    captions = [f"item {i % 12}" for i in range(30)]  # some captions shared: any image captioned alike counts
    expected = []
    for i in range(30):
        scores = [float(text[i] @ images[j]) for j in range(30)]
        top = sorted(range(30), key=lambda j: -scores[j])[:10]
        expected.append(float(any(captions[j] == captions[i] for j in top)))
    np.testing.assert_array_equal(found_within(text, images, captions, k=10), expected)


def test_a_drop_beyond_noise_is_worse_and_noise_or_a_small_drop_is_not():
    rng = np.random.default_rng(1)
    old = (rng.random(400) < 0.8).astype(float)
    dropped = old * (rng.random(400) < 0.6)  # hits lost, none gained: a clear drop
    assert compare_found(old, dropped)["worse"]
    same = compare_found(old, old.copy())
    assert not same["worse"] and same["difference"] == 0
    small = old.copy()
    small[np.flatnonzero(old)[:2]] = 0  # 2 of 400 queries: below MIN_DROP
    assert -MIN_DROP < compare_found(old, small)["difference"] < 0 and not compare_found(old, small)["worse"]
    few = np.ones(MIN_QUERIES - 1)
    assert not compare_found(few, few * 0)["worse"]  # too few queries to call anything worse


@pytest.fixture(scope="module")
def titled_index(tmp_path_factory):
    """A manifest gallery of 4 colours x 8 images, titled except every fourth, indexed by a 24-d model, with a text
    model recorded; a compatible model for it."""
    root = tmp_path_factory.mktemp("upgrade_text")
    rows = ["path,label,title"]
    for colour, rgb in COLOURS.items():
        (root / "g" / colour).mkdir(parents=True)
        for n in range(8):
            (root / "g" / colour / f"{n}.png").write_bytes(noisy_png(rgb, 100 * len(rows) + n))
            rows.append(f"{colour}/{n}.png,{colour},{'' if n % 4 == 3 else f'a {colour} square number {n}'}")
    (root / "g" / "manifest.csv").write_text("\n".join(rows) + "\n")
    old = write_projection_onnx(root / "old.onnx", dim=24, seed=0)
    old_hash = load_model(old).model_hash
    new = write_projection_onnx(root / "new.onnx", dim=24, seed=0, drift=0.3, compatible_with=(old_hash,))
    return {"root": root, "old": old, "new": new, "tower": small_text_model(root / "text.onnx", old_hash, 24)}


def _index(titled_index, tmp_path):
    build_index(titled_index["root"] / "g" / "manifest.csv", tmp_path / "idx", model=titled_index["old"],
                options=QUICK)
    assert run("index", "text", tmp_path / "idx", "--text-model", titled_index["tower"]).exit_code == 0
    return tmp_path / "idx"


def test_the_captioned_sample_takes_rows_with_text_only_and_is_seeded_and_bounded(titled_index, tmp_path):
    index_dir = _index(titled_index, tmp_path)
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        whole = captioned_sample(catalogue, ["title"], limit=100)
        assert len(whole) == 24 and all(caption.startswith("a ") for _, _, caption in whole)
        assert captioned_sample(catalogue, ["title"], limit=5, seed=3) == captioned_sample(
            catalogue, ["title"], limit=5, seed=3)
        assert len(captioned_sample(catalogue, ["title"], limit=5)) == 5
        assert captioned_sample(catalogue, ["no_such_column"], limit=5) == []


def test_a_compatible_upgrade_measures_the_text_model_on_the_captions_and_records_it(titled_index, tmp_path):
    index_dir = _index(titled_index, tmp_path)
    (index_dir / "index.json").write_text(json.dumps(
        json.loads((index_dir / "index.json").read_text()) | {"display_columns": ["title"]}))
    upgraded = run("index", "upgrade", index_dir, "--model", titled_index["new"], "--json")
    assert upgraded.exit_code == 0, upgraded.output
    measured = json.loads(upgraded.stdout)["on_text"]
    assert measured["measured"] and measured["images"] == 24 and measured["columns"] == ["title"]
    assert 0 <= measured["old"] <= 1 and measured["interval"][0] <= measured["difference"] <= measured["interval"][1]
    record = json.loads((index_dir / "index.json").read_text())["last_upgrade"]
    assert record["on_text"]["images"] == 24 and "Recall@10" in record["on_text_text"]


def test_a_text_model_measured_worse_on_the_upgrade_is_turned_off_saying_why(titled_index, tmp_path, monkeypatch):
    index_dir = _index(titled_index, tmp_path)
    worse = {"measured": True, "worse": True, "k": 10, "columns": ["title"], "images": 24, "old": 0.9, "new": 0.4,
             "difference": -0.5, "interval": [-0.7, -0.3]}
    monkeypatch.setattr(upgrade_checks, "measure_text_on_captions", lambda *args, **kwargs: worse)
    upgraded = run("index", "upgrade", index_dir, "--model", titled_index["new"])
    assert upgraded.exit_code == 0, upgraded.output
    assert "text search is OFF" in upgraded.output and "WORSE beyond noise" in upgraded.output
    info = json.loads((index_dir / "index.json").read_text())
    assert "text_model_hash" not in info and "would serve the text model worse" in info[TEXT_MODEL_OFF]["reason"]
    searched = run("search", "--index", index_dir, "--text", "a red square")
    assert searched.exit_code != 0 and "turned text search off" in searched.output


def test_an_upgrade_without_caption_columns_says_text_was_not_measured(titled_index, tmp_path):
    index_dir = _index(titled_index, tmp_path)
    upgraded = run("index", "upgrade", index_dir, "--model", titled_index["new"], "--json")
    assert upgraded.exit_code == 0, upgraded.output
    measured = json.loads(upgraded.stdout)["on_text"]
    assert not measured["measured"] and "no caption column" in measured["reason"]
    assert json.loads(upgraded.stdout)["text_model"]["state"] == "kept"
