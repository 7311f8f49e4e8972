"""Near-duplicate groups through each image's nearest neighbours: planted copies are grouped with their original and
unrelated images are not, a group bigger than k is found whole, `auto` without verification calibrates a cosine on
planted copies, the command's JSON and picture, and `index add` reports or skips new images that copy indexed ones."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from planted import PIXEL_KINDS, plant, projection_model, write_patterns

from retrieval.cli.main import main
from retrieval.index import Catalogue, Index, IngestOptions, build_index
from retrieval.index.curation.copy_planting import VERIFICATION_KINDS, plant_copies
from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
from retrieval.index.curation.duplicates_threshold import COPY_KINDS, choose_threshold
from retrieval.index.curation.linked_groups import UnionFind, duplicate_groups, split_around_first
from retrieval.index.curation.neighbour_graph import exact_graph, index_graph

QUICK = IngestOptions(batch_size=32, workers=0, shard_size=64, progress=False)


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def planted_vectors(seed: int = 0, n: int = 400, d: int = 32, originals: int = 20, copies: int = 3):
    """Random unit vectors, and ``copies`` noisy copies of the first ``originals`` appended; the planted groups."""
    rng = np.random.default_rng(seed)
    base = unit(rng.standard_normal((n, d)))
    extra, groups = [], []
    for i in range(originals):
        members = [i]
        for _ in range(copies):
            extra.append(unit(base[i] + 0.05 * rng.standard_normal(d)))
            members.append(n + len(extra) - 1)
        groups.append(frozenset(members))
    return np.concatenate([base, np.stack(extra)]), set(groups)


def test_planted_copies_are_grouped_with_their_original_and_nothing_else():
    vectors, planted = planted_vectors()
    graph = exact_graph(vectors, k=5)
    groups = duplicate_groups(graph, threshold=0.9)
    assert {frozenset(g.ids.tolist()) for g in groups} == planted  # every copy found, no unrelated image grouped
    assert all(g.weakest_link >= 0.9 for g in groups)
    assert all(list(g.ids) == sorted(g.ids) for g in groups)  # the first (kept) image is the lowest id


def test_a_group_larger_than_k_is_found_whole_through_its_links():
    """40 images along an arc, each at cosine 0.998 from the next: with k = 3 no image sees most of the others, yet
    the links join all 40, as single-linkage does; the ends are far apart (the weakest link is what holds)."""
    angles = np.arange(40) * 0.06
    arc = np.zeros((40, 16), np.float32)
    arc[:, 0], arc[:, 1] = np.cos(angles), np.sin(angles)
    others = unit(np.random.default_rng(1).standard_normal((200, 16)))
    others[:, :2] = 0.0  # orthogonal to the arc's plane: never linked to it
    vectors = np.concatenate([arc, unit(others)])
    groups = duplicate_groups(exact_graph(vectors, k=3), threshold=0.99)
    assert len(groups) == 1 and groups[0].ids.tolist() == list(range(40))
    assert float(arc[0] @ arc[-1]) < 0.0 and groups[0].weakest_link >= 0.99


def test_a_chain_is_cut_around_its_first_image():
    """The same arc through ``find_duplicates``' cut: every image of a group at least the threshold alike to the
    group's first image, each image in one group at most (one left without a partner stands alone)."""
    angles = np.arange(40) * 0.06
    arc = np.zeros((40, 16), np.float32)
    arc[:, 0], arc[:, 1] = np.cos(angles), np.sin(angles)
    linked = duplicate_groups(exact_graph(arc, k=3), threshold=0.99)
    groups = split_around_first(linked, dict(enumerate(arc)), 0.99)
    grouped = [i for g in groups for i in g.ids.tolist()]
    assert len(groups) > 1 and len(grouped) == len(set(grouped)) >= 38 and set(grouped) <= set(range(40))
    for group in groups:
        first = arc[group.ids[0]]
        assert all(float(arc[i] @ first) >= 0.99 for i in group.ids) and group.weakest_link >= 0.99
        assert group.ids[0] == min(group.ids)


def test_union_find_merges_sets():
    sets = UnionFind(6)
    for a, b in ((0, 1), (2, 3), (1, 3), (4, 4)):
        sets.union(a, b)
    roots = sets.roots()
    assert len({roots[0], roots[1], roots[2], roots[3]}) == 1 and len(set(roots.tolist())) == 3


def test_the_auto_threshold_separates_copies_from_distinct_neighbours():
    copies = np.linspace(0.96, 0.99, 50)
    neighbours = np.linspace(0.5, 0.9, 80)
    floor = float(np.quantile(copies, 0.1))  # the cosine 90 % of the copies reach
    assert choose_threshold(copies, neighbours) == pytest.approx((0.9 + floor) / 2, abs=1e-4)  # the gap's middle
    # overlapping: above the distinct images (all but one in a thousand), not among them as Youden's J was
    rng = np.random.default_rng(0)
    copies, neighbours = rng.normal(0.95, 0.02, 2000), rng.normal(0.85, 0.03, 2000)
    cut = choose_threshold(copies, neighbours)
    assert (neighbours >= cut).sum() <= 2 and cut == pytest.approx(np.sort(neighbours)[-3] + 0.01, abs=1e-4)


def test_planted_copies_are_the_four_kinds_on_the_models_background():
    sticker = Image.new("RGBA", (40, 30), (0, 0, 0, 0))  # transparent: hidden black RGB
    copies = plant_copies(sticker, COPY_KINDS, seed=0, background=(255, 255, 255))
    assert list(copies) == list(COPY_KINDS)
    assert copies["resized"].size == (20, 15) and copies["cropped"].size == (32, 24)
    assert all(c.mode == "RGB" for c in copies.values())
    assert np.asarray(copies["jpeg"]).min() > 240  # on white, as the index puts it, not on the hidden black


@pytest.fixture(scope="module")
def planted_index(tmp_path_factory):
    """60 colour patterns, 8 of them with a resized and a re-encoded copy beside them, indexed by the projection
    model: (index folder, model, {original's catalogue path: its copies' paths})."""
    root = tmp_path_factory.mktemp("planted")
    paths = write_patterns(root / "gallery", 60)
    copies = plant(paths[:: 60 // 8][:8])
    model = projection_model(root)
    build_index(root / "gallery", root / "index", model=model, options=QUICK)
    return root / "index", model, {str(k.resolve()): {str(p.resolve()) for p in v} for k, v in copies.items()}


def test_auto_unverified_finds_the_planted_copies_and_nothing_else(planted_index):
    """``auto`` without verification: the cosine calibrated on planted copies groups exactly the planted ones."""
    index_dir, _, planted = planted_index
    with Index.open(index_dir) as index:
        summary = find_duplicates(index, DuplicateOptions("auto", calibration_sample=20, verify=False))
        path_of = {index.public_path(row["path"]): row["path"] for row in index.indexed_rows(index.ids.tolist())
                   .values()}
    assert summary["mode"] == "cosine" and "similar" not in summary
    found = {path_of[group["paths"][0]]: {path_of[p] for p in group["paths"][1:]} for group in summary["groups"]}
    assert found == planted  # each original kept first, its copies after it; no other image in any group
    assert summary["groups_found"] == 8 and summary["copies_in_groups"] == 8 * len(PIXEL_KINDS)
    group = summary["groups"][0]
    assert set(group) >= {"size", "ids", "paths", "labels", "similarities", "weakest_link"}
    assert group["similarities"][0] == pytest.approx(1.0) and all(s >= summary["threshold"] - 0.05
                                                                   for s in group["similarities"])
    calibration = summary["calibration"]
    assert calibration["images"] == 20 and calibration["copies"] == 80 and calibration["method"].startswith("planted")
    assert calibration["recall_by_kind"]["resized"] == calibration["recall_by_kind"]["jpeg"] == 1.0
    # the images whose nearest other image reaches it: exactly the 24 in the planted groups
    assert calibration["neighbour_share"] == pytest.approx(24 / 76, abs=1e-4)


def test_index_duplicates_json_lists_the_groups_and_draws_them(planted_index, tmp_path):
    index_dir, _, planted = planted_index
    picture = tmp_path / "groups.png"
    result = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--threshold", "0.97", "--json",
                                       "--out", str(picture)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    with Index.open(index_dir) as index:
        path_of = {index.public_path(row["path"]): row["path"] for row in index.indexed_rows(index.ids.tolist())
                   .values()}
    found = {path_of[group["paths"][0]]: {path_of[p] for p in group["paths"][1:]} for group in summary["groups"]}
    assert found == planted and summary["threshold"] == 0.97 and summary["calibration"] is None
    assert summary["picture"] == str(picture) and Image.open(picture).size[0] > 300


def test_index_duplicates_for_people_ends_with_the_removal_of_the_copies(planted_index):
    index_dir, _, _ = planted_index
    result = CliRunner().invoke(main, ["index", "duplicates", "--index", str(index_dir), "--threshold", "0.97"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("8 groups of near-duplicates (16 copies) among 76 indexed images at cosine >= 0.970 "
                               "(as given")
    assert lines[-1].startswith(f"next: retrieval index remove {index_dir} --ids ")
    assert len(lines[-1].split("--ids ")[1].split()[0].split(",")) == 16
    bad = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--threshold", "1.5"])
    assert bad.exit_code == 2 and "--threshold" in bad.output and "cosine within [-1, 1] or auto" in bad.output


def test_index_duplicates_by_default_lists_verified_copies_and_removes_only_them(planted_index, tmp_path):
    """No threshold: each group verified pair by pair, said in the header with the calibration; the removal lists the
    verified copies only, and --json says the mode, the verification and each group's estimated precision."""
    index_dir, _, planted = planted_index
    picture = tmp_path / "copies.png"
    result = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--calibration-sample", "20",
                                       "--workers", "1", "--json", "--out", str(picture)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["mode"] == "verified" and summary["verification"]["complete"]
    assert summary["verification"]["checked"] == summary["verification"]["candidates"] > 0
    assert all(group["verified"] and 0 < group["estimated_precision"] <= 1 for group in summary["groups"])
    with Index.open(index_dir) as index:
        path_of = {index.public_path(row["path"]): row["path"] for row in index.indexed_rows(index.ids.tolist())
                   .values()}
    families = [{original, *copies} for original, copies in planted.items()]
    groups = [{path_of[p] for p in group["paths"]} for group in summary["groups"]]
    # each group one planted image and copies of it (the one kept: the one verified against the most others)
    assert groups and all(any(group <= family for family in families) for group in groups)
    removed = {i for i in summary["removal"]["ids"]}
    assert removed == {i for group in summary["groups"] for i in group["ids"][1:]}
    assert all(pair["reason"] for pair in summary["similar"])
    assert Image.open(picture).size[0] > 200
    people = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--calibration-sample", "20"])
    assert people.exit_code == 0, people.output
    lines = [line for line in people.output.splitlines() if line.strip()]  # the bar's end on stderr leaves a blank
    header = next(line for line in lines if "groups of verified copies" in line)
    assert "candidate pairs" in header and "estimated precision" in header
    assert f"Calibrated on {20 * len(VERIFICATION_KINDS)} copies" in header
    assert lines[-1].startswith(f"next: retrieval index remove {index_dir} --ids ") and "verified copies" in lines[-1]
    assert {int(i) for i in lines[-1].split("--ids ")[1].split()[0].split(",")} == removed


def test_ctrl_c_during_the_verification_lists_what_was_verified_and_exits_130(planted_index, monkeypatch):
    from retrieval.index.curation import duplicates

    real = duplicates.verify_pairs

    def stopped(*args, **kwargs):
        done = real(*args, **kwargs)
        half = done.pairs[:len(done.pairs) // 2]
        return dataclasses.replace(done, pairs=half, complete=False, interrupted=True,
                                   stopped_because=f"stopped by Ctrl-C after {len(half)} of {done.candidates} "
                                                   "candidate pairs")

    monkeypatch.setattr(duplicates, "verify_pairs", stopped)
    index_dir, _, _ = planted_index
    result = CliRunner().invoke(main, ["index", "duplicates", str(index_dir), "--calibration-sample", "20", "--json"])
    assert result.exit_code == 130, result.output
    summary = json.loads(result.output)
    assert summary["verification"]["interrupted"] and not summary["verification"]["complete"]
    assert summary["warnings"][0].startswith("verification not finished (stopped by Ctrl-C")
    assert summary["verification"]["checked"] < summary["verification"]["candidates"]


def test_a_sample_finds_the_copies_of_the_images_it_searched(planted_index):
    index_dir, _, _ = planted_index
    with Index.open(index_dir) as index:
        whole = find_duplicates(index, DuplicateOptions(0.97))
        graph = index_graph(index, k=5, max_images=40, seed=3)
        sampled = find_duplicates(index, DuplicateOptions(0.97), graph=graph)
    assert sampled["sampled"] and sampled["images"] == 40
    whole_groups = [set(g["ids"]) for g in whole["groups"]]
    for group in sampled["groups"]:  # every sampled group is part of a true one
        assert any(set(group["ids"]) <= g for g in whole_groups)


def test_index_add_reports_new_near_duplicates_and_skips_them_on_request(planted_index, tmp_path):
    index_dir, _, _ = planted_index
    with Index.open(index_dir) as index:
        indexed = sorted(index.indexed_rows(index.ids.tolist()).values(), key=lambda r: r["id"])
    names = [r["path"].rsplit("/", 1)[1] for r in indexed]
    planted_already = {name.split("_")[0] + ".png" for name in names if "_" in name}
    # three without planted copies (a copy planted again would be byte for byte the indexed one: an exact duplicate)
    originals = [r for r, name in zip(indexed, names, strict=True) if "_" not in name and name not in planted_already
                 ][:3]
    more = tmp_path / "more"
    sources = []
    for row in originals:  # their bytes copied elsewhere, so that plant() writes the copies into `more`
        source = tmp_path / "sources" / row["label"] / row["path"].rsplit("/", 1)[1]
        source.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(row["path"], source)
        sources.append(source)
    plant(sources, ("jpeg",), folder=more)
    write_patterns(more, 3, start=500)  # three patterns the index does not hold
    for action, added, skipped in (("report", 6, 0), ("skip", 3, 3)):
        copy = tmp_path / f"index-{action}"
        shutil.copytree(index_dir, copy)
        result = CliRunner().invoke(main, ["index", "add", str(copy), "--images", str(more), "--workers", "0",
                                           "--duplicates", action, "--duplicate-threshold", "0.97"])
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()  # the progress bar goes to stderr
        near = [line for line in lines if line.strip().startswith("near-duplicate")]
        assert len(near) == 3 and all("_jpeg.jpg" in line and "cosine" in line for line in near)
        assert f"added {added} images" in lines[-2] and f"3 near-duplicates of indexed images (cosine >= 0.97) " \
            f"{'skipped' if skipped else 'added'}" in lines[-2]
        assert lines[-1].startswith("next: retrieval index remove" if action == "report" else "next: retrieval serve")
        with Index.open(copy) as index:
            assert len(index) == 76 + added
        with Catalogue(copy / "catalogue.sqlite") as catalogue:
            duplicates = [r for r in catalogue.problems("duplicate", 10)]
        assert len(duplicates) == skipped
        if skipped:
            assert {d["duplicate_of"] for d in duplicates} == {r["id"] for r in originals}
            assert all("near-duplicate of id" in d["error"] for d in duplicates)
    payload = json.loads(CliRunner().invoke(main, ["index", "add", str(tmp_path / "index-skip"), "--images",
                                                   str(more), "--workers", "0", "--json"]).output)
    assert payload["near_duplicates"]["checked"] == 0  # nothing new: every file is catalogued already
    off = CliRunner().invoke(main, ["index", "add", str(index_dir), "--images", str(more), "--duplicate-threshold",
                                    "2"])
    assert off.exit_code == 1 and "--duplicate-threshold must be in [-1, 1], got 2.0" in off.output


def test_the_header_states_a_precision_only_where_pairs_were_verified():
    """Nothing verified: no "estimated precision 0.00 ... false ones among them" about an empty set."""
    from retrieval.cli.curation import _header

    summary = {"groups_found": 0, "copies_in_groups": 0, "images": 10, "k": 10, "threshold": 0.6,
               "exact_duplicates": 0, "mode": "verified",
               "calibration": {"rules": {"min_inliers": 4, "correlation": 0.9, "colour_mismatch": 10.0, "shade": 0.45},
                               "copies": 5,
                               "images": 1, "copy_recall": 1.0, "distinct_pairs": 2, "colour_variants": 1,
                               "false_verified": 0},
               "verification": {"checked": 5, "candidates": 5, "seconds": 1.0, "pairs_per_second": 5.0,
                                "verified": 0, "estimated_precision": 0.0, "expected_false_pairs": 1.2}}
    assert "0 verified:" in _header(summary) and "estimated precision" not in _header(summary)
    summary["verification"] |= {"verified": 2, "estimated_precision": 0.81}
    assert "2 verified (estimated precision 0.81: the calibration cannot rule out 1.2 false ones" in _header(summary)
