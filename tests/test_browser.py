"""A real browser (Playwright driving Debian's chromium, headless) against the running server.

Uploads an image and sees K result images; opens the Evaluation tab and sees the plots. Skipped, with the
reason, only where Playwright or chromium is not installed.

The README's screenshots come from this test run against the real demo artifacts:
    RETRIEVAL_BROWSER_DEMO=artifacts/demo RETRIEVAL_SCREENSHOTS=docs/screenshots pytest tests/test_browser.py
Without RETRIEVAL_SCREENSHOTS the screenshots go to a temporary folder.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest
from serve_fixtures import ServeArtifacts, shared_artifacts

from retrieval.analysis.results import RESULTS_FORMAT
from serve.defaults import DEFAULT_RESULTS
from serve.server import BackgroundServer, ServerConfig, build_app

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DEMO_DIR = os.environ.get("RETRIEVAL_BROWSER_DEMO")  # e.g. artifacts/demo, built by `make demo`
K = 8
TIMEOUT_MS = 60_000

pytestmark = pytest.mark.timeout(300)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed: pip install playwright"
)
if not Path(CHROMIUM).is_file():
    pytest.skip(
        "no chromium browser at /usr/bin/chromium: apt-get install -y chromium", allow_module_level=True
    )


def demo_artifacts(root: Path) -> ServeArtifacts:
    """The demo's index, report and a few labelled test-split queries (`make demo` layout)."""
    manifest = root / "data" / "emoji" / "manifest.csv"
    with manifest.open(newline="") as f:
        rows = [row for row in csv.DictReader(f) if row["split"] == "test"][:24]
    paths = [manifest.parent / row["path"] for row in rows]
    return ServeArtifacts(root, manifest, root / "model.onnx", root / "index", root / "run" / "report.json",
                          paths, [row["label"] for row in rows])


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("RETRIEVAL_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report, results=results))
    with BackgroundServer(app) as running:
        yield running, artifacts
    service.close()


@pytest.fixture(scope="module")
def page(server):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server[0].url + "/")
        page.wait_for_selector("#query-image")
        yield page
        browser.close()


def text_once_shown(page, selector: str, text: str) -> str:
    """Wait until the element's text contains ``text`` (the app fills it after the tab loads); return its text."""
    page.wait_for_function(
        "([selector, text]) => document.querySelector(selector)?.innerText.includes(text)", arg=[selector, text]
    )
    return page.locator(selector).inner_text()


def test_upload_shows_k_result_images(server, page, screenshots):
    _, artifacts = server
    # a distinctive class (the other style is easy to find) makes a clearer screenshot than a keycap digit
    index = artifacts.labels.index("00A9") if "00A9" in artifacts.labels else 5
    query = artifacts.query_paths[index]
    page.locator("#query-image input[type=file]").set_input_files(str(query))
    page.wait_for_selector("#query-image img")
    number = page.locator("#top-k input[type=number]")
    number.fill(str(K))
    number.press("Enter")
    page.locator("#search-button").click()
    # every result thumbnail must actually load and decode (a broken /items/{id}/image shows as blank)
    page.wait_for_function(
        "Array.from(document.querySelectorAll('#results-gallery img'))"
        f".filter(img => img.complete && img.naturalWidth > 0).length >= {K}"
    )
    assert page.locator("#results-gallery img").count() == K
    timing = page.locator("#search-timing").inner_text()
    assert f"{K} results" in timing and "ms" in timing
    assert artifacts.labels[index] in timing  # the upload is a gallery image: its label is known and shown
    captions = page.locator("#results-gallery").inner_text()
    assert captions.count("✓") + captions.count("✗") == K
    page.screenshot(path=str(screenshots / "search.png"), full_page=True)


def test_evaluation_tab_shows_the_plots(page, screenshots):
    page.get_by_role("tab", name="Evaluation").click()
    for plot in ("#recall-plot", "#curves-plot", "#triplet-plot"):
        page.wait_for_selector(f"{plot} img", state="visible")
        box = page.locator(f"{plot} img").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100, plot
    assert "recall@1" in page.locator("#metrics-table").inner_text()
    page.wait_for_function("document.querySelectorAll('#failures-gallery img').length >= 2")
    page.wait_for_timeout(500)  # let the images finish painting for the screenshot
    page.screenshot(path=str(screenshots / "evaluation.png"), full_page=True)


def test_results_tab_shows_a_table_and_its_figure(page, screenshots):
    page.get_by_role("tab", name="Results").click()
    text = text_once_shown(page, "#results-table", "Discussion")
    assert "R@1" in text and "±" in text
    if not DEMO_DIR:  # the small document's table has a per-epoch figure
        assert "SCT" in text and "60.0 ± 1.0" in text
        page.wait_for_selector("#results-figure img", state="visible")
        box = page.locator("#results-figure img").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshots / "results.png"), full_page=True)


def test_index_tab_shows_statistics(page, screenshots):
    page.get_by_role("tab", name="Index").click()
    text = text_once_shown(page, "#index-stats", "vectors")
    assert "Flat" in text and "recall" in text
    page.screenshot(path=str(screenshots / "index.png"), full_page=True)
