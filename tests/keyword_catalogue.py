"""A tiny titled catalogue for the keyword tests: product pictures with a title and a brand per row (a few titles
hostile: FTS5 syntax, quotes, a NUL, emoji, HTML), indexed with a real tiny ONNX model
(``embedders.write_projection_onnx``) and `retrieval index build --text-columns`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from click.testing import CliRunner
from embedders import write_projection_onnx
from sample_images import noisy_png

from retrieval.cli.main import main

TITLES = [
    "Claw hammer, steel",
    "Garden hose 20 m",
    "Café table, oak",
    "Rubber mallet",
    "Garden shears",
    'NEAR("quoted" title:x) * OR {c0}: AND \x00 end',
    "🔨 Emoji sledge",
    "Screwdriver set",
    "<script>alert(1)</script> Lamp",
]
BRANDS = ["Acme", "Bosch"]


def write_catalogue(root: Path, titles: list[str] = TITLES, start: int = 0, name: str = "manifest.csv") -> Path:
    """Pictures (one colour each) and a manifest (path, label, title, brand) under ``root``; returns the manifest."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, title in enumerate(titles, start):
        path = f"img{n}.png"
        (root / path).write_bytes(noisy_png((25 * n % 256, 120, 255 - 25 * n % 256), seed=n))
        rows.append({"path": path, "label": f"c{n % 3}", "title": title, "brand": BRANDS[n % 2]})
    manifest = root / name
    with manifest.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, ["path", "label", "title", "brand"])
        writer.writeheader()
        writer.writerows(rows)
    return manifest


def run(*args: str):
    """The CLI's result for ``args`` (strings)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def build_catalogue_index(root: Path, text_columns: str | None = "title,brand") -> tuple[Path, Path]:
    """The catalogue under ``root``/shop indexed into ``root``/index (with its keyword index of ``text_columns``);
    returns (index folder, model file)."""
    manifest = write_catalogue(root / "shop")
    model = write_projection_onnx(root / "model.onnx")
    extra = ["--text-columns", text_columns] if text_columns else []
    result = run("index", "build", "--model", model, "--images", manifest, "--out", root / "index", *extra)
    assert result.exit_code == 0, result.output
    return root / "index", model


def ids_by_title(index_dir: Path) -> dict[str, int]:
    """Each title's catalogue id."""
    import sqlite3

    db = sqlite3.connect(index_dir / "catalogue.sqlite")
    try:
        return {json.loads(data)["title"]: int(i) for i, data in db.execute("SELECT id, data FROM metadata")}
    finally:
        db.close()
