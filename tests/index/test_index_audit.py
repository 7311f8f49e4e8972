"""The label audit: its vote and confident-learning reading equal a slow loop of the formula, flipped labels rank at
the top (arrays, an index, a folder with the toolkit's own --label-noise), the JSON and picture, and bad input is
refused naming the option and the fix."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image
from planted import flip, projection_model, write_digits, write_patterns

from retrieval.cli.main import main
from retrieval.index import IngestOptions, build_index
from retrieval.index.curation.audit import audit_graph, confident_suspects, label_vote
from retrieval.index.curation.neighbour_graph import NeighbourGraph, exact_graph

QUICK = IngestOptions(batch_size=32, workers=0, shard_size=64, progress=False)


def slow_audit(labels, neighbour_labels, scores, num_classes):
    """The module's formula, one image and one neighbour at a time."""
    n = len(labels)
    votes = []
    for i in range(n):
        tally, total = {}, 0.0
        for c, s in zip(neighbour_labels[i], scores[i], strict=True):
            if c < 0:
                continue
            w = max(float(s), 0.0) if np.isfinite(s) else 0.0
            tally[int(c)] = tally.get(int(c), 0.0) + w
            total += w
        votes.append({c: v / total for c, v in tally.items()} if total > 0 else None)
    own = [votes[i].get(int(labels[i]), 0.0) if votes[i] is not None and labels[i] >= 0 else None for i in range(n)]
    thresholds = {}
    for c in range(num_classes):
        mine = [own[i] for i in range(n) if labels[i] == c and own[i] is not None]
        if mine:
            thresholds[c] = sum(mine) / len(mine)
    suggested, score = [], []
    for i in range(n):
        best = None
        if own[i] is not None:
            for c, p in votes[i].items():
                if c in thresholds and p >= thresholds[c] and (best is None or p > votes[i][best]):
                    best = c
        suggested.append(-1 if best is None else best)
        score.append(None if best is None else votes[i][best] - own[i])
    return votes, own, thresholds, suggested, score


def test_the_vote_and_its_reading_equal_a_slow_loop_of_the_formula():
    rng = np.random.default_rng(0)
    n, k, classes = 300, 7, 5
    labels = rng.integers(-1, classes, n)  # some unlabelled
    neighbour_labels = rng.integers(-1, classes, (n, k))
    scores = rng.uniform(-0.3, 1.0, (n, k))  # some negative: weight 0
    scores[rng.random((n, k)) < 0.05] = -np.inf  # missing neighbours
    vote = label_vote(labels, neighbour_labels, scores)
    suspicion = confident_suspects(vote, classes)
    votes, own, thresholds, suggested, score = slow_audit(labels, neighbour_labels, scores, classes)
    for i in range(n):
        for c, share in zip(neighbour_labels[i], vote.shares[i], strict=True):
            if c >= 0 and votes[i] is not None:
                assert share == pytest.approx(votes[i][int(c)])
        if own[i] is None:
            assert np.isnan(vote.self_confidence[i])
        else:
            assert vote.self_confidence[i] == pytest.approx(own[i])
    assert {c: t for c, t in enumerate(suspicion.thresholds) if not np.isnan(t)} == pytest.approx(thresholds)
    assert suspicion.suggested.tolist() == suggested
    for i in range(n):
        if score[i] is None:
            assert np.isnan(suspicion.score[i])
        else:
            assert suspicion.score[i] == pytest.approx(score[i])
    assert suspicion.suspect.tolist() == [s >= 0 and s != label for s, label in zip(suggested, labels, strict=True)]


def test_flipped_labels_rank_at_the_top():
    rng = np.random.default_rng(1)
    centres = rng.standard_normal((10, 32)) * 2
    clean = np.repeat(np.arange(10), 60)
    vectors = centres[clean] + rng.standard_normal((600, 32))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    noisy = clean.copy()
    flipped = rng.choice(600, 30, replace=False)
    noisy[flipped] = (clean[flipped] + rng.integers(1, 10, 30)) % 10
    audit = audit_graph(exact_graph(vectors, k=10), {i: str(c) for i, c in enumerate(noisy)})
    ranked = audit.suspect_rows()
    assert np.isin(ranked[:30], flipped).mean() >= 0.9  # precision of the top 30 against the 30 flipped
    suggested = audit.suspicion.suggested[ranked[:30]]
    true = np.asarray([audit.classes.index(str(c)) for c in clean[ranked[:30]]])
    assert (suggested == true).mean() >= 0.9  # and the label suggested is the one they had


def test_an_image_without_labelled_neighbours_is_never_a_suspect():
    graph = NeighbourGraph(np.arange(3), np.array([[0.9], [0.9], [-np.inf]], np.float32), np.array([[1], [0], [-1]]))
    audit = audit_graph(graph, {0: "a", 1: "b", 2: "a"})
    assert not audit.suspicion.suspect[2] and np.isnan(audit.vote.self_confidence[2])


@pytest.fixture(scope="module")
def flipped_index(tmp_path_factory):
    """300 digits, 10 of them moved into the next digit's folder, indexed by the projection model: (index folder,
    {flipped file name: its true digit})."""
    root = tmp_path_factory.mktemp("audit")
    paths = write_digits(root / "gallery", 300)
    moved = flip(paths[::30])
    build_index(root / "gallery", root / "index", model=projection_model(root), options=QUICK)
    return root / "index", {path.name: true for path, true in moved.items()}


def test_index_audit_ranks_the_flipped_labels_first(flipped_index, tmp_path):
    index_dir, flipped = flipped_index
    picture = tmp_path / "suspects.png"
    result = CliRunner().invoke(main, ["index", "audit", str(index_dir), "--json", "--top", "10", "--out",
                                       str(picture)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["labelled"] == summary["images"] == 300 and summary["classes"] == 10
    suspects = summary["suspects"]
    assert len(suspects) == 10 and set(suspects[0]) >= {"id", "path", "label", "suggested", "score",
                                                         "self_confidence", "neighbours"}
    hits = [s for s in suspects if s["path"].rsplit("/", 1)[1] in flipped]
    assert len(hits) >= 8  # precision of the top 10 against the 10 flipped
    assert all(s["suggested"] == flipped[s["path"].rsplit("/", 1)[1]] for s in hits)  # their true digit
    assert [s["score"] for s in suspects] == sorted((s["score"] for s in suspects), reverse=True)
    assert all(s["suggested"] != s["label"] for s in suspects)
    assert len(suspects[0]["neighbours"]) == 5 and {"id", "path", "label", "similarity"} <= set(
        suspects[0]["neighbours"][0])
    assert summary["picture"] == str(picture) and Image.open(picture).size[1] > 300
    people = CliRunner().invoke(main, ["index", "audit", "--index", str(index_dir), "-k", "5"])
    assert people.exit_code == 0, people.output
    lines = people.stdout.splitlines()
    assert "label suspects among 300 labelled images (10 classes" in lines[0] and " -> " in lines[1]
    assert lines[-1].startswith("next: correct the labels at their source") and "--label-from parent" in lines[-1]


def test_an_index_without_labels_is_refused_with_the_fix(tmp_path):
    write_digits(tmp_path / "flat", 12)
    for path in (tmp_path / "flat").rglob("*.png"):
        path.rename(tmp_path / "flat" / path.name)  # straight in the gallery folder: no label
    build_index(tmp_path / "flat", tmp_path / "index", model=projection_model(tmp_path), options=QUICK)
    result = CliRunner().invoke(main, ["index", "audit", str(tmp_path / "index")])
    assert result.exit_code == 1 and "has no labels to audit" in result.output and "--label-from" in result.output


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder")
    write_digits(root / "train", 400)
    return root / "train", projection_model(root)


def test_a_training_folder_audit_finds_the_noise_the_toolkit_injects(digits_folder):
    folder, model = digits_folder
    result = CliRunner().invoke(main, ["audit", "--images", str(folder), "--model", str(model), "--label-noise",
                                       "symmetric:0.1", "--seed", "1", "--top", "20", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    noise = summary["noise"]
    assert noise["mode"] == "symmetric" and noise["rate"] == 0.1 and 25 <= noise["flipped"] <= 55
    assert noise["top"] == 20 and noise["precision_at_top"] >= 0.9 and noise["precision_at_flipped"] >= 0.7
    assert noise["recall"] >= 0.6
    assert summary["suspects"][0]["path"].count("/") == 1 and "id" not in summary["suspects"][0]
    people = CliRunner().invoke(main, ["audit", "--images", str(folder), "--model", str(model), "--label-noise",
                                       "symmetric:0.1", "--seed", "1", "--top", "20"])
    assert people.exit_code == 0, people.output
    assert "labels flipped (symmetric, rate 0.1, seed 1): precision" in people.stdout
    assert people.stdout.splitlines()[-1].startswith("next: ")


@pytest.mark.parametrize(("args", "message"), [
    (["--label-noise", "sometimes:0.1"], "--label-noise must look like symmetric:0.1"),
    (["--label-noise", "symmetric:1.5"], "--label-noise must look like symmetric:0.1"),
    (["--max-images", "100"], "--max-images is 100, but"),
])
def test_bad_audit_options_are_refused_naming_the_option(digits_folder, args, message):
    folder, model = digits_folder
    result = CliRunner().invoke(main, ["audit", "--images", str(folder), "--model", str(model), *args])
    assert result.exit_code != 0 and message in result.output, result.output


def test_asymmetric_noise_takes_a_known_table_whose_classes_are_all_there(digits_folder, tmp_path):
    folder, model = digits_folder
    result = CliRunner().invoke(main, ["audit", "--images", str(folder), "--model", str(model), "--label-noise",
                                       "asymmetric:0.3", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["noise"]["transitions_source"] == "known table for digits"
    write_patterns(tmp_path / "patterns", 20)  # classes c0..c4: no known table
    other = CliRunner().invoke(main, ["audit", "--images", str(tmp_path / "patterns"), "--model", str(model),
                                      "--label-noise", "asymmetric:0.3"])
    assert other.exit_code == 1 and "--label-noise-transitions is needed" in other.output, other.output


def test_a_folder_of_one_class_is_refused(tmp_path):
    write_digits(tmp_path / "one", 3)
    for path in list((tmp_path / "one").rglob("*.png")):
        (tmp_path / "one" / "only").mkdir(exist_ok=True)
        path.rename(tmp_path / "one" / "only" / path.name)
    result = CliRunner().invoke(main, ["audit", "--images", str(tmp_path / "one"), "--model",
                                       str(projection_model(tmp_path))])
    assert result.exit_code == 1 and "at least 2 class sub-folders" in result.output, result.output


DOLLAR_LABELS = (r"$\badcommand$", "$x^$", "$" + "{" * 500 + "x" + "}" * 500 + "$", "$x$")  # digits 0-3's labels


@pytest.fixture(scope="module")
def dollar_index(tmp_path_factory):
    """200 digits indexed from a manifest whose labels for digits 0-3 hold dollar signs (mathtext to matplotlib),
    two images of each of those digits labelled as another of them: the audit's suspects carry those labels."""
    root = tmp_path_factory.mktemp("dollars")
    paths = write_digits(root / "gallery", 200)
    swap = {0: 1, 1: 0, 2: 3, 3: 2}
    rows, swapped = [], {digit: 0 for digit in swap}
    for path in paths:
        digit = int(path.parent.name)
        if digit in swap and swapped[digit] < 2:
            swapped[digit] += 1
            digit = swap[digit]
        label = DOLLAR_LABELS[digit] if digit < len(DOLLAR_LABELS) else str(digit)
        rows.append({"path": path.relative_to(root / "gallery").as_posix(), "label": label})
    with (root / "gallery" / "manifest.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["path", "label"])
        writer.writeheader()
        writer.writerows(rows)
    build_index(root / "gallery" / "manifest.csv", root / "index", model=projection_model(root), options=QUICK)
    return root / "index"


def test_index_audit_draws_labels_holding_dollar_signs_as_text(dollar_index, tmp_path):
    picture = tmp_path / "suspects.png"
    result = CliRunner().invoke(main, ["index", "audit", str(dollar_index), "--json", "--out", str(picture)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    drawn = summary["suspects"][:8]  # the picture's rows
    assert {label for s in drawn for label in (s["label"], s["suggested"])} >= {r"$\badcommand$", "$x^$"}
    assert summary["picture"] == str(picture) and Image.open(picture).size[1] > 300
    people = CliRunner().invoke(main, ["index", "audit", str(dollar_index), "--out", str(tmp_path / "again.png")])
    assert people.exit_code == 0, people.output
    assert (tmp_path / "again.png").is_file()


def test_a_folder_audit_draws_class_folders_named_with_dollar_signs(tmp_path):
    for path in write_digits(tmp_path / "train", 150):  # every label but the deep braces (too long for a name)
        digit = int(path.parent.name)
        if digit < 3:
            target = tmp_path / "train" / (r"$\badcommand$", "$x^$", "$x$")[digit] / path.name
            target.parent.mkdir(exist_ok=True)
            path.rename(target)
    for digit in "012":
        (tmp_path / "train" / digit).rmdir()
    picture = tmp_path / "suspects.png"
    result = CliRunner().invoke(main, ["audit", "--images", str(tmp_path / "train"), "--model",
                                       str(projection_model(tmp_path)), "--label-noise", "symmetric:0.3", "--json",
                                       "--out", str(picture)])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    drawn = summary["suspects"][:8]  # the picture's rows
    assert {label for s in drawn for label in (s["label"], s["suggested"])} & {r"$\badcommand$", "$x^$"}
    assert summary["picture"] == str(picture) and Image.open(picture).size[1] > 300
