"""Searching by description in a real browser (Playwright driving Debian's chromium, headless): on a server with a
text model, words typed into "or describe it" and Enter (or the Search button) give K loaded results, the status
line says the description was searched, and the filters apply, their errors inline as for an image; on a server
without one, the box is disabled and says how to start the server with one. Skipped, with the reason, only where
Playwright or chromium is not installed."""

from __future__ import annotations

import json

import pytest
from browser_pages import open_page, playwright_or_skip, text_once_shown
from serve_fixtures import BackgroundServer, shared_artifacts
from text_towers import small_text_model

from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)
sync_api = playwright_or_skip()
K = 6


def served(config: ServerConfig):
    """The app of ``config`` on a loopback port for the module (a fixture's body)."""
    app, service = build_app(config)
    with BackgroundServer(app) as running:
        yield running
    service.close()


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    artifacts = shared_artifacts(tmp_path_factory)
    model_hash = json.loads((artifacts.index_dir / "index.json").read_text())["model_hash"]
    tower = small_text_model(tmp_path_factory.mktemp("browser_tower") / "text.onnx", model_hash, 32)
    yield from served(ServerConfig(index_dir=artifacts.index_dir, text_model=tower))


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    yield from served(ServerConfig(index_dir=shared_artifacts(tmp_path_factory).index_dir))


def results_loaded(page, k: int) -> None:
    """Wait until the results gallery shows ``k`` images, each loaded and decoded."""
    page.wait_for_function(
        "k => document.querySelectorAll('#results-gallery img').length === k && Array.from(document.querySelectorAll("
        "'#results-gallery img')).every(img => img.complete && img.naturalWidth > 0)", arg=k)


def test_a_description_typed_and_entered_shows_k_results(browser, text_server, screenshots):
    page = open_page(browser, text_server.url)
    try:
        number = page.locator("#top-k input[type=number]")
        number.fill(str(K))
        number.press("Enter")
        box = page.locator("#query-text textarea")
        assert box.is_enabled()
        box.fill("a red apple")
        box.press("Enter")
        results_loaded(page, K)
        status = text_once_shown(page, "#search-timing", "results")
        assert "Searched by the description" in status and "a red apple" in status and f"{K} results" in status
        page.screenshot(path=str(screenshots / "search-by-text.png"))

        page.locator("#filter").get_by_text("Filter the gallery").click()  # filters apply; errors stay inline
        page.locator("#where-filter textarea").fill("label ==")
        page.locator("#search-button").click()
        error = text_once_shown(page, "#search-timing", "expected a quoted string or a number")
        assert error.startswith("⚠️ Cannot use this filter") and page.locator(".toast-body").count() == 0
        assert page.locator("#results-gallery img").count() == 0  # the previous results are gone with their status
        page.locator("#where-filter textarea").fill("id >= 0")
        box.fill("a smiling face")
        page.locator("#search-button").click()
        text_once_shown(page, "#search-timing", "a smiling face")
        results_loaded(page, K)
    finally:
        page.close()


def test_without_a_text_model_the_box_is_disabled_and_says_how_to_start_one(browser, plain_server):
    page = open_page(browser, plain_server.url)
    try:
        box = page.locator("#query-text textarea")
        assert not box.is_enabled()
        note = page.locator("#query-text").inner_text()
        assert "Search by text is off" in note and "--text-model" in note and "retrieval index text" in note
    finally:
        page.close()
