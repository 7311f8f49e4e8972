"""The browser tests' Chromium (Playwright driving Debian's chromium, headless) and what they do on the app's page:
wait for a text to show, upload an image and search."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000


def playwright_or_skip():
    """Playwright's sync API; where Playwright or chromium is missing, the calling test module is skipped with what
    to install (call it at the module's top level)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: pip install playwright")
    if not Path(CHROMIUM).is_file():
        pytest.skip("no chromium browser at /usr/bin/chromium: apt-get install -y chromium", allow_module_level=True)
    return sync_api


def open_page(browser, url: str, width: int = 1400, height: int = 1000):
    """A new page of the app at ``url``, loaded: each test starts from the page as a visitor first sees it."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(url.rstrip("/") + "/")
    page.wait_for_selector("#query-image")
    return page


def text_once_shown(page, selector: str, text: str) -> str:
    """Wait until the element's text contains ``text`` (the app fills it after the tab loads); return its text."""
    page.wait_for_function(
        "([selector, text]) => document.querySelector(selector)?.innerText.includes(text)", arg=[selector, text]
    )
    return page.locator(selector).inner_text()


def picture_shown(page, selector: str) -> None:
    """Scroll to the picture ``selector`` holds, as a reader would, and wait until its image has loaded: Gradio's
    images load lazily, so one below the fold may stay unloaded (and hidden) however long the test waits."""
    page.locator(selector).scroll_into_view_if_needed()
    page.wait_for_function(
        "selector => { const img = document.querySelector(selector + ' img'); "
        "return img && img.complete && img.naturalWidth > 0; }", arg=selector
    )
    page.wait_for_selector(f"{selector} img", state="visible")


def upload_and_search(page, path: Path, k: int) -> None:
    page.locator("#query-image input[type=file]").set_input_files(str(path))
    page.wait_for_selector("#query-image img")
    number = page.locator("#top-k input[type=number]")
    number.fill(str(k))
    number.press("Enter")
    page.locator("#search-button").click()
    # every result thumbnail must actually load and decode (a broken /items/{id}/image shows as blank)
    page.wait_for_function(
        "k => document.querySelectorAll('#results-gallery img').length === k && Array.from(document.querySelectorAll("
        "'#results-gallery img')).every(img => img.complete && img.naturalWidth > 0)", arg=k
    )
