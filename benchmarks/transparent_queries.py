"""Transparent queries against the demo gallery: Recall@1 as a plain ``convert("RGB")`` reads them, and as the decoder
reads them (alpha composited onto the model's background).

Queries are test emoji drawn by our own renderer on a transparent background (black under alpha 0, as many exported
icons are), saved as PNG bytes as an upload would be. The gallery (built by ``make demo``) holds every test emoji in
both styles drawn on white; a query's own style twin is left out of its results, so a hit is the same emoji in the
other style, the demo's evaluation protocol. The white rendering of the same queries is the reference.

    .venv/bin/python benchmarks/transparent_queries.py --demo artifacts/demo --count 600 \
        --plot docs/results/transparent_queries.png
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
from pathlib import Path

import numpy as np
from PIL import Image

from retrieval.data.colour import flatten_alpha
from retrieval.data.decode import read_image
from retrieval.data.emoji import default_renderers
from retrieval.index import Index

READINGS = {
    "read with Pillow's convert(\"RGB\") (black under the transparent pixels)":
        lambda png: Image.open(io.BytesIO(png)).convert("RGB"),
    "read by read_image (composited onto the background)": lambda png: read_image(png).image,
}
REFERENCE = "reference: the same emoji drawn on white"


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_queries(manifest: Path, count: int, seed: int) -> list[tuple[str, str]]:
    """(sequence, style) pairs of the test emoji the demo indexed (its manifest's test rows), a seeded sample."""
    with manifest.open(newline="") as f:
        pairs = sorted((row["label"], Path(row["path"]).stem) for row in csv.DictReader(f) if row["split"] == "test")
    random.Random(seed).shuffle(pairs)
    return pairs[:count]


def recall_at_1(index: Index, embeddings: np.ndarray, queries: list[tuple[str, str]]) -> dict[str, float]:
    """Recall@1 two ways: the other style (the query's own style twin left out, the demo's protocol) and the same
    drawing (is the top result the very gallery image the query was made from?)."""
    other_style = same_drawing = 0
    for (sequence, style), results in zip(queries, index.search(embeddings, k=2), strict=True):
        twin = [r.label == sequence and Path(r.path).stem == style for r in results]
        others = [r for r, is_twin in zip(results, twin, strict=True) if not is_twin]
        other_style += bool(others) and others[0].label == sequence
        same_drawing += bool(twin) and twin[0]
    return {"other style": other_style / len(queries), "same drawing": same_drawing / len(queries)}


def plot(path: Path, recalls: dict[str, float], samples: list[dict[str, Image.Image]], queries: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 4.4))
    bars = fig.add_axes([0.06, 0.15, 0.4, 0.7])
    names = ['convert("RGB")', "read_image", "white reference"]
    colours = ["#c44e52", "#55a868", "#8c8c8c"]
    ways = list(next(iter(recalls.values())))
    width = 0.8 / len(names)
    for n, (name, colour) in enumerate(zip(names, colours, strict=True)):
        values = [100 * list(recalls.values())[n][way] for way in ways]
        xs = [w + (n - 1) * width for w in range(len(ways))]
        bars.bar(xs, values, width, color=colour, label=name)
        for x, v in zip(xs, values, strict=True):
            bars.text(x, v + 1, f"{v:.0f}", ha="center", fontsize=8)
    bars.set_xticks(range(len(ways)), [f"Recall@1, {way}" for way in ways])
    bars.set_ylabel("Recall@1 (%)")
    bars.set_ylim(0, 115)
    bars.legend(loc="upper left", fontsize=8)
    bars.set_title(f"{queries} transparent emoji PNG queries, demo gallery")
    rows = ["what the model saw before", "what it sees now"]
    for col, sample in enumerate(samples):
        for row, key in enumerate(("before", "after")):
            ax = fig.add_axes([0.5 + col * 0.098, 0.5 - row * 0.42, 0.09, 0.36])
            ax.imshow(sample[key])
            ax.set_xticks([])
            ax.set_yticks([])
            if col == 0:
                ax.set_ylabel(rows[row], fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--demo", type=Path, default=Path("artifacts/demo"), help="what `make demo` built")
    parser.add_argument("--count", type=int, default=600, help="number of transparent queries")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, help="write a picture: Recall@1 bars and what the model saw")
    parser.add_argument("--json", type=Path, help="write the numbers as JSON")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("transparent-queries", args.save)

    index_dir = args.demo / "index"
    queries = test_queries(args.demo / "data" / "emoji" / "manifest.csv", args.count, args.seed)
    clear = default_renderers(background=None)
    white = default_renderers()
    uploads = [png_bytes(clear[style].render(sequence)) for sequence, style in queries]
    reference = [white[style].render(sequence) for sequence, style in queries]

    recalls, embedded = {}, {}
    with Index.open(index_dir) as index:
        embedder = index.embedder
        for name, read in READINGS.items():
            embedded[name] = embedder.embed([read(png) for png in uploads])
            recalls[name] = recall_at_1(index, embedded[name], queries)
        embedded[REFERENCE] = embedder.embed(reference)
        recalls[REFERENCE] = recall_at_1(index, embedded[REFERENCE], queries)
    after = embedded[list(READINGS)[1]]
    cosine = np.sum(after * embedded[REFERENCE], axis=1) / (
        np.linalg.norm(after, axis=1) * np.linalg.norm(embedded[REFERENCE], axis=1))

    result = {
        "queries": len(queries),
        "gallery": str(index_dir),
        "recall@1": {name: {way: round(v, 4) for way, v in value.items()} for name, value in recalls.items()},
        "min_cosine_after_fix_vs_white": round(float(cosine.min()), 6),
    }
    print(json.dumps(result, indent=2, ensure_ascii=False))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    if args.plot:
        samples = [{"before": Image.open(io.BytesIO(png)).convert("RGB"), "after": flatten_alpha(read_image(png).image)}
                   for png in uploads[:5]]
        plot(args.plot, recalls, samples, len(queries))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
