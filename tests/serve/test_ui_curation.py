"""The Evaluation tab's near-duplicate groups and label suspects of the served index: auto verifies the planted copies
(a precision per group, the features and correlation per copy) and lists the candidates that are not copies with the
reason, a typed cosine gives the unverified groups, the paths the API shows, a bad threshold answered in place, and
the copies verified once per state, one verification at a time, a click while it runs answered at once."""

from __future__ import annotations

import threading

import pytest
from planted import flip, plant, projection_model, write_digits

from retrieval.index import IngestOptions, build_index
from retrieval.index.curation.copy_planting import VERIFICATION_KINDS
from retrieval.serve import curation_view
from retrieval.serve.curation_view import ThresholdError, parse_threshold
from retrieval.serve.service import SearchService
from retrieval.serve.ui.evaluation import EvaluationTab


@pytest.fixture(scope="module")
def curated(tmp_path_factory):
    """200 digits, 4 with a resized and a re-encoded copy beside them, 8 moved into the next digit's folder; served
    by the projection model: (service, {original's name: its copies' names}, {flipped name: true digit})."""
    root = tmp_path_factory.mktemp("curated")
    paths = write_digits(root / "gallery", 200)
    planted = plant(paths[1:200:50], ("resized", "jpeg"))
    moved = flip(paths[5:200:25])
    build_index(root / "gallery", root / "index", model=projection_model(root),
                options=IngestOptions(batch_size=32, workers=0, progress=False))
    service = SearchService(root / "index")
    yield (service, {k.name: {p.name for p in v} for k, v in planted.items()},
           {path.name: true for path, true in moved.items()})
    service.close()


def test_the_threshold_box_takes_auto_or_a_cosine():
    assert parse_threshold("auto") == parse_threshold(" ") == "auto" and parse_threshold("0.9") == 0.9
    for bad in ("1.5", "nan", "high", "-2"):
        with pytest.raises(ThresholdError, match="auto or a cosine between -1 and 1"):
            parse_threshold(bad)


def groups_of(rows: list[list], columns: int) -> dict[int, list[list]]:
    """The table's rows by group number, each of ``columns`` cells, with the API's relative paths and digit labels."""
    groups: dict[int, list[list]] = {}
    for row in rows:
        assert len(row) == columns, row
        path, label = row[4], row[3]
        assert "/" in path and not path.startswith("/") and label.isdigit(), row  # the API's relative paths
        groups.setdefault(row[0], []).append(row)
    return groups


def name(path: str) -> str:
    return path.rsplit("/", 1)[1]


def test_a_typed_cosine_gives_the_unverified_groups(curated):
    service, planted, _ = curated
    tab = EvaluationTab(service, None)
    text, table, picture, similar_text, similar_table, similar_picture = tab.near_duplicates("0.997")
    assert "**4 groups of near-duplicates** (8 copies)" in text and "(as typed)" in text
    assert "**not verified** as copies" in text
    assert table.constructor_args["headers"][-1] == "cosine to the first"  # no verification columns
    groups = groups_of(table.constructor_args["value"], 6)
    found = {name(members[0][4]): {name(row[4]) for row in members[1:]} for members in groups.values()}
    assert found == planted
    assert all(members[0][1] == "kept" and members[0][5] == pytest.approx(1.0) for members in groups.values())
    assert picture.constructor_args["visible"] is True and picture.constructor_args["value"].size[0] > 300
    # nothing was verified, so there are no "similar, not copies" pairs to show
    assert similar_text["visible"] is False and similar_table.constructor_args["visible"] is False
    assert similar_picture.constructor_args["visible"] is False
    assert not tab.curation._verified  # a typed cosine plants nothing
    bad, hidden, *rest = tab.near_duplicates("very")
    assert "auto or a cosine" in bad and hidden.constructor_args["visible"] is False and len(rest) == 4


REASONS = {"no geometric agreement", "no plausible alignment", "content differs", "colours differ", "unreadable image"}


def test_auto_verifies_the_planted_copies_and_lists_the_similar_pairs_apart(curated, monkeypatch):
    service, planted, _ = curated
    tab = EvaluationTab(service, None)
    real_calibrate, real_find = curation_view.calibrate_verification, curation_view.find_duplicates
    calibrations, calls, summaries = [], [], []

    def calibrate(*args, **kwargs):
        calibrations.append(real_calibrate(*args, **kwargs))
        return calibrations[-1]

    def find(*args, **kwargs):  # a later click answers the first's summary: what it is given is the point
        calls.append(kwargs)
        if not summaries:
            summaries.append(real_find(*args, **kwargs))
        return summaries[0]

    monkeypatch.setattr(curation_view, "calibrate_verification", calibrate)
    monkeypatch.setattr(curation_view, "find_duplicates", find)
    text, table, picture, similar_text, similar_table, similar_picture = tab.near_duplicates("auto")
    assert len(calibrations) == 1 and calls[0]["verification"] is calibrations[0]
    rules = calibrations[0].rules
    assert "groups of verified copies**" in text and "candidate pairs (one among the other's 10 nearest" in text
    assert f"cosine ≥ **{calibrations[0].candidate_cosine:.3f}**" in text
    assert f"calibrated (auto) on {50 * len(VERIFICATION_KINDS)} copies planted of 50 gallery images" in text
    assert "% of them found and verified" in text and "wrongly verified" in text
    headers = table.constructor_args["headers"]
    assert headers[-3:] == ["features agreeing (inliers)", "aligned correlation", "estimated precision (group)"]
    groups = groups_of(table.constructor_args["value"], 9)
    assert groups, text  # digits other than the plain 1s keep enough features for their copies to verify
    members_of = [{name(row[4]) for row in members} for members in groups.values()]
    for members in groups.values():
        kept, copies = members[0], members[1:]
        # a verified group is one planted original, kept first, and copies of it: never two distinct digits
        assert kept[1] == "kept" and name(kept[4]) in planted, members
        assert copies and {name(row[4]) for row in copies} <= planted[name(kept[4])], members
        assert 0 <= kept[8] <= 1 and kept[6] == kept[7] == ""  # the group's precision; the first is not compared
        for row in copies:
            assert row[1] == "copy" and row[6] >= rules.min_inliers and row[7] >= rules.correlation, row
            assert row[8] == ""
    assert picture.constructor_args["visible"] is True and picture.constructor_args["value"].size[0] > 300
    # the candidates that failed: a table of pairs with the reason, highest cosine first, none inside a group
    assert similar_text["visible"] is True and "Similar, not copies — for a person to look at" in similar_text["value"]
    assert "candidate pairs are similar but not copies**" in similar_text["value"]
    pairs = similar_table.constructor_args["value"]
    assert pairs and all(len(pair) == 10 and pair[7] in REASONS for pair in pairs)
    assert [pair[6] for pair in pairs] == sorted((pair[6] for pair in pairs), reverse=True)
    listed = {frozenset((name(pair[2]), name(pair[5]))) for pair in pairs}
    assert not any(pair <= members for pair in listed for members in members_of)
    # every planted copy is accounted for: verified with its original, or shown to a person beside it
    for original, copies in planted.items():
        for copy in copies:
            together = any({original, copy} <= members for members in members_of)
            assert together or frozenset((original, copy)) in listed, (original, copy)
    assert similar_picture.constructor_args["visible"] is True
    # a second click shows the answer kept for this state: nothing planted or compared again
    again = tab.near_duplicates("auto")
    assert len(calibrations) == 1 and len(calls) == 1 and again[0] == text


def test_a_click_while_the_copies_are_verified_is_answered_at_once_and_the_answer_kept(curated, monkeypatch):
    """A click while another click's verification runs is told so at once (it neither waits for it, holding its
    place in the app's queue, nor starts a second one); once done, the answer is kept for the state served."""
    service, _, _ = curated
    tab = EvaluationTab(service, None)
    started, release, calls = threading.Event(), threading.Event(), []

    def find(*args, **kwargs):  # a verification that lasts until released
        calls.append(kwargs)
        started.set()
        assert release.wait(60)
        return {"groups": []}

    monkeypatch.setattr(curation_view, "calibrate_verification", lambda *args, **kwargs: "calibrated")
    monkeypatch.setattr(curation_view, "find_duplicates", find)
    monkeypatch.setattr(curation_view, "copies_picture", lambda *args: "groups picture")
    monkeypatch.setattr(curation_view, "similar_picture", lambda *args: "pairs picture")
    first, answered = [], []
    clicking = threading.Thread(target=lambda: first.append(tab.curation.duplicates("auto")))
    clicking.start()
    try:
        assert started.wait(60)
        other = threading.Thread(target=lambda: answered.append(tab.near_duplicates("auto")), daemon=True)
        other.start()
        other.join(5)
        assert answered, "the second click waited for the first one's verification"
    finally:
        release.set()
        clicking.join(60)
    text, table, picture, *_ = answered[0]
    assert "being verified already" in text and "its answer then shows at once" in text  # said whole
    assert table.constructor_args["visible"] is False and picture.constructor_args["visible"] is False
    assert first == [({"groups": []}, "groups picture", "pairs picture")] and len(calls) == 1
    assert tab.curation.duplicates("auto") is first[0] and len(calls) == 1  # kept for the state served


def test_label_suspects_rank_the_flipped_images_first(curated):
    service, _, flipped = curated
    text, table, picture = EvaluationTab(service, None).label_suspects()
    assert "label suspects** among 208 labelled images" in text
    rows = table.constructor_args["value"]
    top = rows[: len(flipped)]
    hits = [row for row in top if row[6].rsplit("/", 1)[1] in flipped]
    assert len(hits) >= 6  # of the 8 flipped, in the top 8
    # the suggestion: mostly the true digit (a raw-pixel model may take a badly written 1 for a 7)
    assert sum(row[3] == flipped[row[6].rsplit("/", 1)[1]] for row in hits) >= len(hits) - 1, (top, flipped)
    assert [row[4] for row in rows] == sorted((row[4] for row in rows), reverse=True)
    assert picture.constructor_args["visible"] is True
