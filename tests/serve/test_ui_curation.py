"""The Evaluation tab's near-duplicate groups and label suspects of the served index: planted copies found, flipped
labels at the top, the paths the API shows, a bad threshold answered in place, and each computed once per state."""

from __future__ import annotations

import pytest
from planted import flip, plant, projection_model, write_digits

from retrieval.index import IngestOptions, build_index
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


def test_near_duplicate_groups_are_the_planted_copies(curated):
    service, planted, _ = curated
    tab = EvaluationTab(service, None)
    text, table, picture = tab.near_duplicates("0.997")
    assert "**4 groups of near-duplicates** (8 copies)" in text and "(as typed)" in text
    rows = table.constructor_args["value"]
    groups = {}
    for group, role, _, label, path, similarity in rows:
        groups.setdefault(group, []).append((role, path.rsplit("/", 1)[1], similarity))
        assert "/" in path and not path.startswith("/") and label.isdigit()  # the API's relative paths
    found = {members[0][1]: {name for _, name, _ in members[1:]} for members in groups.values()}
    assert found == planted
    assert all(members[0][0] == "kept" and members[0][2] == pytest.approx(1.0) for members in groups.values())
    assert picture.constructor_args["visible"] is True and picture.constructor_args["value"].size[0] > 300
    auto_text, auto_table, _ = tab.near_duplicates("auto")
    assert "calibrated (auto) on 200 copies planted of 50 gallery images" in auto_text
    assert tab.curation._calibration is not None  # kept for this state: a second click embeds nothing
    calibration = tab.curation._calibration
    tab.near_duplicates("auto")
    assert tab.curation._calibration is calibration
    bad, hidden, _ = tab.near_duplicates("very")
    assert "auto or a cosine" in bad and hidden.constructor_args["visible"] is False


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
