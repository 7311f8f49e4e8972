"""docs/BENCHMARKS.md shows its tables as benchmarks/results/ holds them: each table block, rendered from its results
file (benchmarks/render_tables.py, ``make docs``), equals the page; every results file says the command, the machine
and the date of its measurement and is shown on the page. And the pages and the code read as a reference, not a lab
notebook: no wording of how the project was developed (lent GPUs, numbered sessions, issue numbers)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
DOC = ROOT / "docs" / "BENCHMARKS.md"
RESULTS = sorted((BENCHMARKS / "results").glob("*.json"))


def benchmark_module(name: str):
    """A module of benchmarks/ (a folder of scripts, not a package), loaded from its file without putting the folder
    on sys.path, where its script names would shadow the tests' helper modules."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


results_io = benchmark_module("results_io")
render_tables = benchmark_module("render_tables")

# How the project was developed, said in a page or the code: a lent GPU, a numbered or ordinal session, an issue or
# ticket number, "this round". Phrases only: onnxruntime's InferenceSession, an HTTP session or Gradio's session_hash
# are what they say.
HISTORY = re.compile("|".join([
    r"\blent\s+(?:GPUs?|H100s?|H200s?|machines?)\b",
    r"\b(?:GPUs?|machines?)\s+(?:was|were)\s+lent\b",
    r"\bthis\s+session\b",
    r"\bsessions?\s+#?\d+\b",
    r"\b(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|\d+(?:st|nd|rd|th)|later|earlier|previous)"
    r"\s+(?:GPU\s+|CPU\s+|H100\s+|H200\s+)?sessions?\b",
    r"\b(?:last|next)\s+(?:GPU|CPU|H100|H200)\s+sessions?\b",
    r"\bGPU\s+sessions?\b",
    r"\b(?:issues?|tickets?)\s*#\s*\d+",
    r"\b(?:issues?|tickets?)\s+\d+\b",
    r"\bthis\s+round\b",
]), re.IGNORECASE)
CODE_FOLDERS = ("retrieval", "train", "serve", "export", "cli", "benchmarks")
TEXT_SUFFIXES = {".py", ".sh", ".md", ".json", ".txt", ".toml", ".yml", ".yaml", ".cfg", ".html", ".js", ".css"}


def blocks(text: str) -> dict[str, str]:
    """Each table block of a page by its results file: the text between its two markers."""
    return {match["path"]: match["body"] for match in render_tables.BLOCK.finditer(text)}


def test_each_table_of_the_benchmarks_page_is_its_results_file():
    on_page, rendered = DOC.read_text(encoding="utf-8"), render_tables.render(DOC)
    stale = [path for path, body in blocks(rendered).items() if blocks(on_page).get(path) != body]
    assert rendered == on_page, (
        f"docs/BENCHMARKS.md disagrees with {', '.join(stale) or 'its results files'}: change the results file, "
        "not the page, then run `make docs` (or .venv/bin/python benchmarks/render_tables.py)")


def test_every_results_file_is_on_the_page_and_every_block_has_its_file():
    shown = set(blocks(DOC.read_text(encoding="utf-8")))
    files = {str(path.relative_to(ROOT)) for path in RESULTS}
    assert files, "no results files in benchmarks/results/"
    assert not files - shown, f"results files the page does not show: {sorted(files - shown)}"
    assert not shown - files, f"table blocks whose results file is missing: {sorted(shown - files)}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda path: path.name)
def test_each_results_file_says_how_where_and_when_it_was_measured(path):
    result = results_io.read_result(path)  # refuses a file without command, machine, date, columns or rows
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", result["date"]), result["date"]
    assert result["command"].strip() and result["machine"].strip()
    assert path.stem.startswith(result["benchmark"] + "-"), (path.name, result["benchmark"])


def test_a_stale_table_is_found_and_rendered_again(tmp_path):
    result = results_io.write_result("speed", "cpu-2core", "python benchmarks/speed.py", ["case", "images/s"],
                                     [["plain", "1,954"], ["compiled", "6,837"]], path=tmp_path / "speed.json")
    block = f"<!-- table: {result} -->\n| case | images/s |\n|---|---|\n| plain | 1,900 |\n<!-- end table -->\n"
    page = tmp_path / "PAGE.md"
    page.write_text(f"# Page\n\n{block}\nafter\n", encoding="utf-8")
    rendered = render_tables.render(page)
    assert rendered != page.read_text(encoding="utf-8")
    assert "| compiled | 6,837 |" in rendered and "1,900" not in rendered
    assert "2-core CPU, 24 GiB, no GPU" in rendered and "python benchmarks/speed.py" in rendered
    assert rendered.endswith("<!-- end table -->\n\nafter\n")
    page.write_text(rendered, encoding="utf-8")
    assert render_tables.render(page) == rendered


@pytest.mark.parametrize("missing", ["command", "machine", "date"])
def test_a_results_file_without_its_metadata_is_refused(tmp_path, missing):
    result = {"benchmark": "speed", "command": "python benchmarks/speed.py", "machine": "h200",
              "date": "2026-11-27", "columns": ["case"], "rows": [["plain"]]}
    del result[missing]
    path = tmp_path / "speed-h200.json"
    path.write_text(json.dumps(result), encoding="utf-8")
    with pytest.raises(ValueError, match=missing):
        results_io.read_result(path)


def test_printed_tables_and_json_become_results_rows():
    printed = "a line\n| B | ms |\n|---|---:|\n| 32 | 1.5 |\n| 64 | 2.0 |\n\n| x |\n| --- |\n| y |\n"
    assert results_io.markdown_tables(printed) == [(["B", "ms"], [["32", "1.5"], ["64", "2.0"]]),
                                                   (["x"], [["y"]])]
    lines = '{"kind": "random", "s": 1.5}\n{"kind": "clustered", "s": 2, "nmi": 1.0}\n'
    assert results_io.json_table(results_io.json_documents(lines)) == (
        ["kind", "s", "nmi"], [["random", "1.5", ""], ["clustered", "2", "1.0"]])
    indented = 'progress\n{\n  "local": {"img_s": [1, 2]},\n  "ratio": 0.9\n}\n'
    assert results_io.json_table(results_io.json_documents(indented)) == (
        ["key", "value"], [["local.img_s", "[1, 2]"], ["ratio", "0.9"]])


def history_hits(paths: list[Path]) -> list[str]:
    """``file:line: phrase`` for every development-history phrase in ``paths``."""
    hits = []
    for path in paths:
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            hits += [f"{path.relative_to(ROOT)}:{number}: {match[0]!r}" for match in HISTORY.finditer(line)]
    return hits


def test_the_docs_and_the_code_carry_no_development_history():
    paths = [ROOT / "README.md", ROOT / "app.py", *(ROOT / "docs").rglob("*")]
    for folder in CODE_FOLDERS:
        paths += (ROOT / folder).rglob("*")
    paths = sorted(p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts)
    hits = history_hits(paths)
    assert not hits, ("how the project was developed belongs in git and CHANGELOG.md; say what is true now:\n"
                      + "\n".join(hits))


@pytest.mark.parametrize(("text", "history"), [
    ("the second lent GPU (one NVIDIA H200)", True),
    ("No GPU was lent to this task.", True),
    ("measured in this session", True),
    ("GPU session 4 write-up", True),
    ("as in the third session", True),
    ("a later CPU session", True),
    ("Train at 128 px (issue 26, 2026-11-24)", True),
    ("see issue #12", True),
    ("this round's new tests", True),
    ("session = onnxruntime.InferenceSession(path, options)", False),
    ("the ONNX session's providers; an HTTP session per client", False),
    ('{"fn_index": 0, "session_hash": "x"}', False),
    ("a known issue with faiss' printf; tickets are sold out", False),
])
def test_history_phrases_are_told_apart_from_sessions_in_code(text, history):
    assert bool(HISTORY.search(text)) is history
