"""A real browser (Playwright driving Debian's chromium, headless) against the running server.

The page explains itself (what the gallery holds, what to try, what the score means); an upload shows K named
results that grow with K without an inner scrollbar, captioned with the paths the API gives; an example click
searches; a new search closes the enlarged view; bad uploads show the API's message in the status line in place of
the previous results, with no broken image and no pop-up left over later results; a query unlike the gallery is
told so; a 400 px screen shows results before examples with whole captions; the Evaluation tab explains MAP@R =
Recall@1, shows one picture at a time and orders the worst classes; the Index tab's statistics are readable
sections; the re-ranking picker re-orders the results as the API's rerank does. Skipped, with the reason, only
where Playwright or chromium is not installed.

The README's screenshots come from this test run against the real demo artifacts:
    RETRIEVAL_BROWSER_DEMO=artifacts/demo RETRIEVAL_SCREENSHOTS=docs/screenshots pytest tests/serve/test_browser.py
Without RETRIEVAL_SCREENSHOTS the screenshots go to a temporary folder.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import httpx
import pytest
from browser_pages import (
    open_page,
    picture_shown,
    playwright_or_skip,
    text_once_shown,
    upload_and_search,
)
from serve_fixtures import (
    QUERY_PNG,
    BackgroundServer,
    ServeArtifacts,
    require_emoji_labels,
    shared_artifacts,
    shared_full_report,
)

from retrieval.analysis.results import RESULTS_FORMAT
from retrieval.data.emoji import emoji_name, is_code_point_sequence
from retrieval.data.synthetic import bomb_png
from retrieval.serve.defaults import DEFAULT_MAX_PIXELS, DEFAULT_MAX_UPLOAD_BYTES, DEFAULT_RESULTS
from retrieval.serve.images import QueryError, decode_query
from retrieval.serve.server import ServerConfig, build_app

DEMO_DIR = os.environ.get("RETRIEVAL_BROWSER_DEMO")  # e.g. artifacts/demo, built by `make demo`
K = 8

pytestmark = pytest.mark.timeout(300)
sync_api = playwright_or_skip()


def demo_artifacts(root: Path) -> ServeArtifacts:
    """The demo's index, report and a few labelled test-split queries (`make demo` layout: the gallery's own
    manifest, labelled by subgroup, where the demo wrote one)."""
    from retrieval.cli.demo import GALLERY_CSV

    manifest = root / "data" / "emoji" / GALLERY_CSV
    if not manifest.is_file():
        manifest = manifest.with_name("manifest.csv")
    with manifest.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["split"] == "test"][:24]
    paths = [manifest.parent / row["path"] for row in rows]
    return ServeArtifacts(root, manifest, root / "model.onnx", root / "index", root / "run" / "report.json",
                          paths, [row["label"] for row in rows])


def small_results(folder: Path) -> Path:
    """A results document of one table with a per-epoch curve (the real one is docs/results.json)."""
    cell = {"mean": 0.5, "std": 0.01, "n": 3}
    table = {"id": "sct", "title": "3. NCA triplet: HN vs SHN vs SCT", "claim": "SCT beats HN and SHN.",
             "caveats": "frozen features", "discussion": ["Emoji: Recall@1 order SCT > HN."],
             "columns": [{"key": "recall@1", "label": "R@1"}],
             "blocks": [{"title": "Emoji", "short": "Emoji", "rows": [
                 {"label": "NCA triplet, HN", "cells": {"recall@1": cell}, "command": "retrieval train --loss x"},
                 {"label": "SCT", "cells": {"recall@1": dict(cell, mean=0.6)}, "command": "retrieval train"}]}]}
    curve = {"id": "sct", "title": "hard triplets", "ylabel": "share",
             "series": {"Emoji": {"NCA triplet, HN": [0.6, 0.5, 0.4], "SCT": [0.7, 0.5, 0.3]}}}
    path = folder / "results.json"
    path.write_text(json.dumps({"format": RESULTS_FORMAT, "setup": {"runs": 6, "seeds": [0, 1, 2]},
                                "tables": [table], "curves": [curve]}))
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifacts = demo_artifacts(Path(DEMO_DIR)) if DEMO_DIR else shared_artifacts(tmp_path_factory)
    results = DEFAULT_RESULTS if DEMO_DIR else small_results(tmp_path_factory.mktemp("results"))
    # a report with every picture the demo's has (the query grid, the embedding map, ...)
    report = artifacts.report if DEMO_DIR else shared_full_report(tmp_path_factory)
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, report=report, results=results))
    with BackgroundServer(app) as running:
        yield running, artifacts
    service.close()


@pytest.fixture
def page(browser, server):
    """A page of its own for each test: no test sees the tab, query or results another test left."""
    page = open_page(browser, server[0].url)
    yield page
    page.close()


def named(label: str) -> str:
    """A label as the page shows it: with its Unicode name for emoji code points."""
    name = emoji_name(label) if is_code_point_sequence(label) else None
    return f"{label} · {name}" if name else label


def no_inner_scroll(page, gallery: str) -> None:
    """Every result lies inside the gallery's box and the gallery does not scroll inside itself."""
    scroll, client = page.evaluate(
        "s => { const g = document.querySelector(s); return [g.scrollHeight, g.clientHeight] }", f"{gallery} .grid-wrap"
    )
    assert scroll <= client + 1, (gallery, scroll, client)
    box = page.locator(gallery).bounding_box()
    last = page.locator(f"{gallery} .thumbnail-item").last.bounding_box()
    assert last["y"] + last["height"] <= box["y"] + box["height"] + 1


def test_the_first_screen_says_its_purpose_and_shows_the_upload_box(browser, server, screenshots):
    """One plain sentence first, the technical header folded away, and on a phone-sized window the upload box in
    view without scrolling."""
    page = open_page(browser, server[0].url, width=390, height=760)
    try:
        purpose = page.locator("#purpose").inner_text().strip()
        assert purpose in ("Find the images of this gallery most like yours, and whether they share its label.",
                           "Find the same emoji drawn by another artist.",  # an index of the twin reading
                           "Find emoji of the same kind: a smiling face finds smiling faces.")  # the demo's
        first = page.evaluate("document.querySelector('#purpose').getBoundingClientRect().top")
        assert first < 120  # the first thing on the page
        assert not page.locator("#technical-header").is_visible()  # folded away until asked for
        upload = page.locator("#query-image").bounding_box()
        assert upload["y"] < 760 and upload["y"] + min(upload["height"], 200) <= 760  # in view, no scrolling
        page.screenshot(path=str(screenshots / "first-screen-narrow.png"))
    finally:
        page.close()


def test_the_page_says_what_the_gallery_is_and_what_the_score_means(server, page):
    _, artifacts = server
    page.get_by_role("tab", name="Search").click()
    intro = page.locator("#intro").inner_text()
    classes = len(set(artifacts.labels)) if not DEMO_DIR else None
    assert "images" in intro and "classes" in intro and "index.json" in intro
    if classes:
        assert f"{classes} classes" in intro
    assert "upload or paste" in intro and "examples" in intro
    assert "cosine similarity" in intro and "L2-normalised" in intro and "1 = identical direction" in intro
    # the tabs it names are the page's: this page has a results grid
    assert "Metrics (Evaluation, Results and Index tabs)" in intro
    assert page.get_by_role("tab", name="Results").count() == 1


def test_the_page_names_an_emoji_gallerys_labels(server, page):
    _, artifacts = server
    require_emoji_labels(artifacts.labels)
    page.get_by_role("tab", name="Search").click()
    intro = page.locator("#intro").inner_text()
    assert "emoji" in intro and " · " in intro  # e.g. `0023-FE0F-20E3 · KEYCAP NUMBER SIGN`


def test_upload_shows_k_named_results_that_grow_with_k(server, page, screenshots):
    _, artifacts = server
    # a distinctive class (the other style is easy to find) makes a clearer screenshot than a keycap digit
    index = artifacts.labels.index("00A9") if "00A9" in artifacts.labels else 5
    query = artifacts.query_paths[index]
    upload_and_search(page, query, 4)
    small = page.locator("#results-gallery").bounding_box()["height"]
    upload_and_search(page, query, K)
    assert page.locator("#results-gallery img").count() == K
    assert page.locator("#results-gallery").bounding_box()["height"] > small  # the area grows with K
    no_inner_scroll(page, "#results-gallery")
    timing = page.locator("#search-timing").inner_text()
    assert f"{K} results" in timing and "ms" in timing
    assert named(artifacts.labels[index]) in timing  # the upload is a gallery image: its label is known and shown
    captions = page.locator("#results-gallery .caption-label").all_inner_texts()
    assert len(captions) == K and all(c[0] in "✓✗" for c in captions)
    for caption in captions:  # ✓ 0.912 · 1F600 · GRINNING FACE · test/1F600/noto.png: the label, then the path
        label, path = caption.split(" · ")[1], caption.rsplit(" · ", 1)[1]
        assert caption.removesuffix(f" · {path}").endswith(named(label)), caption
    # the paths the API gives for the same query, in the same order: what the filter box compares
    answer = httpx.post(f"{server[0].url}/search?k={K}&exclude_self=true",
                        files={"image": ("q.png", query.read_bytes(), "image/png")}, timeout=60).json()
    assert [caption.rsplit(" · ", 1)[1] for caption in captions] == [r["path"] for r in answer["results"]]
    assert answer["query_item"]["path"] in timing
    page.wait_for_timeout(300)
    page.screenshot(path=str(screenshots / "search.png"), full_page=True)


def test_the_re_ranking_picker_re_orders_the_results_as_the_api_does(server, page):
    """Picking k-reciprocal re-ranking in the app gives the API's re-ranked order, and the status line names it."""
    _, artifacts = server
    query = artifacts.query_paths[2]
    page.locator("#rerank-method input").click()
    page.get_by_role("option", name="kreciprocal: k-reciprocal encoding", exact=False).click()
    upload_and_search(page, query, K)
    timing = text_once_shown(page, "#search-timing", "Re-ranked by")
    assert "k-reciprocal encoding" in timing and "Zhong" in timing and f"{K} results" in timing
    captions = page.locator("#results-gallery .caption-label").all_inner_texts()
    answer = httpx.post(f"{server[0].url}/search?k={K}&exclude_self=true&rerank=kreciprocal",
                        files={"image": ("q.png", query.read_bytes(), "image/png")}, timeout=60).json()
    assert [caption.rsplit(" · ", 1)[1] for caption in captions] == [r["path"] for r in answer["results"]]


def test_a_new_search_closes_the_enlarged_view(server, page):
    _, artifacts = server
    upload_and_search(page, artifacts.query_paths[0], K)
    page.locator("#results-gallery .thumbnail-item").first.click()
    page.wait_for_selector("#results-gallery .preview", state="visible")
    assert named_caption_shown(page)
    page.locator("#search-button").click()
    page.wait_for_selector("#results-gallery .preview", state="detached")
    page.wait_for_function(f"document.querySelectorAll('#results-gallery img').length === {K}")


def named_caption_shown(page) -> bool:
    """The enlarged view's caption carries the label (and its name, for emoji)."""
    caption = page.locator("#results-gallery .preview .caption").inner_text()
    return " · " in caption and len(caption.split(" · ")) >= 2


def test_clicking_an_example_runs_the_search(page):
    assert page.locator("#query-image img").count() == 0  # a page of its own: no query yet
    before = page.locator("#search-timing").inner_text()
    page.locator("#search-examples button").nth(1).click()
    page.wait_for_function(
        "([before]) => { const text = document.querySelector('#search-timing')?.innerText ?? '';"
        " return text !== before && text.includes('Query is gallery image'); }", arg=[before]
    )
    page.wait_for_function("document.querySelectorAll('#results-gallery img').length > 0")
    page.wait_for_selector("#query-image img", state="visible")  # the example fills the query box too


def api_message(data: bytes) -> str:
    """What POST /search answers for these bytes: serve.images.decode_query's message (the API's decoder)."""
    try:
        decode_query(data, DEFAULT_MAX_UPLOAD_BYTES, DEFAULT_MAX_PIXELS)
    except QueryError as exc:
        return str(exc)
    raise AssertionError("the upload was expected to be refused")


def broken_images(page) -> int:
    """Images on the page the browser could not draw (a broken-image icon)."""
    return page.evaluate("Array.from(document.images).filter(img => img.complete && img.getAttribute('src')"
                         " && img.naturalWidth === 0).length")


def test_a_bad_upload_replaces_the_results_and_shows_no_broken_image(server, page, screenshots, tmp_path):
    """Each unreadable upload: the API's message in the status line, in place of the previous results and their
    status; the file leaves the query box (no broken image); no pop-up, no traceback. The next good search
    replaces the message."""
    _, artifacts = server
    cases = {
        "not-an-image.png": b"hello, I am a text file\n",
        "empty.png": b"",
        "truncated.png": QUERY_PNG[: len(QUERY_PNG) // 2],
        "bomb.png": bomb_png(8000, 6000),  # 48 megapixels declared, over the 40 MP limit
    }
    for name, data in cases.items():
        upload_and_search(page, artifacts.query_paths[1], 4)  # results and a status to replace
        assert "Query is gallery image" in page.locator("#search-timing").inner_text()
        (tmp_path / name).write_bytes(data)
        page.locator("#query-image input[type=file]").set_input_files(str(tmp_path / name))
        page.wait_for_selector("#query-image img", state="attached")
        page.locator("#search-button").click()
        expected = api_message(data)
        status = text_once_shown(page, "#search-timing", "Cannot search with this image")
        assert name in status and " ".join(expected.split()) in " ".join(status.split()), (name, status)
        assert "Query is gallery image" not in status and " results · embed" not in status, status
        page.wait_for_selector("#query-image img", state="detached")  # the unreadable file left the query box
        assert page.locator("#results-gallery img").count() == 0
        assert page.locator(".toast-body").count() == 0  # inline, not a pop-up
        assert broken_images(page) == 0
        body = page.locator("body").inner_text()
        assert "Traceback" not in body and "/gradio/" not in body and str(tmp_path) not in body, name
        if name == "bomb.png":
            page.screenshot(path=str(screenshots / "bad-upload.png"))
    upload_and_search(page, artifacts.query_paths[2], 4)
    assert "Cannot search" not in page.locator("#search-timing").inner_text()


def test_a_pop_up_about_an_earlier_try_does_not_stay_over_later_results(server, page, tmp_path):
    """Over the upload limit, Gradio refuses the file before it is sent, in a pop-up of its own naming the limit;
    the next search closes it, so it never covers the results of a search that worked."""
    _, artifacts = server
    large = tmp_path / "large.png"
    large.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(DEFAULT_MAX_UPLOAD_BYTES))
    page.locator("#query-image input[type=file]").set_input_files(str(large))
    toast = text_once_shown(page, ".toast-body", "maximum allowed size")
    assert "large.png" in toast and "Traceback" not in page.locator("body").inner_text()
    upload_and_search(page, artifacts.query_paths[0], 4)
    page.wait_for_selector(".toast-body", state="detached")


def test_a_query_unlike_the_gallery_is_told_that_nothing_is_similar(server, page, tmp_path):
    """A flat red square against the gallery: its best score is below what nearly every gallery image reaches to
    its nearest neighbour, and the status line says so; a gallery image gets no such hint."""
    _, artifacts = server
    (tmp_path / "red.png").write_bytes(QUERY_PNG)
    upload_and_search(page, tmp_path / "red.png", 4)
    status = page.locator("#search-timing").inner_text()
    assert "Nothing in the gallery is much like this image" in status and "or more" in status
    upload_and_search(page, artifacts.query_paths[3], 4)
    status = text_once_shown(page, "#search-timing", "Query is gallery image")  # the second search's status
    assert "much like this image" not in status


def test_narrow_screen_shows_results_before_examples_with_whole_captions(browser, server, screenshots):
    _, artifacts = server
    page = open_page(browser, server[0].url, width=400, height=900)
    try:
        upload_and_search(page, artifacts.query_paths[-1], K)
        results = page.locator("#results-gallery").bounding_box()
        examples = page.locator("#search-examples").bounding_box()
        assert results["y"] + results["height"] <= examples["y"] + 1  # results first, examples after
        assert page.evaluate("document.documentElement.scrollWidth") <= 400  # nothing wider than the screen
        no_inner_scroll(page, "#results-gallery")
        cut = page.evaluate(
            "Array.from(document.querySelectorAll('#results-gallery .caption-label')).filter(c => {"
            " const item = c.closest('.thumbnail-item').getBoundingClientRect(), box = c.getBoundingClientRect();"
            " return c.scrollWidth > c.clientWidth + 1 || c.scrollHeight > c.clientHeight + 1"
            "  || box.bottom > item.bottom + 1 || box.right > item.right + 1 }).map(c => c.innerText)"
        )
        assert cut == []
        page.screenshot(path=str(screenshots / "search-narrow.png"), full_page=True)
    finally:
        page.close()


def table_rows(page, selector: str, columns: int) -> list[list[str]]:
    """The cells of a Gradio Dataframe as shown (header row skipped)."""
    lines = [line.strip() for line in page.locator(selector).inner_text().splitlines() if line.strip()]
    cells = lines[columns:]
    return [cells[i : i + columns] for i in range(0, len(cells) - columns + 1, columns)]


PICTURE_TABS = ("Recall@K", "Training curves", "Hard triplets", "In and out of domain", "WiSE-FT",
                "Queries and their top 5", "Embedding map")


def test_evaluation_tab_explains_and_orders(server, page, screenshots):
    page.get_by_role("tab", name="Evaluation").click()
    page.wait_for_selector("#recall-plot img", state="visible")
    # each picture in a tab of its own, at a readable size, without a label badge over its title; a run without
    # WiSE-FT (the demo trains a head only) has no WiSE-FT picture to show
    wise = json.loads(Path(server[1].report).read_text()).get("wise") is not None
    for name, plot in zip(PICTURE_TABS, ("#recall-plot", "#curves-plot", "#triplet-plot", "#domains-plot",
                                         "#wise-plot", "#retrieval-plot", "#embedding-map-plot"), strict=True):
        if plot == "#wise-plot" and not wise:
            continue
        page.locator("#report-pictures").get_by_role("tab", name=name, exact=True).click()
        page.wait_for_selector(f"{plot} img", state="visible")
        box = page.locator(f"{plot} img").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100, plot
        label = page.locator(f"{plot} [data-testid=block-label]")
        assert label.count() == 0 or not label.first.is_visible(), plot  # no badge over the plot's title
    # the map says which classes it draws out of how many, and how they were chosen
    note = page.locator("#embedding-map-note").inner_text()
    assert "The map shows" in note and "classes evaluated" in note
    if not DEMO_DIR:
        classes = len(set(server[1].labels))
        assert (f"{min(classes, 20)} of the {classes} classes evaluated (a random sample" in note
                if classes > 20 else f"all {classes} classes evaluated" in note), note
    page.locator("#report-pictures").get_by_role("tab", name="Recall@K", exact=True).click()
    assert "recall@1" in page.locator("#metrics-table").inner_text()
    assert "percent" in page.locator("#metrics-table").inner_text()
    if not DEMO_DIR:  # two images per class: one relevant item per query
        assert "Why MAP@R equals Recall@1" in text_once_shown(page, "#report-summary", "MAP@R")
    text_once_shown(page, "#worst-summary", "mean rank of the first")
    rows = table_rows(page, "#worst-classes", 6)
    assert rows, page.locator("#worst-classes").inner_text()
    keys = [(float(row[3]), -float(row[4])) for row in rows]
    assert keys == sorted(keys)  # lowest Recall@1 first, then the farthest first correct result
    assert "duplicates" in page.locator("#duplicates-summary").inner_text().lower()
    page.wait_for_function("document.querySelectorAll('#failures-gallery img').length >= 2")
    no_inner_scroll(page, "#failures-gallery")
    captions = page.locator("#failures-gallery .caption-label").all_inner_texts()
    assert all("/" in caption.rsplit(" · ", 1)[1] for caption in captions), captions  # the images' paths
    page.locator("#failures-gallery").scroll_into_view_if_needed()
    page.wait_for_function("Array.from(document.querySelectorAll('#failures-gallery img'))"
                           ".every(img => img.complete && img.naturalWidth > 0)")  # every picture decoded
    # compact: one picture at a time (the seven stacked made the tab 5,000 px tall at this width)
    height = page.evaluate("document.documentElement.scrollHeight")
    assert height < 3500, height
    page.wait_for_timeout(500)  # let the images finish painting for the screenshot
    page.screenshot(path=str(screenshots / "evaluation.png"), full_page=True)


def test_evaluation_tab_names_an_emoji_gallerys_worst_classes(server, page):
    _, artifacts = server
    require_emoji_labels(artifacts.labels)
    page.get_by_role("tab", name="Evaluation").click()
    text_once_shown(page, "#worst-summary", "mean rank of the first")
    rows = table_rows(page, "#worst-classes", 6)
    assert rows, page.locator("#worst-classes").inner_text()
    assert all(row[0] == named(row[0].split(" · ")[0]) and " · " in row[0] for row in rows)


def test_evaluation_tab_finds_near_duplicates_and_label_suspects_on_request(page, screenshots):
    """The two buttons beside the per-class analysis: groups at a typed threshold (a table and a picture), a bad
    threshold answered in place, auto calibrated on planted copies, and the label audit's ranked table and picture."""
    page.get_by_role("tab", name="Evaluation").click()
    box = page.locator("#near-duplicates-threshold textarea, #near-duplicates-threshold input").first
    box.fill("0.3")  # low enough that this gallery's images link into groups: the table and the picture show
    page.locator("#near-duplicates-button").click()
    text_once_shown(page, "#near-duplicates-summary", "groups of near-duplicates")
    page.wait_for_selector("#near-duplicates-table", state="visible")
    rows = table_rows(page, "#near-duplicates-table", 6)
    assert rows and rows[0][1] in ("kept", "kept (labels differ)") and "/" in rows[0][4], rows[:3]
    # at 0.3 different emoji group together: the table says so on each of their rows
    first = [row for row in rows if row[0] == rows[0][0]]
    if len({row[3] for row in first}) > 1:
        assert all(row[1].endswith("(labels differ)") for row in first), first
    picture_shown(page, "#near-duplicates-picture")
    box.fill("often")
    page.locator("#near-duplicates-button").click()
    text_once_shown(page, "#near-duplicates-summary", "auto or a cosine")
    page.wait_for_selector("#near-duplicates-table", state="hidden")
    box.fill("auto")
    page.locator("#near-duplicates-button").click()
    text_once_shown(page, "#near-duplicates-summary", "calibrated (auto) on")
    page.locator("#label-audit-button").click()
    text = text_once_shown(page, "#label-audit-summary", "label suspects")
    if "**0 label" not in text and not text.startswith("0 label"):
        page.wait_for_selector("#label-audit-table", state="visible")
        rows = table_rows(page, "#label-audit-table", 7)
        assert rows and rows[0][0] == "1" and rows[0][2] != rows[0][3], rows[:3]
        scores = [float(row[4]) for row in rows]
        assert scores == sorted(scores, reverse=True)
        picture_shown(page, "#label-audit-picture")
    page.locator("#label-audit-summary").scroll_into_view_if_needed()
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshots / "curation.png"), full_page=True)


def test_results_tab_shows_a_table_and_its_figure(page, screenshots):
    page.get_by_role("tab", name="Results").click()
    text = text_once_shown(page, "#results-table", "Discussion")
    assert "R@1" in text and "±" in text and "percent" in text
    if not DEMO_DIR:  # the small document's table has a per-epoch figure
        assert "SCT" in text and "60.0 ± 1.0" in text
        page.wait_for_selector("#results-figure img", state="visible")
        box = page.locator("#results-figure img").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshots / "results.png"), full_page=True)


def test_index_tab_shows_statistics_in_percent_and_readable_sections(page, screenshots):
    page.get_by_role("tab", name="Index").click()
    text = text_once_shown(page, "#index-stats", "vectors")
    assert "Flat" in text and "recall@1 vs exact search (%)" in text
    details = text_once_shown(page, "#index-details", "Size on disk")
    headings = [text.strip() for text in page.locator("#index-details h3").all_inner_texts()]
    for heading in ("Index", "Search quality and speed", "How close gallery images are to each other",
                    "Gallery files", "Size on disk", "Model calls"):
        assert heading in headings, (heading, headings)
    assert "KiB" in details and "ms /" in details and "%" in details
    assert page.locator("#index-details table").count() >= 5  # labelled values in tables, not a JSON tree
    assert page.locator(".json-holder, [data-testid=json]").count() == 0 and "{" not in details
    page.screenshot(path=str(screenshots / "index.png"), full_page=True)


def test_the_page_links_our_json_api_docs_not_gradios(page):
    """The app's API link leads to the JSON API's documentation (served offline), not Gradio's API page."""
    page.wait_for_selector("#search-button")
    assert page.get_by_text("Use via API").count() == 0
    link = page.locator("a[href='/docs']")
    assert link.count() >= 1
    page.goto(page.url.split("?")[0].rstrip("/") + link.first.get_attribute("href"))  # the link opens a new tab
    page.wait_for_selector(".swagger-ui .info .title")  # Swagger UI rendered from our own assets, no network
    assert "retrieval search" in page.locator(".swagger-ui .info .title").inner_text()
