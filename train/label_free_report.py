"""The report of a run without labels: how far the images' neighbourhoods moved from the start, epoch by epoch; how
the pseudo-labels grouped the images and how steady the groups were; and the images that moved most, drawn with
their neighbours at the start and now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import KEPT, KEPT_K
from retrieval.data.dataset import sample_source
from retrieval.pseudo_labels import moved_most
from retrieval.train.pseudo_labelling import PSEUDO_LABELS_KEY
from retrieval.utils.unit_rows import l2_normalize_rows

MOVED_PICTURE = "moved.png"
MOVED_SHOWN = 8  # rows of the picture
NEIGHBOURS_SHOWN = 3  # neighbours at the start, then now, beside each image


def label_free_section(out: Path, history: list[dict[str, Any]], start, now, sample, pseudo_labels: str,
                       with_plots: bool = True) -> dict[str, Any]:
    """The report's ``label_free``: ``start`` and ``now`` are the sampled images as embedded at the start and at the
    last evaluation (``.embeddings``, ``.indices`` into ``sample``)."""
    section: dict[str, Any] = {
        "pseudo_labels": pseudo_labels,
        "kept": [{"epoch": row["epoch"], KEPT: row[KEPT]} for row in history if KEPT in row],
        "groups": [{"epoch": row["epoch"], **row[PSEUDO_LABELS_KEY]} for row in history if PSEUDO_LABELS_KEY in row],
        "moved_most": [],
    }
    if start is None or now is None:
        return section
    common, at_start, at_now = np.intersect1d(start.indices, now.indices, return_indices=True)
    if len(common) <= KEPT_K:
        return section
    before = l2_normalize_rows(start.embeddings[at_start], zero_rows="keep")
    after = l2_normalize_rows(now.embeddings[at_now], zero_rows="keep")
    moved = moved_most(before, after, k=KEPT_K, count=MOVED_SHOWN)
    rows = [int(r) for r in moved["rows"]]
    section["moved_most"] = [{"image": _name(sample, int(common[r])), "kept": float(moved["overlap"][r])}
                             for r in rows]
    if with_plots and rows:
        picture = _moved_picture(sample, common, before, after, rows, moved["overlap"])
        if picture is not None:
            picture.save(out / MOVED_PICTURE)
            section["picture"] = MOVED_PICTURE
    return section


def _name(sample, index: int) -> str:
    try:
        return str(sample_source(sample, index))
    except Exception:  # an in-memory image has no file: its row names it
        return f"image {index}"


def _moved_picture(sample, common: np.ndarray, before: np.ndarray, after: np.ndarray, rows: list[int],
                   overlap: np.ndarray):
    """A row per image that moved most: the image (red), its nearest at the start (grey), its nearest now (blue)."""
    from retrieval.analysis.neighbour_pictures import KEPT as NOW_COLOUR
    from retrieval.analysis.neighbour_pictures import OTHER, SUSPECT, Tile, draw_rows

    def nearest(vectors: np.ndarray, row: int) -> list[int]:
        similarity = vectors @ vectors[row]
        similarity[row] = -np.inf
        return np.argsort(-similarity, kind="stable")[:NEIGHBOURS_SHOWN].tolist()

    tiles = []
    for row in rows:
        line = [Tile(int(common[row]), f"kept {overlap[row]:.0%}", SUSPECT)]
        line += [Tile(int(common[n]), "at the start", OTHER) for n in nearest(before, row)]
        line += [Tile(int(common[n]), "now", NOW_COLOUR) for n in nearest(after, row)]
        tiles.append(line)

    def load(index: int):
        return sample.dataset.load_image(sample.indices[index]) if hasattr(sample, "indices") else \
            sample.load_image(index)

    title = (f"The images whose neighbourhood moved most: each (red, the share of its {KEPT_K} nearest neighbours "
             f"kept) with its {NEIGHBOURS_SHOWN} nearest at the start (grey) and now (blue)")
    return draw_rows(tiles, load, title)
