"""The index's images as pictures: a catalogued file read by id (``catalogued_image_loader``), and the colour the
model puts transparent pixels on (``picture_background``), for pictures drawn as it sees images.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from PIL import Image

from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.index.query_embedder import ImageEmbedder, NoModel
from retrieval.index.search import Index

log = logging.getLogger(__name__)


def picture_background(embedder: ImageEmbedder) -> tuple[int, int, int]:
    """The colour the model puts transparent pixels on (its ``background``), for pictures drawn as it sees images;
    white for an index built from embeddings (no model)."""
    if isinstance(embedder, NoModel):
        return DEFAULT_BACKGROUND
    return embedder.preprocessing.background


def index_picture_background(index: Index) -> tuple[int, int, int]:
    """``picture_background`` of the index's model, or white where the model cannot be loaded here: a picture of
    what the index holds needs no model, and a moved or missing one must not stop it."""
    try:
        return picture_background(index.embedder)
    except (ValueError, OSError) as exc:  # ParameterError (no model found) is a ValueError
        log.info("pictures drawn on white: the index's model could not be loaded (%s)", exc)
        return DEFAULT_BACKGROUND


def catalogued_image_loader(index: Index, max_pixels: int | None = None) -> Callable[[int], Image.Image | None]:
    """``load(id)``: the image of a catalogued file through the one decoder (bounded), None when unreadable now."""
    from retrieval.data.decode import DEFAULT_MAX_PIXELS, read_image

    def load(image_id: int) -> Image.Image | None:
        row = index.indexed_row(image_id)
        path = None if row is None else index.image_file(row["path"])  # where it is now: the gallery may have moved
        if path is None:
            return None
        try:
            return read_image(path, max_pixels or DEFAULT_MAX_PIXELS).image
        except Exception:  # noqa: BLE001  (a file unreadable now is passed over, as the index builder does)
            return None

    return load
