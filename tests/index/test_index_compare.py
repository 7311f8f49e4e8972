"""Neighbour overlap between two models (label-free), against a slow loop of its definition, and through the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import QUICK
from sample_images import noisy_png

from retrieval.cli.main import main
from retrieval.compatibility import neighbour_overlap
from retrieval.index import build_index, load_model
from retrieval.index.curation.compare import compare_with_index


def _unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _nearest(vectors, i, k):
    others = [j for j in range(len(vectors)) if j != i]
    return set(sorted(others, key=lambda j: -float(vectors[i] @ vectors[j]))[:k])


def _slow_overlap(first, second, k):
    return np.asarray([len(_nearest(first, i, k) & _nearest(second, i, k)) / k for i in range(len(first))])


def test_neighbour_overlap_equals_the_loop_of_its_definition():
    rng = np.random.default_rng(0)
    first = _unit(rng.standard_normal((40, 8)))
    second = _unit(first + 0.3 * rng.standard_normal(first.shape))
    assert np.allclose(neighbour_overlap(first, second, 5), _slow_overlap(first, second, 5))
    assert np.all(neighbour_overlap(first, first, 5) == 1.0)
    unrelated = neighbour_overlap(first, _unit(rng.standard_normal((40, 8))), 5)
    assert unrelated.mean() < 0.4


def test_neighbour_overlap_refuses_sets_of_other_images_or_a_k_too_large():
    rows = _unit(np.random.default_rng(1).standard_normal((5, 4)))
    with pytest.raises(ValueError, match="same 5 images"):
        neighbour_overlap(rows, rows[:4])
    with pytest.raises(ValueError, match="between 1 and 4"):
        neighbour_overlap(rows, rows, k=5)


@pytest.fixture(scope="module")
def labelled_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    for label, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
        (root / "g" / f"c{label}").mkdir(parents=True)
        for n in range(6):
            (root / "g" / f"c{label}" / f"{n}.png").write_bytes(noisy_png(colour, 10 * label + n))
    old = write_projection_onnx(root / "old.onnx", seed=0)
    build_index(root / "g", root / "idx", model=old, options=QUICK)
    return root


def test_the_index_own_model_keeps_every_neighbourhood_and_another_changes_them(labelled_index):
    same = compare_with_index(labelled_index / "idx", load_model(labelled_index / "old.onnx"), k=3)
    assert same["overlap"]["mean"] == pytest.approx(1.0) and same["images"] == 18
    assert same["labels"]["old"] == same["labels"]["new"]
    other = write_projection_onnx(labelled_index / "other.onnx", dim=16, seed=9)
    changed = compare_with_index(labelled_index / "idx", load_model(other), k=3)
    assert changed["overlap"]["mean"] < 1.0 and len(changed["most_changed"]) == 10
    assert changed["most_changed"][0]["overlap"] == min(item["overlap"] for item in changed["most_changed"])
    assert changed["most_changed"][0]["path"].startswith("c")  # relative to the gallery, as the API shows it


def test_index_compare_prints_the_overlap_and_the_most_changed_images(labelled_index):
    other = write_projection_onnx(labelled_index / "other2.onnx", dim=16, seed=11)
    shown = CliRunner().invoke(main, ["index", "compare", str(labelled_index / "idx"), "--model", str(other),
                                      "-k", "3"])
    assert shown.exit_code == 0, shown.output
    assert "nearest neighbours under other2.onnx overlap those under the index's model by" in shown.output
    assert "Recall@1" in shown.output and "changed most:" in shown.output
    as_json = json.loads(CliRunner().invoke(main, ["index", "compare", str(labelled_index / "idx"), "--model",
                                                   str(other), "-k", "3", "--json"]).stdout)
    assert as_json["k"] == 3 and 0.0 <= as_json["overlap"]["mean"] <= 1.0


def test_compare_names_two_models_of_one_file_name_by_their_folders(labelled_index):
    for run, seed in (("a", 3), ("b", 4)):
        (labelled_index / "runs" / run).mkdir(parents=True, exist_ok=True)
        write_projection_onnx(labelled_index / "runs" / run / "model.onnx", dim=16, seed=seed)
    shown = CliRunner().invoke(main, ["compare", "--baseline", str(labelled_index / "runs" / "a" / "model.onnx"),
                                      "--model", str(labelled_index / "runs" / "b" / "model.onnx"),
                                      "--images", str(labelled_index / "g"), "-k", "3"])
    assert shown.exit_code == 0, shown.output
    assert "(a/model.onnx) -> " in shown.output and "(b/model.onnx)" in shown.output
    assert "(model.onnx)" not in shown.output


def test_model_names_take_the_shortest_differing_path_end_else_the_hashes(tmp_path):
    from retrieval.index.curation.compare import model_names

    assert model_names(tmp_path / "old.onnx", tmp_path / "new.onnx") == ("old.onnx", "new.onnx")
    assert model_names(tmp_path / "x" / "run" / "model.onnx", tmp_path / "y" / "run" / "model.onnx") == (
        "x/run/model.onnx", "y/run/model.onnx")
    same = tmp_path / "model.onnx"
    assert model_names(same, same, "abcdef0123456789", "abcdef0199999999") == (
        "model.onnx (abcdef012)", "model.onnx (abcdef019)")
    first, second = model_names(same, same, "abc", "abc")
    assert first != second and "the same file" in second
