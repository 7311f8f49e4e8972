"""Hostile labels and info.json in a real browser (Chromium through Playwright, Gradio's own Markdown renderer):
an index whose labels close the code span they are shown in and hold a login form, Markdown images from another
site, raw tags and a javascript: link. The page shows them as text, holds no form or password box of theirs, and
asks no other site for anything; every response says Referrer-Policy: same-origin.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from browser_pages import CHROMIUM, CHROMIUM_ARGS, TIMEOUT_MS, playwright_or_skip, text_once_shown, upload_and_search
from hostile_text import FORM, HOSTILE, build_hostile_index
from serve_fixtures import BackgroundServer, shared_artifacts

from retrieval.serve.page_text import shown_text
from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)
sync_api = playwright_or_skip()


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory):
    artifacts = shared_artifacts(tmp_path_factory)
    root = tmp_path_factory.mktemp("hostile-browser")
    index = build_hostile_index(root, artifacts.model, artifacts.query_paths)
    app, service = build_app(ServerConfig(index_dir=index))
    with BackgroundServer(app) as running:
        yield running, root
    service.close()


LIVE = """() => ({
    forms: document.querySelectorAll('form').length,
    passwords: document.querySelectorAll('input[type=password]').length,
    scripts: [...document.scripts].filter(s => s.textContent.trim() === 'alert(1)').length,
    images: [...document.images].map(i => i.src).filter(s => s.includes('evil')),
    links: [...document.links].map(a => a.href).filter(h => h.startsWith('javascript') || h.includes('evil')),
    divs: [...document.querySelectorAll('div')].filter(d => d.textContent === 'block').length,
})"""  # what the hostile labels would make of the page if they were read as Markdown or HTML


def assert_nothing_live(page, requests: list[str], origin: str) -> None:
    """No form, password box, script, image or link of the labels; no request to another site."""
    page.wait_for_timeout(1000)  # images the page holds start loading
    assert page.evaluate(LIVE) == {"forms": 0, "passwords": 0, "scripts": 0, "images": [], "links": [], "divs": 0}
    foreign = [url for url in requests
               if urlsplit(url).scheme in ("http", "https", "ws", "wss") and urlsplit(url).netloc != origin]
    assert foreign == []


def test_hostile_labels_are_text_and_nothing_is_fetched_from_another_site(hostile_server):
    server, root = hostile_server
    origin = urlsplit(server.url).netloc
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(TIMEOUT_MS)
            requests: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            answer = page.goto(server.url + "/")
            page.wait_for_selector("#query-image")
            intro = text_once_shown(page, "#intro", "The gallery")
            assert_nothing_live(page, requests, origin)
            assert shown_text(FORM) in intro and shown_text(HOSTILE[1]) in intro  # the labels, as text
            assert "d" + shown_text(FORM) in intro  # info.json's data set name
            assert "find " + shown_text(HOSTILE[1]) in " ".join(intro.split())  # and its description
            assert shown_text(f"Find {HOSTILE[1]}") in page.locator("#purpose").inner_text()
            # a search for an image of the form's label: the timing line names that label
            upload_and_search(page, root / "gallery" / "0_0.png", 5)
            timing = text_once_shown(page, "#search-timing", "Query is gallery image")
            page.get_by_role("tab", name="Evaluation").click()
            text_once_shown(page, "#worst-summary", "Leave-one-out")
            assert_nothing_live(page, requests, origin)
            assert shown_text(FORM) in " ".join(timing.split())
            assert answer.headers.get("referrer-policy") == "same-origin"
            assert answer.headers.get("x-content-type-options") == "nosniff"
        finally:
            browser.close()
