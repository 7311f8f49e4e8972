"""The app of a shop catalogue in a real browser (Chromium through Playwright), at a desktop's width (1280 x 800) and
a phone's (390 x 844): each result shows its title under its image, not its file path; a click on one shows its
path; at a phone's width the results start within the first screen and nothing is wider than the screen; a title
holding HTML and script is shown as text and makes nothing of the page."""

from __future__ import annotations

import pytest
from browser_pages import open_page, playwright_or_skip, text_once_shown, upload_and_search
from serve_fixtures import BackgroundServer
from shop_gallery import HTML_TITLE, build_shop_index

from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)
sync_api = playwright_or_skip()

SCREENS = {"desktop": (1280, 800), "phone": (390, 844)}
K = 6

# the results' captions, each with its box and its image's, and what the hostile title would have made of the page
CAPTIONS = """() => [...document.querySelectorAll('#results-gallery .thumbnail-item')].map(item => {
    const img = item.querySelector('img').getBoundingClientRect();
    const label = item.querySelector('.caption-label');
    const box = label.getBoundingClientRect();
    return {text: label.innerText, top: box.top, bottom: box.bottom, height: box.height, imgBottom: img.bottom,
            visible: getComputedStyle(label).visibility !== 'hidden' && box.height > 10};
})"""
LIVE = """() => ({
    images: [...document.images].filter(i => i.getAttribute('src') === 'x').length,
    scripts: [...document.scripts].filter(s => s.textContent.includes('alert(2)')).length,
    bold: [...document.querySelectorAll('b')].filter(b => b.textContent === 'Bold').length,
})"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("shop-browser")
    index_dir = build_shop_index(root)
    app, service = build_app(ServerConfig(index_dir=index_dir))
    with BackgroundServer(app) as running:
        yield running, root / "shop"
    service.close()


@pytest.mark.parametrize("screen", SCREENS)
def test_results_show_their_titles_and_at_a_phones_width_come_first(server, browser, screenshots, screen):
    running, gallery = server
    width, height = SCREENS[screen]
    page = open_page(browser, running.url, width, height)
    try:
        upload_and_search(page, gallery / "red" / "red_0.png", K)
        text_once_shown(page, "#search-timing", f"{K} results")
        page.evaluate("window.scrollTo(0, 0)")
        page.wait_for_timeout(300)
        page.screenshot(path=str(screenshots / f"shop-{screen}.png"))
        captions = page.evaluate(CAPTIONS)
        assert len(captions) == K
        for caption in captions:  # the title under its image, never a file path
            assert caption["visible"] and caption["top"] >= caption["imgBottom"] - 1, caption
            assert ".png" not in caption["text"], caption
        texts = [caption["text"] for caption in captions]
        assert texts[0].startswith("✓ Red kettle #3 · 10.75"), texts
        assert any(HTML_TITLE in text for text in texts), texts  # the hostile title, as text
        assert page.evaluate(LIVE) == {"images": 0, "scripts": 0, "bold": 0}
        assert page.evaluate("document.documentElement.scrollWidth") <= width  # nothing wider than the screen
        if screen == "phone":  # the results start within the first screen, their first row of images in it
            first = page.locator("#results-gallery img").first.bounding_box()
            assert first["y"] + first["height"] / 2 < height, first
            button = page.locator("#search-button").bounding_box()
            assert button["y"] + button["height"] < first["y"]  # Search before them, settings after
            assert page.locator("#top-k").bounding_box()["y"] > first["y"]
        # a click on a result: its path, as the filters and the API spell it
        page.locator("#results-gallery .thumbnail-item").first.click()
        shown = text_once_shown(page, "#selected-result", "Selected #4")
        assert "red/red_3.png" in shown and "Red kettle #3" in shown
        assert page.evaluate(LIVE) == {"images": 0, "scripts": 0, "bold": 0}
    finally:
        page.close()
