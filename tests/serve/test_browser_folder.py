"""The app on a user's own folder, in a real browser: an index built from generated images in nested
folders (labelled by --label-from top), served without a report and without a results grid.

Nothing of the demo shows (no emoji text anywhere, no Results tab, and the page names none); result captions end
with the image's path relative to the gallery, as the API and filters spell it; a filter matching nothing says how
paths compare; the Evaluation tab hides what it has no data for; a run report from another data set (digits),
opened on the page, says so and stays apart from the analysis of the index being served.

Screenshots for the README (docs/screenshots/folder-*.png):
    RETRIEVAL_SCREENSHOTS=docs/screenshots pytest tests/serve/test_browser_folder.py
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from browser_pages import open_page, playwright_or_skip, text_once_shown, upload_and_search
from PIL import Image, ImageDraw
from serve_fixtures import BackgroundServer, shared_artifacts

from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)
sync_api = playwright_or_skip()
SHAPES = ("circle", "square", "triangle", "star")
# (folder under the shape, file count): nested as a user's photo folders are; --label-from top labels by the shape
LAYOUT = (("", 2), ("variants/deep", 2), ("variants/pale/old", 2))


def shape_image(shape: str, seed: int, size: int = 96) -> Image.Image:
    """One shape, filled, in a colour and at a position and size drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (size, size), tuple(int(v) for v in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(image)
    colour = tuple(int(v) for v in rng.integers(0, 160, 3))
    cx, cy = (size / 2 + rng.uniform(-8, 8) for _ in range(2))
    r = size * rng.uniform(0.28, 0.4)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    else:
        points = 3 if shape == "triangle" else 10
        radii = [r] * points if shape == "triangle" else [r if i % 2 == 0 else r * 0.45 for i in range(points)]
        draw.polygon([(cx + q * math.sin(2 * math.pi * i / points), cy - q * math.cos(2 * math.pi * i / points))
                      for i, q in enumerate(radii)], fill=colour)
    return image


def write_shapes(root: Path) -> list[Path]:
    """shapes/<shape>/[variants/...]/<shape>_<n>.png; returns the files."""
    files, seed = [], 0
    for shape in SHAPES:
        for folder, count in LAYOUT:
            for _ in range(count):
                path = root / shape / folder / f"{shape}_{seed:02d}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                shape_image(shape, seed).save(path)
                files.append(path)
                seed += 1
    return files


def write_digits_report(run_dir: Path) -> Path:
    """A training report of another data set: sklearn's digits, through the real report writer (plots included)."""
    from sklearn.datasets import load_digits

    from retrieval.metrics import evaluate
    from retrieval.records.run_config import RunFolderConfig
    from retrieval.train.report import write_report

    digits = load_digits()
    vectors = digits.data[:300].astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    labels = digits.target[:300]
    last = evaluate(vectors, labels)
    baseline = evaluate(np.random.default_rng(0).normal(size=vectors.shape).astype(np.float32), labels)
    history = [{"epoch": 0, **baseline}, {"epoch": 1, "loss": 0.9}, {"epoch": 2, "loss": 0.6, **last}]
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    config = {"train": {"dataset": "digits", "data": None, "backbone": "efficientnet_lite0", "loss": "ms",
                        "epochs": 2}}
    write_report(run_dir, RunFolderConfig.from_json(config), history, baseline, {"epoch": 2, **last}, last,
                 (vectors, labels), None)
    return run_dir / "report.json"


@pytest.fixture(scope="module")
def folder_server(tmp_path_factory):
    from retrieval.index import IngestOptions, build_index

    root = tmp_path_factory.mktemp("own-folder")
    files = write_shapes(root / "shapes")
    model = shared_artifacts(tmp_path_factory).model  # the serving tests' ONNX EfficientNet-Lite0
    build_index(root / "shapes", root / "my-shapes-index", model=model, label_from="top",
                options=IngestOptions(batch_size=16, workers=0, progress=False))
    write_digits_report(root / "digits-run")
    app, service = build_app(ServerConfig(index_dir=root / "my-shapes-index"))
    with BackgroundServer(app) as running:
        yield running, root, files
    service.close()


@pytest.fixture
def page(browser, folder_server):
    """A page of its own for each test: no test sees the tab, report, filter or results another test left."""
    page = open_page(browser, folder_server[0].url)
    yield page
    page.close()


def no_emoji_text(page) -> None:
    """Neither the shown text nor the page's own markup mentions the demo's emoji."""
    assert "emoji" not in page.locator("body").inner_text().lower()
    html = page.content()
    spots = [html[max(0, m.start() - 150): m.end() + 80] for m in re.finditer("emoji", html, re.I)]
    assert not spots, spots[:3]


def test_search_on_a_folder_shows_file_names_and_no_demo_text(folder_server, page, screenshots):
    _, _, files = folder_server
    assert page.get_by_role("tab", name="Results").count() == 0  # no results grid was given
    purpose = page.locator("#purpose").inner_text()
    assert purpose.strip() == "Find the images of this gallery most like yours, and whether they share its label."
    intro = page.locator("#intro").inner_text()
    assert "24 images" in intro and "4 classes" in intro and "shapes" in intro  # the gallery folder's name
    assert "Metrics (Evaluation and Index tabs)" in intro and "Results" not in intro
    star = next(f for f in files if "star" in f.name and "deep" in str(f))
    upload_and_search(page, star, 6)
    timing = page.locator("#search-timing").inner_text()
    assert "Query is gallery image" in timing and "star" in timing
    captions = page.locator("#results-gallery .caption-label").all_inner_texts()
    assert len(captions) == 6
    for caption in captions:  # ✓ 0.912 · star · star/variants/deep/star_07.png
        assert caption.count(" · ") == 2, caption
        _mark_and_score, label, path = caption.split(" · ")
        assert label in SHAPES and path.startswith(f"{label}/") and path.endswith(".png"), caption
        assert (caption[0] == "✓") == (label == "star"), caption  # top-level label: a deep star is a star
    assert star.name not in captions  # the query itself is left out of its own results
    no_emoji_text(page)
    page.wait_for_timeout(300)
    page.screenshot(path=str(screenshots / "folder-search.png"), full_page=True)


def test_evaluation_without_a_report_shows_no_empty_placeholders(page):
    page.get_by_role("tab", name="Evaluation").click()
    summary = text_once_shown(page, "#report-summary", "No run report is open")
    assert "--report" in summary
    for hidden in ("#metrics-table", "#recall-plot", "#curves-plot", "#triplet-plot"):
        assert not page.locator(hidden).is_visible(), hidden
    text_once_shown(page, "#worst-summary", "Leave-one-out over the index")
    rows = page.locator("#worst-classes").inner_text()
    assert any(shape in rows for shape in SHAPES)
    assert "1\t2\t3" not in rows and "\n1\n2\n3\n" not in f"\n{rows}\n"  # no table of bare column numbers
    no_emoji_text(page)


def test_a_report_from_another_data_set_stays_apart_from_the_index(folder_server, page, screenshots,
                                                                   monkeypatch):
    _, root, _ = folder_server
    monkeypatch.chdir(root)  # the page opens reports under the server's working folder
    page.get_by_role("tab", name="Evaluation").click()
    page.locator("#report-path textarea, #report-path input").first.fill("digits-run/report.json")
    page.get_by_role("button", name="Open report").click()
    summary = text_once_shown(page, "#report-summary", "Another data set")
    assert "digits" in summary and "my-shapes-index" in summary
    page.wait_for_selector("#recall-plot img", state="visible")
    assert page.locator("#metrics-table").is_visible()
    # the run's section ends before the served index's section begins, which still shows the shapes
    heading = page.get_by_text("The index being served (my-shapes-index)")
    last_run_part = max(page.locator(s).bounding_box()["y"] + page.locator(s).bounding_box()["height"]
                        for s in ("#report-summary", "#metrics-table", "#report-pictures"))
    assert heading.bounding_box()["y"] >= last_run_part
    rows = page.locator("#worst-classes").inner_text()
    assert any(shape in rows for shape in SHAPES) and "digit" not in rows
    failures = page.locator("#failures-gallery .caption-label").all_inner_texts()
    assert all(any(shape in caption for shape in SHAPES) for caption in failures), failures
    if "no failures to show" in page.locator("#worst-summary").inner_text():
        assert not page.locator("#failures-gallery").is_visible()  # absent, not an empty box
    no_emoji_text(page)
    page.wait_for_timeout(500)
    page.screenshot(path=str(screenshots / "folder-evaluation.png"), full_page=True)


def test_the_index_tab_names_this_index(page):
    page.get_by_role("tab", name="Index").click()
    text = text_once_shown(page, "#index-stats", "vectors")
    assert "24" in text
    no_emoji_text(page)


def test_the_filter_picker_and_box_restrict_the_results(folder_server, page):
    """The app's label picker and where box search only the matching images; a malformed filter stays on screen
    with the problem named."""
    _, _, files = folder_server
    page.get_by_role("tab", name="Search").click()
    page.locator("#filter").get_by_text("Filter the gallery").click()
    picker = page.locator("#label-filter input")
    picker.click()
    page.get_by_role("option", name="circle", exact=True).click()
    page.keyboard.press("Escape")
    star = next(f for f in files if f.name.startswith("star"))
    upload_and_search(page, star, 4)
    captions = page.locator("#results-gallery .caption-label").all_inner_texts()
    assert captions and all(caption.split(" · ")[1] == "circle" and caption[0] == "✗" for caption in captions)
    assert 'label in ("circle")' in page.locator("#search-timing").inner_text()
    page.locator("#where-filter textarea").fill('path >= "circle/variants/pale"')
    page.locator("#search-button").click()
    page.wait_for_function("document.querySelector('#search-timing')?.innerText.includes('circle/variants/pale')")
    page.wait_for_function("document.querySelectorAll('#results-gallery img').length === 2")  # pale/old: 2 circles
    page.locator("#where-filter textarea").fill("label ==")
    page.locator("#search-button").click()
    status = text_once_shown(page, "#search-timing", "expected a quoted string or a number")
    assert status.startswith("⚠️ Cannot use this filter") and "position" in status
    assert page.locator(".toast-body").count() == 0 and "Traceback" not in page.locator("body").inner_text()
    assert page.locator("#results-gallery img").count() == 0  # the previous results are gone with their status
    page.wait_for_selector("#query-image img")  # the query image stays: the filter is what to fix


def test_a_filter_matching_nothing_says_how_paths_compare_and_a_shown_path_finds_its_image(folder_server, page):
    """A bare file name matches nothing (paths are relative to the gallery): the status line says so with a path
    of this index; a path copied from a result's caption finds that very image."""
    _, root, files = folder_server
    star = next(f for f in files if "deep" in str(f) and f.name.startswith("star"))
    page.get_by_role("tab", name="Search").click()
    page.locator("#filter").get_by_text("Filter the gallery").click()
    page.locator("#where-filter textarea").fill(f'path = "{star.name}"')
    page.locator("#query-image input[type=file]").set_input_files(str(files[0]))
    page.wait_for_selector("#query-image img")
    page.locator("#search-button").click()
    status = text_once_shown(page, "#search-timing", "matches no image of the index")
    example = re.search(r'e\.g\. path = "([^"]+)"', status)
    assert "relative to the gallery" in status and example, status
    assert example.group(1) in {f.relative_to(root / "shapes").as_posix() for f in files}  # one of its own
    assert page.locator("#results-gallery img").count() == 0
    page.locator("#where-filter textarea").fill("")
    upload_and_search(page, files[0], 6)
    caption = page.locator("#results-gallery .caption-label").last.inner_text()
    path = caption.rsplit(" · ", 1)[1]
    page.locator("#where-filter textarea").fill(f'path = "{path}"')
    page.locator("#search-button").click()
    page.wait_for_function("document.querySelectorAll('#results-gallery img').length === 1")
    assert page.locator("#results-gallery .caption-label").inner_text().endswith(f" · {path}")
