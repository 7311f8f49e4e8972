"""The Gradio app's pieces without a browser: label names, upload decoding, leave-one-out ranks, duplicates, units."""

from __future__ import annotations

import base64
import html
import json
import shutil
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest
from fastapi.testclient import TestClient
from serve_fixtures import QUERY_PNG, require_emoji_labels

from retrieval.data.emoji import emoji_name
from retrieval.data.synthetic import bomb_png
from retrieval.index.catalogue import CatalogueReader
from retrieval.serve.api import create_api
from retrieval.serve.diagnostics import duplicates
from retrieval.serve.reports import load_report, percent
from retrieval.serve.service import SearchService
from retrieval.serve.ui import EvaluationTab, ExampleSet, GalleryFacts, SearchTab
from retrieval.serve.upload_cache import UploadRecords

pytestmark = pytest.mark.timeout(300)
MAX_UPLOAD = 200_000  # the upload limit of conftest's ``service``


@pytest.fixture(scope="module")
def search_tab(service, tmp_path_factory):
    return SearchTab(service, ExampleSet(service, tmp_path_factory.mktemp("examples"), count=2),
                     UploadRecords(gr.Blocks()))


def uploaded(tab: SearchTab, path) -> dict[str, str]:
    """``path`` as Gradio's upload route records a file it saved, and the reference the page then sends."""
    tab.uploads.blocks.upload_file_set.add(str(path))
    return {"path": str(path), "orig_name": "upload.png"}


# --- label names ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("label", "name"),
    [
        ("1F600", "GRINNING FACE"),
        ("1F469-200D-1F52C", "WOMAN + MICROSCOPE"),  # ZWJ sequence: parts joined with +
        ("2764-FE0F", "HEAVY BLACK HEART"),  # the variation selector is not part of the name
        ("1F1EC-1F1E7", "FLAG: GB"),  # two regional indicators
        ("0023-FE0F-20E3", "KEYCAP NUMBER SIGN"),
        ("1F3F4-E0067-E0062-E0065-E006E-E0067-E007F", "WAVING BLACK FLAG (GB-ENG)"),  # tag sequence
        ("E000", None),  # private use: no Unicode name, no guess
        ("cat", None),
        ("001.Black_footed_Albatross", None),
    ],
)
def test_emoji_names_from_unicodedata(label, name):
    assert emoji_name(label) == name


def test_labels_are_shown_with_names_only_for_code_point_galleries(artifacts, service):
    facts = GalleryFacts.of(service)
    assert facts.images == len(service) and facts.classes == len(set(artifacts.labels))
    plain = GalleryFacts(3, 3, 2, ["cat"], None, None, unicode_labels=False)
    assert plain.label_text("1F600") == "1F600" and plain.label_text(None) == "(no label)"
    intro = facts.intro_markdown(service)
    for fact in (f"{len(service)} images", f"{facts.classes} classes", "index.json", "upload or paste",
                 "examples", "cosine similarity", "L2-normalised", "1 = identical direction"):
        assert fact in intro, fact


def test_an_emoji_gallery_shows_labels_with_their_unicode_names(artifacts, service):
    require_emoji_labels(artifacts.labels)
    facts = GalleryFacts.of(service)
    label = artifacts.labels[0]
    assert facts.unicode_labels and facts.label_text(label) == f"{label} · {emoji_name(label)}"
    assert facts.dataset is not None and facts.dataset["dataset"] == "emoji"
    # what a query should find comes from the data set's info.json, not from the UI knowing the emoji set
    assert "a query should find the same emoji drawn by the other artist" in facts.intro_markdown(service)


class DigitsState:
    """A served state of a digits gallery (class folders 0-9) as ``GalleryFacts`` reads it, without an index."""

    def __init__(self, folder) -> None:
        rows = [(i, str(i % 10)) for i in range(20)]
        self.catalogue = SimpleNamespace(
            labelled=lambda: rows,
            sample=lambda n: [{"path": str(folder / label / f"digit_{i:04d}.png")} for i, label in rows[:n]],
        )

    def __len__(self) -> int:
        return 20


def test_a_digits_gallery_shows_its_labels_as_they_are(tmp_path):
    facts = GalleryFacts.of_state(DigitsState(tmp_path / "digits"))
    assert facts.classes == 10 and not facts.unicode_labels
    assert facts.label_text("7") == "7" and facts.label_name("7") is None


# --- uploads: the API's decoder and the API's messages --------------------------------------------------------
def bad_uploads() -> dict[str, bytes]:
    good = QUERY_PNG
    return {
        "text named .png": b"hello, I am not an image\n",
        "empty file": b"",
        "truncated": good[: len(good) // 2],
        "decompression bomb": bomb_png(4000, 4000),
        "too large": b"\x89PNG\r\n\x1a\n" + bytes(MAX_UPLOAD),
    }


@pytest.mark.parametrize("kind", list(bad_uploads()))
def test_bad_uploads_get_the_api_message(service, search_tab, tmp_path, kind):
    data = bad_uploads()[kind]
    with TestClient(create_api(service)) as client:  # the API's multipart upload, as the page uploads a file
        api = client.post("/search?k=3", files={"image": ("upload.png", data, "image/png")})
    assert 400 <= api.status_code < 500
    path = tmp_path / "upload.png"
    path.write_bytes(data)
    with pytest.raises(gr.Error) as raised:
        search_tab.search(uploaded(search_tab, path), 3)
    assert raised.value.message == html.escape(api.json()["detail"])
    assert raised.value.duration is None  # stays on screen until closed
    assert str(tmp_path) not in raised.value.message and "Traceback" not in raised.value.message


def test_no_upload_asks_for_an_image(search_tab):
    with pytest.raises(gr.Error, match="Upload, paste or pick an image"):
        search_tab.search(None, 3)


def test_a_pasted_data_url_is_decoded_like_an_upload(search_tab, artifacts):
    url = "data:image/png;base64," + base64.b64encode(artifacts.query_paths[0].read_bytes()).decode()
    items, text = search_tab.search({"url": url}, 4)
    assert len(items) == 4 and "4 results" in text


def test_search_results_name_the_labels(search_tab, artifacts):
    items, text = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5)
    captions = [caption for _, caption in items]
    assert len(captions) == 5 and all(c[0] in "✓✗" for c in captions)
    # every caption ends with the result's file name, the one the API gives as "name"
    api_names = [r["name"] for r in search_tab.service.search(artifacts.query_paths[1].read_bytes(), 5,
                                                               exclude_self=True).to_dict()["results"]]
    assert [caption.rsplit(" · ", 1)[1] for caption in captions] == api_names
    assert all(name.endswith((".png", ".jpg", ".jpeg", ".webp")) and "/" not in name for name in api_names)


def test_search_results_of_an_emoji_gallery_name_the_code_points(search_tab, artifacts):
    require_emoji_labels(artifacts.labels)
    items, text = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5)
    captions = [caption for _, caption in items]
    assert len(captions) == 5
    for caption in captions:  # mark score · label · code-point NAME · file name
        _, label, name, _ = caption.split(" · ")
        assert name == emoji_name(label)
    assert f"label **{artifacts.labels[1]}** · {emoji_name(artifacts.labels[1])}" in text


# --- Evaluation tab ------------------------------------------------------------------------------------------
def test_leave_one_out_ranks_of_the_first_correct_match_brute_force(artifacts, service):
    """Rank of the first same-label result per query, against an exact loop over the stored vectors."""
    from retrieval.serve.diagnostics import _vectors_of

    loo = service.leave_one_out()
    label_of = dict(service.current().catalogue.labelled())
    ids, vectors = _vectors_of(service.current().index, np.array(sorted(label_of), np.int64))
    scores = vectors @ vectors.T
    expected: dict[str, list[int]] = {}
    for row, own in enumerate(ids):
        order = [int(ids[j]) for j in np.argsort(-scores[row], kind="stable") if ids[j] != own]
        first = next(rank for rank, other in enumerate(order, 1) if label_of[other] == label_of[int(own)])
        expected.setdefault(label_of[int(own)], []).append(min(first, loo.classes[0].depth + 1))
    for c in loo.classes:
        assert c.first_ranks == expected[c.label]
        assert c.correct == sum(rank == 1 for rank in c.first_ranks)
    keys = [(c.recall_at_1, -c.mean_first_rank) for c in loo.classes]
    assert keys == sorted(keys)  # worst Recall@1 first, then the farthest first correct result


def test_worst_classes_table_is_ordered_and_named(artifacts, service):
    summary, table, failures = EvaluationTab(service, artifacts.report).worst_classes()
    pairs = failures.constructor_args["value"]
    assert failures.constructor_args["visible"] == bool(pairs)
    assert "mean rank of the first" in summary and "%" in summary
    rows = table.constructor_args["value"]
    assert table.constructor_args["headers"][3] == "Recall@1 (%)"
    keys = [(row[3], -row[4]) for row in rows]
    assert keys == sorted(keys)
    assert all(0 <= row[3] <= 100 for row in rows)


def test_worst_classes_of_an_emoji_gallery_are_named(artifacts, service):
    require_emoji_labels(artifacts.labels)
    _, table, failures = EvaluationTab(service, artifacts.report).worst_classes()
    rows, pairs = table.constructor_args["value"], failures.constructor_args["value"]
    assert rows
    assert all(" · " in row[0] for row in rows) and all(" · " in caption for _, caption in pairs)


def test_metrics_are_percent_and_map_at_r_is_explained(artifacts, service):
    report = load_report(artifacts.report)
    raw = json.loads(artifacts.report.read_text())["last"]
    rows = {row[0]: row[-1] for row in report.metrics_table()[1]}
    assert rows["recall@1"] == percent(raw["recall@1"]) == round(100 * raw["recall@1"], 1)
    summary = EvaluationTab(service, artifacts.report).open_report(str(artifacts.report))[0]
    # two images per class: one relevant item per query, so MAP@R = Recall@1, and the page says why
    assert report.map_equals_recall() and "Why MAP@R equals Recall@1" in summary and "R = 1" in summary


def test_duplicates_are_listed_with_their_twins(artifacts, tmp_path):
    from retrieval.index import IngestOptions, build_index

    gallery = tmp_path / "gallery"
    sources = artifacts.query_paths[:4]
    for i, source in enumerate(sources):
        (gallery / artifacts.labels[i]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, gallery / artifacts.labels[i] / f"{i}.png")
    (gallery / "copies").mkdir()
    shutil.copyfile(sources[0], gallery / "copies" / "same-bytes.png")  # the twin of 0.png
    build_index(gallery, tmp_path / "index", model=artifacts.model,
                options=IngestOptions(batch_size=8, workers=0, progress=False))
    with CatalogueReader(tmp_path / "index" / "catalogue.sqlite") as catalogue:
        total, found = duplicates(catalogue)
    assert total == 1 and len(found) == 1
    (copy,) = found
    assert {copy.label, copy.twin_label} == {"copies", artifacts.labels[0]}  # whichever was indexed first
    assert {copy.path, copy.twin_path} == {str(gallery / "copies" / "same-bytes.png"),
                                           str(gallery / artifacts.labels[0] / "0.png")}
    svc = SearchService(tmp_path / "index")
    try:
        text, table = EvaluationTab(svc, None).duplicates()
    finally:
        svc.close()
    assert "Skipped as duplicates: 1" in text
    (row,) = table.constructor_args["value"]
    assert row[0] == copy.id and row[3] == copy.twin_id


def test_no_server_path_reaches_the_page_or_the_stats(artifacts, tmp_path):
    """The opening lines, the Index tab and GET /stats name the gallery, the index and the model by file name and
    bad files relative to the gallery: a visitor learns no folder of the server (docs/SECURITY.md's threat model)."""
    from retrieval.index import IngestOptions, build_index
    from retrieval.serve.ui import IndexTab

    gallery = tmp_path / "secret-folder" / "gallery"
    for i, source in enumerate(artifacts.query_paths[:3]):
        (gallery / artifacts.labels[i]).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, gallery / artifacts.labels[i] / f"{i}.png")
    (gallery / "broken").mkdir()
    (gallery / "broken" / "not-an-image.png").write_bytes(b"hello, I am text\n")
    build_index(gallery, tmp_path / "index", model=artifacts.model,
                options=IngestOptions(batch_size=8, workers=0, progress=False))
    svc = SearchService(tmp_path / "index")
    try:
        intro = GalleryFacts.of(svc).intro_markdown(svc)
        _, shown = IndexTab(svc).stats()
        with TestClient(create_api(svc)) as client:
            served = client.get("/stats").json()
    finally:
        svc.close()
    assert "`gallery`" in intro and "`index`" in intro
    assert [row["path"] for row in shown["error_examples"]] == ["broken/not-an-image.png"]
    for text in (intro, json.dumps(shown), json.dumps(served)):
        assert str(tmp_path) not in text and "secret-folder" not in text


def tab_labels(demo) -> list[str]:
    return [block.label for block in demo.blocks.values() if isinstance(block, gr.Tab)]


def test_a_users_own_index_gets_no_results_tab_and_no_empty_report_parts(service, tmp_path):
    """The project's results grid is the demo's, not a user's index's; without a report the Evaluation tab's table
    and pictures are hidden, not empty, and the index's own analysis has its own heading."""
    from retrieval.serve.ui import EvaluationTab, build_ui

    (tmp_path / "examples").mkdir()
    (tmp_path / "examples2").mkdir()
    demo, _ = build_ui(service, report=None, example_dir=tmp_path / "examples", results=None)
    assert "Results" not in tab_labels(demo) and "Evaluation" in tab_labels(demo)
    demo, _ = build_ui(service, report=None, example_dir=tmp_path / "examples2", results=tmp_path / "grid.json")
    assert "Results" in tab_labels(demo)  # asked for: shown (with the reason if it cannot be read)
    shown = EvaluationTab(service, None).open_report("")
    assert shown[0].startswith("No run report is open")
    assert all(part["visible"] is False for part in shown[1:])
    headings = [block.value or "" for block in demo.blocks.values() if isinstance(block, gr.Markdown)]
    assert any(text.startswith("## Run report") for text in headings)
    assert any(text.startswith(f"## The index being served ({service.index_dir.name})") for text in headings)


def test_the_filter_picker_and_box_make_one_where_that_quotes_labels():
    """The app's label picker and where box become one expression of the filter language; a label holding a
    quote is quoted, not able to end the string; anything but a list of labels is refused."""
    from retrieval.index.filters import parse_filter
    from retrieval.serve.images import QueryError

    assert SearchTab.where([], "") is None and SearchTab.where(None, "  ") is None
    assert SearchTab.where(["cat"], "") == 'label in ("cat")'
    combined = SearchTab.where(['a"b', "c"], 'split = "test" or id < 3')
    assert combined == 'label in ("a""b", "c") and (split = "test" or id < 3)'
    assert parse_filter(combined).columns() == ["label", "split", "id"]
    for bad in ("cat", [3], [["x"]]):
        with pytest.raises(QueryError, match="list of labels"):
            SearchTab.where(bad, "")
    with pytest.raises(QueryError, match="at most 1000 labels"):
        SearchTab.where(["x"] * 1001, "")
