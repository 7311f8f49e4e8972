"""Pictures of what the neighbour graph found: near-duplicate groups (a row per group, the image kept first) and
label suspects (a row per suspect: the image, then its nearest neighbours, framed by whether their label is the one
suggested). Plain functions over the JSON summaries of ``retrieval.index.curation.duplicates`` and
``retrieval.index.curation.audit``; the caller gives ``load(key)`` (an image id, or a path in a folder) -> PIL image or
None when unreadable."""

from __future__ import annotations

import io
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from retrieval.analysis.pictures import _pyplot
from retrieval.analysis.plain_text import plain_text
from retrieval.data.colour import DEFAULT_BACKGROUND, flatten_alpha

KEPT, COPY, SUGGESTED, OTHER, SUSPECT = "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f", "#d62728"
PICTURE_ROWS = 8  # groups or suspects drawn (the summaries list more)
PICTURE_COLUMNS = 6  # images per row
CAPTION_CHARS = 24
CAPTION_LINES = 3  # a tile's caption: its label and its score
Load = Callable[[Any], Image.Image | None]


@dataclass(frozen=True)
class Tile:
    key: Any  # what ``load`` takes
    caption: str
    colour: str


def draw_rows(rows: Sequence[Sequence[Tile]], load: Load, title: str,
              background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image | None:
    """One picture: a row of thumbnails per entry of ``rows``, each framed in its colour with its caption and drawn
    as the model sees it (transparency on the model's ``background``); an image that cannot be loaded is a grey
    square. None when there is nothing to draw."""
    rows = [row for row in rows if row]
    if not rows:
        return None
    width = max(len(row) for row in rows)
    # decoded before drawing: the drawing lock (plain_text) is held to draw only, not to read files
    images = [[_safe_load(load, tile.key, background) for tile in row] for row in rows]
    with plain_text():
        plt = _pyplot()
        fig, axes = plt.subplots(len(rows), width, figsize=(1.55 * width, 1.8 * len(rows) + 0.4), squeeze=False)
        for r, row in enumerate(rows):
            for c in range(width):
                ax = axes[r][c]
                ax.set_xticks([])
                ax.set_yticks([])
                if c >= len(row):
                    ax.axis("off")
                    continue
                tile, image = row[c], images[r][c]
                ax.imshow(np.asarray(image) if image is not None else np.full((8, 8, 3), 200, np.uint8))
                for spine in ax.spines.values():
                    spine.set_edgecolor(tile.colour)
                    spine.set_linewidth(3)
                ax.set_title(_cut(tile.caption), fontsize=7, color=tile.colour)
        fig.suptitle("\n".join(textwrap.wrap(title, max(40, int(width * 1.55 * 13)))), fontsize=9)  # fits the width
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=90)
        plt.close(fig)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _safe_load(load: Load, key: Any, background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image | None:
    try:
        image = load(key)
    except Exception:  # noqa: BLE001  (a picture never fails for one unreadable file: it shows a grey square)
        return None
    if image is None:
        return None
    # composited as the model composites it: convert("RGB") alone shows the hidden colour (black, mostly)
    image = flatten_alpha(image, background).convert("RGB")
    image.thumbnail((128, 128))
    return image


def _one_line(text: str) -> str:
    """A label or a file name on one line: its own newlines would push the tile's score out of its caption."""
    return " ".join(text.splitlines())


def _cut(text: str) -> str:
    """A caption in at most ``CAPTION_LINES`` lines of ``CAPTION_CHARS``: a label may hold any number of newlines."""
    lines = text.split("\n")
    kept = [line if len(line) <= CAPTION_CHARS else line[:CAPTION_CHARS - 1] + "…" for line in lines[:CAPTION_LINES]]
    if len(lines) > CAPTION_LINES:
        kept[-1] = kept[-1][:CAPTION_CHARS - 1] + "…"
    return "\n".join(kept)


def duplicates_picture(summary: dict[str, Any], load: Load, key: str = "ids",
                       max_rows: int = PICTURE_ROWS, max_columns: int = PICTURE_COLUMNS,
                       background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image | None:
    """The first groups of a ``find_duplicates`` summary: the image kept (blue) then its copies (orange), each
    captioned with its cosine to the first; ``key``: the group field ``load`` takes (ids or paths); transparency
    drawn on ``background`` (the model's)."""
    rows = []
    for group in summary["groups"][:max_rows]:
        tiles = []
        for n, (item, similarity) in enumerate(zip(group[key], group["similarities"], strict=True)):
            if n >= max_columns:
                break
            score = "?" if similarity is None else f"{similarity:.3f}"
            name = f"id {item}" if key == "ids" else _one_line(str(item).rsplit("/", 1)[-1])
            tiles.append(Tile(item, f"{'kept' if n == 0 else 'copy'} {score}\n{name}", KEPT if n == 0 else COPY))
        rows.append(tiles)
    shown = min(len(summary["groups"]), max_rows)
    title = (f"Near-duplicate groups at cosine >= {summary['threshold']:.3f}: {shown} of {summary['groups_found']} "
             "shown, a row each (blue: kept, the first indexed; orange: its copies, with their cosine to it)")
    return draw_rows(rows, load, title, background)


PAIRS_DRAWN = 16  # similar pairs in their picture, two a row


def copies_picture(summary: dict[str, Any], load: Load, background: Sequence[int] = DEFAULT_BACKGROUND
                   ) -> Image.Image | None:
    """The first verified groups of a ``find_copies`` summary, a row each: the image kept (blue), then its copies
    (orange), each with its cosine to the first, the features agreeing and the aligned correlation."""
    rows = []
    for group in summary["groups"][:PICTURE_ROWS]:
        checks = [None, *group.get("checks", [])]
        tiles = []
        for n, (image_id, similarity) in enumerate(zip(group["ids"], group["similarities"], strict=True)):
            if n >= PICTURE_COLUMNS:
                break
            check = checks[n] if n < len(checks) else None
            score = "?" if similarity is None else f"{similarity:.3f}"
            # two lines, as the other pictures' captions: a third would run into the row above
            caption = f"kept\nid {image_id}" if n == 0 else (
                f"copy {score}, r {check['correlation']:.3f}\nid {image_id}, {check['inliers']} features" if check
                else f"copy {score}\nid {image_id}")
            tiles.append(Tile(image_id, caption, KEPT if n == 0 else COPY))
        rows.append(tiles)
    shown = min(len(summary["groups"]), PICTURE_ROWS)
    # two lines at three columns: a longer title squeezes the rows of a picture of few groups into each other
    title = (f"Verified copies: {shown} of {summary['groups_found']} groups, a row each (blue: the one kept; "
             "orange: its copies, cosine and aligned r)")
    return draw_rows(rows, load, title, background)


def similar_picture(summary: dict[str, Any], load: Load, background: Sequence[int] = DEFAULT_BACKGROUND
                    ) -> Image.Image | None:
    """The first candidate pairs not verified as copies, two a row (grey: neither is a copy of the other), each
    with its cosine and why it is not a copy: what a person looks at."""
    pairs = summary.get("similar", [])[:PAIRS_DRAWN]
    tiles = [tile for n, pair in enumerate(pairs, 1) for tile in (
        Tile(pair["ids"][0], f"pair {n}\nid {pair['ids'][0]}", OTHER),
        Tile(pair["ids"][1], f"id {pair['ids'][1]}, cos {pair['cosine']:.3f}\n{pair['reason'] or ''}", OTHER))]
    rows = [tiles[start:start + 4] for start in range(0, len(tiles), 4)]
    title = (f"Similar, not copies: {len(pairs)} of {summary.get('similar_found', 0)} candidate pairs shown, highest "
             "cosine first, two a row (each pair: its two images, their cosine and why they are not copies)")
    return draw_rows(rows, load, title, background)


def suspects_picture(summary: dict[str, Any], load: Load, key: str = "id",
                     max_rows: int = PICTURE_ROWS, max_columns: int = PICTURE_COLUMNS,
                     background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image | None:
    """The first suspects of an audit summary: the image (red, its label -> the suggested one, the score) then its
    nearest neighbours (green where their label is the suggested one, grey otherwise) with their cosine;
    transparency drawn on ``background`` (the model's)."""
    rows = []
    for suspect in summary["suspects"][:max_rows]:
        named = f"{_one_line(suspect['label'])} → {_one_line(suspect['suggested'])}"
        tiles = [Tile(suspect[key], f"{named}\nscore {suspect['score']:.2f}", SUSPECT)]
        for neighbour in suspect["neighbours"][:max_columns - 1]:
            colour = SUGGESTED if neighbour["label"] == suspect["suggested"] else OTHER
            tiles.append(Tile(neighbour[key], f"{_one_line(neighbour['label'])}\n{neighbour['similarity']:.3f}",
                              colour))
        rows.append(tiles)
    shown = min(len(summary["suspects"]), max_rows)
    title = (f"Label suspects: {shown} of {summary['suspects_found']} shown, a row each (red: the image, its label "
             "→ the one its neighbours suggest; then its nearest neighbours, green where they carry the suggestion)")
    return draw_rows(rows, load, title, background)
