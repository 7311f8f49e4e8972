"""The Gradio app's pieces without a browser: label names, upload decoding, leave-one-out ranks, duplicates, units."""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
from types import SimpleNamespace
from typing import Any

import gradio as gr
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from serve_fixtures import QUERY_PNG, require_emoji_labels, shared_full_report

from retrieval.data.emoji import emoji_name
from retrieval.data.synthetic import bomb_png
from retrieval.index.catalogue_reader import CatalogueReader
from retrieval.serve.api import create_api
from retrieval.serve.diagnostics import duplicates
from retrieval.serve.page_text import markdown_text, percent
from retrieval.serve.report_files import load_report
from retrieval.serve.service import SearchService
from retrieval.serve.ui.evaluation import EvaluationTab
from retrieval.serve.ui.search import ExampleSet, SearchTab
from retrieval.serve.ui.shared import MAX_ERROR_CHARS, GalleryFacts
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
    assert "marked ✓ (the same emoji)" in facts.intro_markdown(service)


def test_a_gallery_labelled_by_subgroup_is_read_and_marked_by_subgroup(artifacts, service):
    """The same data set's index built for its subgroup reading (labels are subgroup names, not code points): the
    page says so and what a ✓ means, from the data set's info.json."""
    require_emoji_labels(artifacts.labels)
    twin = GalleryFacts.of(service)
    by_subgroup = dataclasses.replace(twin, unicode_labels=False, example_labels=["face-smiling"])
    assert by_subgroup.purpose() == "Find emoji of the same kind: a smiling face finds smiling faces."
    intro = by_subgroup.intro_markdown(service)
    assert "marked ✓ (the same Unicode subgroup)" in intro and "labelled by its Unicode subgroup" in intro
    assert twin.purpose() == "Find the same emoji drawn by another artist."


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
def test_bad_uploads_get_the_api_message_inline_and_leave_the_query_box(service, search_tab, tmp_path, kind):
    """The page's status line says what the API says, in place of the previous results; the unreadable file leaves
    the query box (the browser would show it as a broken image)."""
    data = bad_uploads()[kind]
    with TestClient(create_api(service)) as client:  # the API's multipart upload, as the page uploads a file
        api = client.post("/search?k=3", files={"image": ("upload.png", data, "image/png")})
    assert 400 <= api.status_code < 500
    path = tmp_path / "upload.png"
    path.write_bytes(data)
    items, status, query = search_tab.search(uploaded(search_tab, path), 3)
    assert items == [] and query is None
    assert status.startswith("⚠️ **Cannot search with this image `upload.png`:**"), status
    assert markdown_text(api.json()["detail"], MAX_ERROR_CHARS) in status
    assert str(tmp_path) not in status and "Traceback" not in status


def test_no_upload_asks_for_an_image(search_tab):
    items, status, _ = search_tab.search(None, 3)
    assert items == [] and "Upload, paste or pick an image" in status


def test_a_bad_k_or_filter_keeps_the_query_image(search_tab, artifacts):
    """Only an unreadable image leaves the query box: a K or filter problem is the visitor's to fix beside it."""
    query = uploaded(search_tab, artifacts.query_paths[0])
    items, status, kept = search_tab.search(query, 0)
    assert items == [] and "K must be a whole number" in status and kept is not None
    items, status, kept = search_tab.search(query, 3, None, "label ==")
    assert items == [] and status.startswith("⚠️ **Cannot use this filter:**") and kept is not None
    assert "compare with one" in status


def test_a_pasted_data_url_is_decoded_like_an_upload(search_tab, artifacts):
    url = "data:image/png;base64," + base64.b64encode(artifacts.query_paths[0].read_bytes()).decode()
    items, text, _ = search_tab.search({"url": url}, 4)
    assert len(items) == 4 and "4 results" in text


def test_search_results_are_captioned_with_the_path_the_api_and_filters_use(search_tab, artifacts):
    items, text, _ = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5)
    captions = [caption for _, caption in items]
    assert len(captions) == 5 and all(c[0] in "✓✗" for c in captions)
    answer = search_tab.service.search(artifacts.query_paths[1].read_bytes(), 5, exclude_self=True).to_dict()
    api_paths = [r["path"] for r in answer["results"]]
    assert [caption.rsplit(" · ", 1)[1] for caption in captions] == api_paths
    assert all("/" in path and not path.startswith("/") for path in api_paths)  # relative to the gallery root
    assert f"`{answer['query_item']['path']}`" in text  # the query's own path, as the API gives it
    # each path, copied into the filter box, finds that very image
    for path in api_paths:
        found, _, _ = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5, None,
                                        f'path = "{path}"')
        assert [caption.rsplit(" · ", 1)[1] for _, caption in found] == [path]


def test_a_filter_matching_no_image_says_how_paths_and_labels_compare(search_tab, artifacts):
    items, text, _ = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5, None,
                                       f'path = "{artifacts.query_paths[1].name}"')  # a bare file name
    assert items == []
    table = search_tab.service.current().index.filter_table
    assert "the filter matches no image of the index" in text and "relative to the gallery" in text
    assert markdown_text(f'path = "{table.example("path")}"', MAX_ERROR_CHARS) in text  # one of its own paths


def test_a_filter_matching_only_the_query_says_so(search_tab, artifacts):
    known = search_tab.service.query_item(artifacts.query_paths[1].read_bytes())
    items, text, _ = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5, None, f"id = {known.id}")
    assert items == [] and "Only the query image itself matches the filter" in text


def test_a_query_unlike_the_gallery_is_told_so_and_a_near_copy_is_not(search_tab, artifacts, tmp_path):
    """The hint compares the best score with how close the gallery's own images are to their nearest neighbour."""
    flat = tmp_path / "red.png"
    flat.write_bytes(QUERY_PNG)  # a flat red square: nothing like emoji or digits
    items, text, _ = search_tab.search(uploaded(search_tab, flat), 3)
    floor = search_tab.service.current().neighbour_scores().floor
    best = float(items[0][1].split(" · ")[0])
    assert best < floor and "Nothing in the gallery is much like this image" in text
    assert f"{floor:.3f} or more" in text
    near = tmp_path / "near.jpg"  # a gallery image saved again as JPEG: other bytes, nearly the same picture
    Image.open(artifacts.query_paths[3]).convert("RGB").save(near, quality=90)
    items, text, _ = search_tab.search(uploaded(search_tab, near), 3)
    assert "Query is gallery image" not in text and "much like this image" not in text
    _, text, _ = search_tab.search(uploaded(search_tab, flat), 3, [artifacts.labels[0]])
    assert "Nothing among the images matching the filter is much like this image" in text


def test_neighbour_scores_are_each_images_nearest_other_brute_force(service):
    """The yardstick: per indexed image, the best cosine to another image (exact on the Flat index), its 1st
    percentile and median."""
    from retrieval.serve.diagnostics import UNLIKE_QUANTILE

    state = service.current()
    ids, vectors = state.index.stored_rows(np.asarray(state.index.ids))
    scores = vectors @ vectors.T
    np.fill_diagonal(scores, -np.inf)
    nearest = scores.max(axis=1)
    found = state.neighbour_scores()
    assert found.images == len(ids) and not found.sampled
    assert found.floor == pytest.approx(np.quantile(nearest, UNLIKE_QUANTILE), abs=1e-5)
    assert found.median == pytest.approx(np.median(nearest), abs=1e-5)
    assert found.unlike(found.floor - 0.01) and not found.unlike(found.floor)


def test_search_results_of_an_emoji_gallery_name_the_code_points(search_tab, artifacts):
    require_emoji_labels(artifacts.labels)
    items, text, _ = search_tab.search(uploaded(search_tab, artifacts.query_paths[1]), 5)
    captions = [caption for _, caption in items]
    assert len(captions) == 5
    for caption in captions:  # mark score · label · code-point NAME · file name
        _, label, name, _ = caption.split(" · ")
        assert name == emoji_name(label)
    assert f"label **{artifacts.labels[1]}** · {emoji_name(artifacts.labels[1])}" in text


# --- Evaluation tab ------------------------------------------------------------------------------------------
def test_leave_one_out_ranks_of_the_first_correct_match_brute_force(artifacts, service):
    """Rank of the first same-label result per query, against an exact loop over the stored vectors."""
    loo = service.leave_one_out()
    label_of = dict(service.current().catalogue.labelled())
    ids, vectors = service.current().index.stored_rows(np.array(sorted(label_of), np.int64))
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
    # each failure's images are named by the paths the API and filters use
    paths = set(service.current().index.filter_table.column("path").categories)
    assert all(caption.rsplit(" · ", 1)[1] in paths for _, caption in pairs), [c for _, c in pairs]


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
        text, fold, table = EvaluationTab(svc, None).duplicates()
    finally:
        svc.close()
    assert "Skipped as duplicates: 1" in text and fold.constructor_args["visible"] is True
    (row,) = table.constructor_args["value"]
    assert row[0] == copy.id and row[3] == copy.twin_id
    # the paths the API and filters use, relative to the gallery root
    assert {row[2], row[5]} == {"copies/same-bytes.png", f"{artifacts.labels[0]}/0.png"}


def test_no_server_path_reaches_the_page_or_the_stats(artifacts, tmp_path):
    """The opening lines, the Index tab and GET /stats name the gallery, the index and the model by file name and
    bad files relative to the gallery: a visitor learns no folder of the server (docs/SECURITY.md's threat model)."""
    from retrieval.index import IngestOptions, build_index
    from retrieval.serve.ui.index import IndexTab

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
    assert [row["path"] for row in served["index"]["error_examples"]] == ["broken/not-an-image.png"]
    assert "| broken/not-an-image.png |" in shown  # the Index tab's statistics, by the same path
    for text in (intro, shown, json.dumps(served)):
        assert str(tmp_path) not in text and "secret-folder" not in text


def tab_labels(demo) -> list[str]:
    return [block.label for block in demo.blocks.values() if isinstance(block, gr.Tab)]


def markdown_texts(demo) -> list[str]:
    return [block.value or "" for block in demo.blocks.values() if isinstance(block, gr.Markdown)]


def visible(update: Any) -> bool | None:
    """Whether an event's update shows its component (a dict from gr.update, or a component instance)."""
    return update.get("visible") if isinstance(update, dict) else update.constructor_args.get("visible")


def test_a_users_own_index_gets_no_results_tab_and_no_empty_report_parts(service, tmp_path):
    """The project's results grid is the demo's, not a user's index's; without a report the Evaluation tab's table
    and pictures are hidden, not empty, and the index's own analysis has its own heading."""
    from retrieval.serve.ui import build_ui
    from retrieval.serve.ui.evaluation import REPORT_PICTURES, EvaluationTab

    (tmp_path / "examples").mkdir()
    (tmp_path / "examples2").mkdir()
    demo, _ = build_ui(service, report=None, example_dir=tmp_path / "examples", results=None)
    assert "Results" not in tab_labels(demo) and "Evaluation" in tab_labels(demo)
    demo, _ = build_ui(service, report=None, example_dir=tmp_path / "examples2", results=tmp_path / "grid.json")
    assert "Results" in tab_labels(demo)  # asked for: shown (with the reason if it cannot be read)
    summary, metrics, pictures, *rest = EvaluationTab(service, None).open_report("")
    tabs, images, note = rest[: len(REPORT_PICTURES)], rest[len(REPORT_PICTURES) : -1], rest[-1]
    assert summary.startswith("No run report is open")
    assert not any(visible(part) for part in (metrics, pictures, *tabs, note))
    assert all(image["value"] is None for image in images)
    headings = markdown_texts(demo)
    assert any(text.startswith("## Run report") for text in headings)
    assert any(text.startswith(f"## The index being served ({service.index_dir.name})") for text in headings)


def test_the_page_names_the_results_tab_only_when_it_has_one(service, tmp_path):
    """The opening lines name the tabs that show metrics: the Results tab only on a page that has it."""
    from retrieval.serve.ui import build_ui

    for folder, results, named in (("plain", None, "Metrics (Evaluation and Index tabs)"),
                                   ("grid", tmp_path / "grid.json", "Metrics (Evaluation, Results and Index tabs)")):
        (tmp_path / folder).mkdir()
        demo, _ = build_ui(service, report=None, example_dir=tmp_path / folder, results=results)
        (intro,) = [text for text in markdown_texts(demo) if "**Score:**" in text]
        assert named in intro and ("Results" in intro) == (results is not None)


def test_the_demo_serves_the_projects_results_grid_it_promises(monkeypatch, tmp_path):
    """`retrieval demo` serves its index with the results grid `python app.py` shows on it: the Results tab the
    README and the page name."""
    from click.testing import CliRunner

    import retrieval.cli.demo
    import retrieval.serve.server
    from retrieval.cli.main import main
    from retrieval.serve.defaults import DEFAULT_RESULTS

    served = []
    monkeypatch.setattr(retrieval.cli.demo, "run_demo", lambda out, epochs=None: {})  # the artifacts: not built
    monkeypatch.setattr(retrieval.serve.server, "serve", served.append)
    answer = CliRunner().invoke(main, ["demo", "--out", str(tmp_path / "demo")])
    assert answer.exit_code == 0, answer.output
    (config,) = served
    assert config.index_dir == tmp_path / "demo" / "index"
    assert config.results == (DEFAULT_RESULTS if DEFAULT_RESULTS.is_file() else None)


def test_a_report_shows_each_picture_in_a_tab_and_says_what_the_map_draws(artifacts, service, tmp_path_factory):
    """The full report has every picture of a labelled run: each gets its tab; the embedding map's note says how
    many of the classes it draws and how they were chosen (from what the map recorded in its PNG)."""
    from retrieval.compatibility import compatibility_sentence
    from retrieval.serve.page_text import markdown_text
    from retrieval.serve.ui.evaluation import REPORT_PICTURES

    report = shared_full_report(tmp_path_factory)
    summary, metrics, pictures, *rest = EvaluationTab(service, report).open_report(str(report))
    # the --compatible-with run's verdict, in the words every command uses for report.json's record of it
    compatibility = json.loads(report.read_text())["last"]["compatibility"]
    assert compatibility["verdict"] == "not compatible"
    assert f"**Compatibility with the old model:** {markdown_text(compatibility_sentence(compatibility))}." in summary
    tabs, images, note = rest[: len(REPORT_PICTURES)], rest[len(REPORT_PICTURES) : -1], rest[-1]
    assert visible(metrics) and visible(pictures) and pictures.constructor_args["selected"] == "recall"
    label_free = {"moved", "pseudo_labels"}  # a run without labels draws these, this labelled one does not
    for picture, tab, image in zip(REPORT_PICTURES, tabs, images, strict=True):
        assert visible(tab) == (image["value"] is not None) == (picture.key not in label_free), picture.key
    classes = len({label for _, label in service.current().catalogue.labelled()})
    drawn = min(classes, 20)
    expected = (f"**The map shows {drawn} of the {classes} classes evaluated** (a random sample, seed 0"
                if drawn < classes else f"**The map shows all {classes} classes evaluated**")
    assert visible(note) and note["value"].startswith(expected), note["value"]
    assert "t-SNE" in note["value"]
    # a report without some of them (no --eval-extra, WiSE-FT or evaluation pictures) hides their tabs
    _, _, _, *rest = EvaluationTab(service, artifacts.report).open_report(str(artifacts.report))
    shown = {picture.key for picture, tab in zip(REPORT_PICTURES, rest, strict=False) if visible(tab)}
    assert shown == {"recall", "curves", "triplet"} and not visible(rest[-1])


def test_an_older_map_is_explained_from_the_reports_class_count(tmp_path):
    """A map drawn before maps recorded their sample: the note takes the class count from the report."""
    from retrieval.reports import REPORT_FORMAT
    from retrieval.serve.report_summary import embedding_map_note

    Image.new("RGB", (60, 40)).save(tmp_path / "embedding_map.png")
    (tmp_path / "report.json").write_text(json.dumps({
        "format": REPORT_FORMAT, "kind": "train", "plots": {"embedding_map": "embedding_map.png"},
        "class_split": {"test": {"classes": 983, "images": 1966}}}))
    note = embedding_map_note(load_report(tmp_path / "report.json"))
    assert note.startswith("**The map shows 20 of the 983 classes evaluated** (a random sample")


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


def test_a_report_shows_the_readings_beside_it_and_ignores_a_malformed_file(tmp_path):
    """The demo's readings.json beside a run report (both readings and the photos, pretrained -> delivered) is a
    table in the report's summary; a file of another shape, or a label that is not text, is left out."""
    from retrieval.reports import READINGS_FILE, REPORT_FORMAT
    from retrieval.serve.report_summary import summary_markdown

    (tmp_path / "report.json").write_text(json.dumps({"format": REPORT_FORMAT, "kind": "train"}))
    assert "Read two ways" not in summary_markdown(load_report(tmp_path / "report.json"))
    readings = {"labels": {"subgroup map@r": "by subgroup, MAP@R", "digits recall@1": "photos <b>|x", "odd": 3},
                "pretrained": {"subgroup map@r": 0.156, "digits recall@1": 0.9, "odd": 0.1},
                "delivered": {"subgroup map@r": 0.178, "digits recall@1": 0.85, "odd": 0.2}}
    (tmp_path / READINGS_FILE).write_text(json.dumps(readings))
    summary = summary_markdown(load_report(tmp_path / "report.json"))
    assert "| by subgroup, MAP\\@R | 15.6 | 17.8 | +2.2 |" in summary  # labels escaped: a cell, not markup
    assert "| photos \\<b\\>\\|x | 90.0 | 85.0 | -5.0 |" in summary and "odd" not in summary
    for broken in ("[1, 2]", "{", json.dumps({**readings, "delivered": "x"})):
        (tmp_path / READINGS_FILE).write_text(broken)
        assert "Read two ways" not in summary_markdown(load_report(tmp_path / "report.json"))
