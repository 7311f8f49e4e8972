"""A real browser (Playwright driving Debian's chromium, headless) against the running server.

Uploads an image and sees K result images; opens the Evaluation tab and sees the plots. Screenshots go
to docs/screenshots/. Skipped, with the reason, only where Playwright or chromium is not installed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from serve_fixtures import shared_artifacts

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
SCREENSHOTS = Path(__file__).resolve().parents[1] / "docs" / "screenshots"
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifacts = shared_artifacts(tmp_path_factory)
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report))
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


def test_upload_shows_k_result_images(server, page):
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
    page.wait_for_function(f"document.querySelectorAll('#results-gallery img').length >= {K}")
    assert page.locator("#results-gallery img").count() == K
    timing = page.locator("#search-timing").inner_text()
    assert f"{K} results" in timing and "ms" in timing
    assert artifacts.labels[index] in timing  # the upload is a gallery image: its label is known and shown
    captions = page.locator("#results-gallery").inner_text()
    assert captions.count("✓") + captions.count("✗") == K
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "search.png"), full_page=True)


def test_evaluation_tab_shows_the_plots(page):
    page.get_by_role("tab", name="Evaluation").click()
    for plot in ("#recall-plot", "#curves-plot", "#triplet-plot"):
        page.wait_for_selector(f"{plot} img", state="visible")
        box = page.locator(f"{plot} img").bounding_box()
        assert box is not None and box["width"] > 100 and box["height"] > 100, plot
    assert "recall@1" in page.locator("#metrics-table").inner_text()
    page.wait_for_function("document.querySelectorAll('#failures-gallery img').length >= 2")
    page.wait_for_timeout(500)  # let the images finish painting for the screenshot
    page.screenshot(path=str(SCREENSHOTS / "evaluation.png"), full_page=True)


def test_index_tab_shows_statistics(page):
    page.get_by_role("tab", name="Index").click()
    page.wait_for_function(
        "document.querySelector('#index-stats') && "
        "document.querySelector('#index-stats').innerText.includes('vectors')"
    )
    text = page.locator("#index-stats").inner_text()
    assert "Flat" in text and "recall" in text
    page.screenshot(path=str(SCREENSHOTS / "index.png"), full_page=True)
