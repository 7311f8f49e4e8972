"""A small shop catalogue for the display-column tests: product pictures (three colours, alike within one) in a
manifest with a title, a price and a brand per row, some of them hostile (long, control characters, HTML and
script), indexed with a real tiny ONNX model (``embedders.write_projection_onnx``); and a shop whose classes are in a
'category' column (``write_category_shop``), for the ``label_column`` tests of the index, training and text
training."""

from __future__ import annotations

import csv
from pathlib import Path

from embedders import write_projection_onnx
from sample_images import noisy_png

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
PRODUCTS = ["Red kettle", "Green watering can", "Blue rain jacket"]  # one per colour
HTML_TITLE = '<img src=x onerror="alert(1)"><script>alert(2)</script><b>Bold</b> kettle'
CONTROL_TITLE = "Line one\nLine two\x1b[31m\u202etxet desrever\x00 end"
LONG_TITLE = "Very long title " + "x" * 5000
PER_COLOUR = 4


def product_title(colour: int, n: int) -> str:
    """The title of the ``n``-th picture of a colour: the product's, with the hostile ones in place of a few."""
    hostile = {(0, 1): HTML_TITLE, (1, 1): CONTROL_TITLE, (2, 1): LONG_TITLE}
    return hostile.get((colour, n), f"{PRODUCTS[colour]} #{n}")


def write_shop(root: Path) -> Path:
    """The catalogue's pictures and manifest.csv (path, label, title, price, brand, sku) under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for c, (name, colour) in enumerate(COLOURS.items()):
        for n in range(PER_COLOUR):
            path = f"{name}/{name}_{n}.png"
            (root / name).mkdir(exist_ok=True)
            (root / path).write_bytes(noisy_png(colour, seed=10 * c + n))
            rows.append({"path": path, "label": name, "title": product_title(c, n), "price": 10 + c + n / 4,
                         "brand": "Acme" if n % 2 else "", "sku": f"SKU-{c}{n}"})
    with (root / "manifest.csv").open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, ["path", "label", "title", "price", "brand", "sku"])
        writer.writeheader()
        writer.writerows(rows)
    return root / "manifest.csv"


def write_plain_shop(root: Path) -> Path:
    """The same pictures in class folders, with no manifest (no columns to show)."""
    for c, (name, colour) in enumerate(COLOURS.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for n in range(PER_COLOUR):
            (root / name / f"{name}_{n}.png").write_bytes(noisy_png(colour, seed=10 * c + n))
    return root


def build_shop_index(root: Path, display_columns: list[str] | None = None, manifest: bool = True) -> Path:
    """The catalogue indexed in ``root/index`` with its display columns recorded (None: the defaults)."""
    from retrieval.index import IngestOptions, build_index
    from retrieval.index.display_columns import record_display_columns

    gallery = write_shop(root / "shop") if manifest else write_plain_shop(root / "shop")
    model = write_projection_onnx(root / "model.onnx", dim=16)
    build_index(gallery, root / "index", model=model, options=IngestOptions(batch_size=8, workers=0, progress=False))
    if manifest:
        record_display_columns(root / "index", display_columns)
    return root / "index"


CATEGORIES = ("shoes", "bags", "hats")
CATEGORY_HEADER = ("path", "category", "title", "price")


def write_category_shop(folder: Path, count: int = 12, header: tuple[str, ...] = CATEGORY_HEADER,
                        images: bool = True, categories: tuple[str, ...] = CATEGORIES) -> Path:
    """A shop's manifest.csv whose classes are in a 'category' column, not 'label' (what ``label_column`` names):
    ``count`` tiny PNGs img/p00.png..., row ``n`` of category ``n % len(categories)`` (a colour per category, noise
    per image), with a title and a price; only the ``header`` columns are written, the images only when ``images``."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for n in range(count):
        c = n % len(categories)
        if images:
            (folder / "img" / f"p{n:02d}.png").write_bytes(noisy_png((60 * c, 90, 200), n, size=16))
        rows.append({"path": f"img/p{n:02d}.png", "category": categories[c],
                     "title": f"a {categories[c]} called item {n}", "price": f"{10 + n}.50"})
    manifest = folder / "manifest.csv"
    with open(manifest, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(header), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return manifest
