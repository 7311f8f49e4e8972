"""Text from users reaches the app's page as text, never as Markdown or HTML, and never whole when long.

Labels (a manifest's column, folder names), a gallery's info.json, a manifest's column names and a run report's
fields are anyone's text. Each hostile string (tests/hostile_text.py: a backtick that closes a code span, then a
login form; a Markdown image from another site; a javascript: link; raw tags; a table; $$ maths; and 5 MB) goes
through the functions that build the page's text, and the Markdown they produce is rendered with a CommonMark
renderer (markdown-it, HTML allowed, as Gradio's marked allows it): it must hold no tag, link or image of its own,
show the text as it is, and stay short. tests/serve/test_browser_escaping.py checks the same page in Chromium with
Gradio's own renderer.
"""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import pytest
from fastapi.testclient import TestClient
from hostile_text import FORM, HOSTILE, LONG_COLUMN, build_hostile_index
from serve_fixtures import shared_artifacts

from retrieval.reports import REPORT_FORMAT
from retrieval.serve.page_text import MAX_SHOWN_CHARS, html_text, markdown_code, markdown_text, shown_text
from retrieval.serve.report_files import load_report
from retrieval.serve.report_summary import summary_markdown
from retrieval.serve.service import SearchService
from retrieval.serve.ui import build_ui
from retrieval.serve.ui.evaluation import EvaluationTab
from retrieval.serve.ui.search import ExampleSet, SearchTab
from retrieval.serve.ui.shared import GalleryFacts
from retrieval.serve.upload_cache import UploadRecords

markdown_it = pytest.importorskip("markdown_it", reason="markdown-it-py renders the Markdown under test")
pytestmark = pytest.mark.timeout(300)

HUGE = "<form>" + "y" * 5_000_000  # 5 MB: never sent whole
# what a rendering of user text may hold: Markdown's own emphasis around it, code spans, the page's own headings,
# lists and links to its own paths
ALLOWED_TAGS = {"p", "code", "strong", "em", "h2", "h3", "ul", "li", "br"}
RENDER = markdown_it.MarkdownIt("commonmark", {"html": True}).enable(["table", "strikethrough"])


class Rendered(HTMLParser):
    """The tags and the text of rendered HTML."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.parts: list[str] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data: str) -> None:
        self.parts.append(data)

    @property
    def text(self) -> str:
        return "".join(self.parts)


def live_markup(markdown: str) -> list[str]:
    """The tags of the rendered Markdown that user text could have made: any but ``ALLOWED_TAGS`` (and links to
    the page's own paths), or any attribute."""
    found = []
    for tag, attrs in Rendered(RENDER.render(markdown)).tags:
        own_link = tag == "a" and set(attrs) == {"href"} and str(attrs["href"]).startswith("/")
        if not own_link and (tag not in ALLOWED_TAGS or attrs):
            found.append(f"<{tag} {attrs}>")
    return found


def outside_code_spans(markdown: str) -> str:
    """``markdown`` without its code spans (CommonMark: a backslash escapes the next character outside them; a run
    of backticks opens a span that the next run of the same length closes)."""
    kept, at = [], 0
    while at < len(markdown):
        if markdown[at] == "\\":
            kept.append(markdown[at: at + 2])
            at += 2
        elif markdown[at] == "`":
            run = re.match("`+", markdown[at:])[0]
            close = re.compile(f"(?<!`){run}(?!`)").search(markdown, at + len(run))
            if close is None:
                kept.append(run)
                at += len(run)
            else:
                at = close.end()
        else:
            kept.append(markdown[at])
            at += 1
    return "".join(kept)


def autolinks(markdown: str) -> list[str]:
    """Bare URLs and e-mail addresses GFM would link (markdown-it's CommonMark does not): outside code spans."""
    return re.findall(r"(?i)(?:https?|ftp)://|\bwww\.|[a-z0-9._+-]@[a-z0-9_-]+\.[a-z0-9]", outside_code_spans(markdown))


def shown(markdown: str) -> str:
    """The text a reader sees (spaces collapsed)."""
    return " ".join(Rendered(RENDER.render(markdown)).text.split())


def assert_inert(markdown: str, *texts: str) -> None:
    """No tag or link of user text in ``markdown``, and each of ``texts`` visible as it is."""
    assert live_markup(markdown) == [], markdown[:2000]
    assert autolinks(markdown) == [], markdown[:2000]
    assert HUGE[:1000] not in markdown and "y" * 1000 not in markdown  # bounded
    seen = shown(markdown)
    for text in texts:
        assert shown_text(text) in seen, (shown_text(text), seen[:2000])


# --- the helpers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", HOSTILE)
def test_escaped_markdown_renders_as_the_text_itself(text):
    for markdown in (markdown_text(text), markdown_code(text), f"## {markdown_text(text)}",
                     f"label **{markdown_text(text)}** · {markdown_code(text)}"):
        assert_inert(markdown, text)
    assert shown(markdown_text(text)) == shown_text(text)
    assert shown(markdown_code(text)) == shown_text(text)


def test_html_text_escapes_and_cuts():
    assert html_text(FORM) == FORM.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    assert "<" not in html_text(HUGE) and len(html_text(HUGE)) <= 4 * MAX_SHOWN_CHARS
    assert html_text("\"'") == "&quot;&#x27;"


def test_long_text_is_cut_with_an_ellipsis_without_reading_it_whole():
    for helper in (shown_text, markdown_text, markdown_code):
        out = helper(HUGE)
        assert out.endswith(("…", "… `", "…`")) and len(out) < 3 * MAX_SHOWN_CHARS, helper
    assert shown_text("a \n\n b\t\x00c\u202ed") == "a b c d"  # one line, no control or bidi characters
    assert shown_text(" " * 10_000 + "x") == "…"  # a cut is said, even when only spaces were seen


# --- the pieces of the page ----------------------------------------------------------------------------------
def hostile_facts(label: str = FORM, folder: str = "photos") -> GalleryFacts:
    dataset = {"dataset": f"d{FORM}", "description": f"find {HOSTILE[1]} {HOSTILE[3]} {HOSTILE[5]}",
               "purpose": f"Find {HOSTILE[1]} {HOSTILE[2]}"}
    return GalleryFacts(images=4, labelled=4, classes=2, example_labels=[label, HOSTILE[1]],
                        folder=Path("/srv") / folder, dataset=dataset, unicode_labels=False)


def stub_service(index_name: str = "index") -> SimpleNamespace:
    info = {"index_key": "Flat", "embedding_dim": 32, "model_hash": "abc123", "vectors": 4}
    return SimpleNamespace(describe=lambda: info, index_dir=Path("/srv") / index_name, text_search=lambda: False)


def test_the_opening_lines_show_hostile_labels_and_info_json_as_text():
    facts = hostile_facts(folder=f"f{HOSTILE[2]}".replace("/", "_"))
    intro = facts.intro_markdown(stub_service(f"i{HOSTILE[4]}".replace("/", "_")))
    assert_inert(intro, FORM, HOSTILE[1], f"d{FORM}")
    assert "[/docs](/docs)" in intro  # the page's own link stays a link
    purpose = markdown_text(facts.purpose())
    assert_inert(f"## {purpose}", f"Find {HOSTILE[1]} {HOSTILE[2]}")


def test_a_5_mb_label_and_info_json_are_cut():
    facts = hostile_facts(label=HUGE)
    facts.dataset.update(description=HUGE, purpose=HUGE)
    intro = facts.intro_markdown(stub_service())
    assert_inert(intro)
    assert len(intro) < 5_000 and len(facts.label_text(HUGE)) <= MAX_SHOWN_CHARS
    assert len(facts.purpose()) <= 500


def hostile_report(path: Path, field: str) -> Path:
    """A training report whose text fields are ``field`` (a long one in fewer of them: a report holds 50 MB)."""
    everywhere = len(field) < 1000
    extra = {"extra": {field: {"recall@1": 0.2}}} if everywhere else {}
    metrics = {"recall@1": 0.5, "map@r": 0.4, field: 0.3, **extra}
    report = {
        "format": REPORT_FORMAT, "kind": "train",
        "config": {"train": {"dataset": field, "backbone": field, "loss": field if everywhere else "ms",
                             "epochs": field if everywhere else 2, "data": f"/data/{field[:1000].replace('/', '_')}"}},
        "baseline": metrics, "best": {"epoch": field, **metrics}, "last": {"recall@1": 0.5, **extra},
        "reference": {"input_size": field, "sets": {field: {"test": {"recall@1": 0.1}}}},
        "label_free": {"pseudo_labels": field, "kept": [{"epoch": 0, "neighbours_kept@10": 0.5}],
                       "groups": [{"epoch": 1, "clusters": field, "clustered_images": 3, "images": 9,
                                   "largest_cluster": 2, "stability": "1.0"}]},
    }
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("field", [*HOSTILE, HUGE], ids=[*map(str, range(len(HOSTILE))), "5MB"])
def test_a_run_reports_fields_are_shown_as_text(tmp_path, field):
    report = load_report(hostile_report(tmp_path / "report.json", field))
    summary = summary_markdown(report, shown="run/report.json")
    # the out-of-domain lines name the set and the columns, a list of the page's own
    assert_inert(summary, *([field] if field is not HUGE else []))
    headers, rows = report.metrics_table()  # a Dataframe of "str" cells: text, but never whole
    assert all(len(str(cell)) <= MAX_SHOWN_CHARS for cell in [*headers, *(row[0] for row in rows)])


# --- the app over an index whose labels, info.json and column names are hostile ---------------------------
@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    artifacts = shared_artifacts(tmp_path_factory)
    root = tmp_path_factory.mktemp("hostile")
    index = build_hostile_index(root, artifacts.model, artifacts.query_paths)
    service = SearchService(index)
    yield service, root
    service.close()


def markdown_values(demo: gr.Blocks) -> list[str]:
    return [block.value for block in demo.blocks.values() if isinstance(block, gr.Markdown) and block.value]


def test_the_pages_config_holds_no_live_markup_and_no_long_text(hostile, tmp_path):
    service, _ = hostile
    (tmp_path / "examples").mkdir()
    demo, _ = build_ui(service, report=None, example_dir=tmp_path / "examples")
    texts = markdown_values(demo)
    assert any(shown_text(FORM) in shown(text) for text in texts)  # the label is there, as text
    for text in texts:
        assert_inert(text)
    config = json.dumps(demo.get_config_file())
    assert "z" * 1000 not in config and LONG_COLUMN not in config  # the long label and column name are cut
    assert len(config) < 200_000, len(config)


def test_search_and_evaluation_text_of_hostile_labels(hostile, tmp_path):
    service, root = hostile
    tab = SearchTab(service, ExampleSet(service, tmp_path, count=1), UploadRecords(gr.Blocks()))
    query = root / "gallery" / "0_0.png"  # an image of the FORM label: its label is named in the timing line
    tab.uploads.blocks.upload_file_set.add(str(query))
    items, timing, _ = tab.search({"path": str(query)}, 5, [FORM, HOSTILE[1]], "id >= 0")
    assert_inert(timing, FORM)  # the label, and the filter built from the picked labels
    assert all(len(caption) < 2 * MAX_SHOWN_CHARS for _, caption in items)  # captions are text, but short
    evaluation = EvaluationTab(service, None, tab.facts)
    summary, table, failures = evaluation.worst_classes()
    assert_inert(summary)
    cells = [str(cell) for row in table.constructor_args["value"] for cell in row]
    assert all(len(cell) <= MAX_SHOWN_CHARS for cell in cells)
    assert all(len(caption) < 2 * MAX_SHOWN_CHARS for _, caption in failures.constructor_args["value"] or [])
    assert_inert(evaluation.duplicates()[0])


def test_a_hostile_report_opened_on_the_page_is_shown_as_text(hostile, tmp_path, monkeypatch):
    service, _ = hostile
    hostile_report(tmp_path / "report.json", FORM)
    monkeypatch.chdir(tmp_path)  # the page opens reports under the server's working folder
    summary, table, *_ = EvaluationTab(service, None).open_report("report.json")
    assert_inert(summary, FORM)
    assert all(len(header) <= MAX_SHOWN_CHARS for header in table["headers"])


@pytest.mark.parametrize("text", [*HOSTILE, HUGE], ids=[*map(str, range(len(HOSTILE))), "5MB"])
def test_a_failed_searchs_status_line_shows_the_filter_and_file_name_as_text(hostile, tmp_path, text):
    """The status line replaces a pop-up: the API's message may echo the visitor's filter, and the upload's name
    is the visitor's browser's; both are text there."""
    from retrieval.serve.ui.search import failure_markdown
    from retrieval.serve.ui.shared import MAX_ERROR_CHARS

    service, _ = hostile
    tab = SearchTab(service, ExampleSet(service, tmp_path, count=1), UploadRecords(gr.Blocks()))
    tab.uploads.blocks.upload_file_set.add(str(tmp_path / "x.png"))
    (tmp_path / "x.png").write_bytes(b"not an image")
    items, status, _ = tab.search({"path": str(tmp_path / "x.png"), "orig_name": text}, 3)
    assert items == [] and status.startswith("⚠️ **Cannot search with this image")
    assert_inert(status, *([text] if text is not HUGE else []))
    _, status, _ = tab.search({"path": str(tmp_path / "x.png")}, 3, None, f'label = "{text[:3000]}" and (')
    assert_inert(status) and status.startswith("⚠️ **Cannot use this filter:**")
    message = failure_markdown("Cannot search", ValueError(text))  # a message is cut later than a label
    assert live_markup(message) == [] and autolinks(message) == [] and len(message) < MAX_ERROR_CHARS + 100


@pytest.mark.parametrize("text", [*HOSTILE, HUGE], ids=[*map(str, range(len(HOSTILE))), "5MB"])
def test_the_index_statistics_show_paths_errors_and_unknown_keys_as_text(text):
    from retrieval.serve.stats_view import statistics_markdown

    stats = {"vectors": 3, "index_key": text, "index_key_requested": "auto", "params": {text[:100]: 1},
             "model": {"model_path": text, "model_hash": "abc", "embedding_dim": 8},
             "counts": {"done": 3, text[:100]: 1}, "errors": 1,
             "error_examples": [{"id": 4, "path": text, "error": text}],
             "throughput": {text[:100]: {"images": 3, "seconds": 1.0, "images_per_s": 3.0, "runs": 1}},
             "size_on_disk_bytes": {"total": 2048}, text[:100]: text}
    markdown = statistics_markdown(stats, {"model_calls": 1, text[:100]: text})
    tables = re.compile(r"<(table|thead|tbody|tr|th|td) \{\}>")  # the view's own tables, without attributes
    assert [tag for tag in live_markup(markdown) if not tables.fullmatch(tag)] == [], markdown[:2000]
    assert autolinks(markdown) == [] and "y" * 1000 not in markdown
    for block in re.split(r"\n\s*\n", markdown):  # each table keeps its columns: no cell is split by user text
        rows = [line for line in block.splitlines() if line.startswith("|")]
        assert len({len(re.findall(r"(?<!\\)\|", row)) for row in rows}) <= 1, block
    assert "2.00 KiB" in markdown and "### Other" in markdown


def test_the_maps_recorded_method_is_shown_as_text(tmp_path):
    """What a map records in its PNG comes with the report, which is anyone's file."""
    from PIL import Image, PngImagePlugin

    from retrieval.analysis.pictures import MAP_METADATA_KEY
    from retrieval.serve.report_summary import embedding_map_note

    info = PngImagePlugin.PngInfo()
    info.add_text(MAP_METADATA_KEY, json.dumps({"classes_shown": 2, "classes": 3, "images_shown": 4, "images": 6,
                                                "method": FORM, "seed": 0}))
    Image.new("RGB", (8, 8)).save(tmp_path / "map.png", pnginfo=info)
    (tmp_path / "report.json").write_text(json.dumps({"format": REPORT_FORMAT, "kind": "train",
                                                      "plots": {"embedding_map": "map.png"}}))
    note = embedding_map_note(load_report(tmp_path / "report.json"))
    assert_inert(note, FORM) and "2 of the 3 classes" in note


# --- the response headers ------------------------------------------------------------------------------------
def test_every_response_says_no_referrer_to_other_sites_and_no_sniffing(hostile):
    from retrieval.serve.server import ServerConfig, build_app

    service, _ = hostile
    app, _ = build_app(ServerConfig(index_dir=service.index_dir), service=service)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        answers = [client.get("/"), client.get("/health"), client.get("/no-such-page"),
                   client.get("/health", headers={"Host": "evil.example"}),  # refused (400): still covered
                   client.post("/search?k=3", files={"image": ("x.png", b"not an image", "image/png")})]
    assert [a.status_code for a in answers] == [200, 200, 404, 400, 400]
    for answer in answers:
        assert answer.headers.get_list("referrer-policy") == ["same-origin"], answer.request.url
        assert answer.headers.get_list("x-content-type-options") == ["nosniff"], answer.request.url


def test_a_lone_surrogate_is_shown_as_the_replacement_character_everywhere_on_the_page():
    """Half of a UTF-16 pair cannot be encoded as UTF-8: text shown on the page carries U+FFFD in its place."""
    import orjson  # what Gradio's event stream encodes page updates with

    for show in (shown_text, markdown_text, markdown_code, html_text):
        shown = show('label = "a\ud800b\udfff"')
        assert "\ufffd" in shown and "\ud800" not in shown and "\udfff" not in shown
        orjson.dumps(shown)  # raised "str is not valid UTF-8: surrogates not allowed"
    assert shown_text("\U0001f600") == "\U0001f600"  # a whole pair is one character, kept
