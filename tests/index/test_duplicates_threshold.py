"""`auto`'s cut on small galleries: it stays above the gallery's distinct lookalikes (each image's nearest distinct
image: its own copies and neighbours of another label read as such), says when planted copies and distinct images
do not separate, and a group whose labels differ is flagged and never proposed for removal."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from planted import graph_of, plant, projection_model, write_patterns

from retrieval.cli.main import main
from retrieval.index import Index, IngestOptions, build_index
from retrieval.index.curation.duplicates import DuplicateOptions, advice, find_duplicates
from retrieval.index.curation.duplicates_threshold import Calibration, choose_threshold, nearest_distinct_scores

QUICK = IngestOptions(batch_size=32, workers=0, shard_size=64, progress=False)


def test_on_a_small_gallery_the_cut_stays_above_its_distinct_lookalikes():
    """252 images, 12 of them lookalikes of another (bull and bison) as alike as many planted copies: the cut that
    best traded copies kept against images flagged (Youden's J) landed among the lookalikes."""
    rng = np.random.default_rng(0)
    copies = np.clip(rng.normal(0.95, 0.02, 400), -1, 1)  # 100 images x 4 planted copies
    distinct = np.concatenate([rng.normal(0.80, 0.04, 240), np.linspace(0.90, 0.93, 12)])
    cut = choose_threshold(copies, distinct)
    assert cut > distinct.max()
    assert cut <= 1.0


def test_the_nearest_distinct_image_passes_over_an_images_own_copies_but_not_lookalikes():
    graph = graph_of({
        0: [(1, 0.98), (5, 0.80), (6, 0.79)],  # one copy standing clear of the rest: its next is the distinct one
        2: [(3, 0.97), (7, 0.965), (8, 0.96)],  # alike neighbours without a gap: lookalikes, the first counts
        3: [(9, 0.99), (10, 0.985), (2, 0.90)],  # two copies, then a gap
        4: [(11, 0.70)],  # one neighbour only: it counts
    })
    assert nearest_distinct_scores(graph).tolist() == pytest.approx([0.80, 0.97, 0.90, 0.70])
    # labelled: a neighbour of another label is distinct whatever the gap (a copy keeps its label)
    labels = {0: "bull", 1: "bison", 5: "bull", 6: "bull", 2: "orange", 3: "orange", 9: "orange", 10: "orange"}
    assert nearest_distinct_scores(graph, labels).tolist() == pytest.approx([0.98, 0.97, 0.90, 0.70])


def test_copies_and_distinct_images_that_overlap_are_said_not_to_separate():
    calibration = Calibration(0.95, 100, 400, 0.55, {"resized": 0.9, "jpeg": 0.6, "cropped": 0.1, "recoloured": 0.6},
                              0.02, floor=0.86, ceiling=0.94)
    assert not calibration.separated
    found = calibration.to_dict()
    assert found["separated"] is False and "do not separate" in found["warning"]
    assert "55%" in found["warning"] and "0.940" in found["warning"] and "cropped 10%" in found["warning"]
    assert advice(found, [])["warnings"] == [found["warning"]]
    clear = Calibration(0.93, 100, 400, 0.95, {"resized": 1.0}, 0.0, floor=0.95, ceiling=0.9)
    assert clear.separated and clear.warning is None and clear.to_dict()["warning"] is None


@pytest.fixture(scope="module")
def mixed_index(tmp_path_factory):
    """40 colour patterns in 5 class folders; 4 of them with a resized and a re-encoded copy beside them, one copy
    filed under another class (a copy under the wrong label, or two products alike): (index folder, that copy)."""
    root = tmp_path_factory.mktemp("mixed")
    paths = write_patterns(root / "gallery", 40)
    copies = plant(paths[:4])
    moved = copies[paths[0]][0]
    target = root / "gallery" / "c4" / moved.name
    shutil.move(moved, target)
    build_index(root / "gallery", root / "index", model=projection_model(root), options=QUICK)
    return root / "index", target


def test_a_group_whose_labels_differ_is_flagged_and_left_out_of_the_removal(mixed_index):
    index_dir, moved = mixed_index
    result = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--threshold", "0.97", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    mixed = [g for g in summary["groups"] if g["labels_mixed"]]
    assert len(mixed) == 1 and any(p.endswith(moved.name) for p in mixed[0]["paths"])
    assert set(mixed[0]["labels"]) == {"c0", "c4"}
    agreeing = [g for g in summary["groups"] if not g["labels_mixed"]]
    assert len(agreeing) == 3 and not any(g["labels_mixed"] for g in agreeing)
    assert summary["removal"]["ids"] == [i for g in agreeing for i in g["ids"][1:]]
    assert not set(summary["removal"]["ids"]) & set(mixed[0]["ids"])
    assert summary["removal"]["left_out"] == [summary["groups"].index(mixed[0]) + 1]
    assert any("mix labels" in w for w in summary["warnings"])

    people = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--threshold", "0.97"])
    assert people.exit_code == 0, people.output
    lines = people.output.splitlines()
    number = summary["groups"].index(mixed[0]) + 1
    assert any(line.startswith(f"  {number}. ") and "LABELS DIFFER (c0, c4)" in line for line in lines)
    assert any(line.startswith("warning: 1 of 4 groups listed mix labels") for line in lines)
    proposed = lines[-1].split("--ids ")[1].split()[0].split(",")
    assert sorted(map(int, proposed)) == sorted(summary["removal"]["ids"])
    assert f"groups {number} mix labels and are left out" in lines[-1]


def test_auto_says_in_the_summary_whether_copies_and_distinct_images_separate(mixed_index, capsys):
    """The projection model sees crops and recolourings as unlike their original as a distinct image: a fifth or
    more of the planted copies fall below the distinct images, and the summary says so (JSON and people). The
    calibrated cosine is auto without verification."""
    from retrieval.cli.curation import _print_groups

    index_dir, _ = mixed_index
    with Index.open(index_dir) as index:
        summary = find_duplicates(index, DuplicateOptions("auto", calibration_sample=20, verify=False))
    calibration = summary["calibration"]
    assert set(calibration) >= {"separated", "warning", "copy_floor", "distinct_ceiling", "labels_used"}
    assert calibration["labels_used"] is True
    assert calibration["separated"] is (calibration["copy_recall"] >= 0.9)
    if not calibration["separated"]:
        assert calibration["warning"] in summary["warnings"]
        _print_groups(summary, str(index_dir))
        people = capsys.readouterr().out
        assert "do NOT separate" in people and "warning: planted copies and distinct images do not separate" in people
