"""The documentation stays true: the README's Python example runs as printed, its commands parse, and every relative
link in the README and docs/ leads to a file of this repository. ``command_context`` is shared with
``test_docs_code.py``, which checks every code block of docs/."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from doc_commands import command_context
from embedders import write_projection_onnx

from retrieval.data.synthetic import write_digits

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto: ...


def python_examples(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)


def relative_links(text: str) -> list[str]:
    """Link targets outside code (a fenced block or an inline span may show link-like text that is not a link)."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    return [target for target in LINK.findall(prose) if not EXTERNAL.match(target) and not target.startswith("#")]


def test_readme_python_example_runs(tmp_path):
    """The example reads ``model.onnx`` and ``images/`` from the current folder: a small real ONNX embedder and a
    labelled gallery stand in for an exported model and the user's images."""
    examples = python_examples(README.read_text(encoding="utf-8"))
    assert len(examples) == 1, "the README shows one Python example; this test runs it"
    write_digits(tmp_path / "images", count=30)
    write_projection_onnx(tmp_path / "model.onnx")
    env = {**os.environ, "RETRIEVAL_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", examples[0]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "index" / "index.json").is_file()
    printed = done.stdout.splitlines()
    assert printed[0].startswith("indexed with ") and "10 classes" in printed[0], done.stdout
    answers = printed[1:]
    assert len(answers) == 3, done.stdout
    for answer in answers:
        query = answer.split(" ", 1)[0]
        # each query is a gallery image: it finds itself first, by its path relative to the gallery
        assert answer.split(" ", 1)[1].startswith(f"[('{Path(query).relative_to('images').as_posix()}', "), answer


def command_lines(text: str) -> list[list[str]]:
    """The ``retrieval ...`` commands of the README's shell blocks, as argument lists (continuations joined)."""
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["retrieval"]:
                commands.append(words[1:])
    return commands


def test_readme_command_line_example_is_valid(tmp_path, monkeypatch):
    """Every command the README shows parses with the options and values the command line has, and the training
    command's options make a valid training configuration (running them trains for minutes: not here)."""
    monkeypatch.chdir(tmp_path)
    commands = command_lines(README.read_text(encoding="utf-8"))
    assert [args[0] for args in commands] == ["export", "index", "search", "serve",  # no training: a pretrained model
                                              "train", "export", "index",  # fine-tune on my catalogue
                                              "export", "index", "search", "text", "index",  # search by text
                                              "data", "train", "export", "index", "search", "serve",  # the story
                                              "train", "evaluate", "export", "index", "index"], commands  # upgrade
    for args in commands:
        command_context(args)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files_in_the_repository(page):
    text = page.read_text(encoding="utf-8")
    assert "../shared" not in text, f"{page.name} points outside the repository (../shared); cite by title instead"
    for target in relative_links(text):
        path = (page.parent / target.split("#", 1)[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name} links outside the repository: {target}"
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


def test_link_finder_sees_links_and_skips_code():
    text = ("[a](docs/A.md) ![b](pics/b.png \"title\") [web](https://x.org) [top](#top)\n"
            "`[c](C.md)`\n```\n[d](D.md)\n```\n")
    assert relative_links(text) == ["docs/A.md", "pics/b.png"]


def test_readme_is_a_front_door():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, "the README is the front door; the manual lives in docs/"
    training = (ROOT / "docs" / "TRAINING.md").read_text(encoding="utf-8")
    start, end = training.find("<!-- options:start -->"), training.find("<!-- options:end -->")
    assert 0 <= start < end, "docs/TRAINING.md keeps the markers the options reference is generated between"
