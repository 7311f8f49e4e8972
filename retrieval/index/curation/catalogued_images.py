"""The index's images as pictures: a catalogued file read by id (``catalogued_image_loader``), which of a group of
copies is kept (``KeptImage``: the most detailed), and the colour the model puts transparent pixels on
(``picture_background``), for pictures drawn as it sees images.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import PurePath
from typing import Any

from PIL import Image

from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.index.curation.copy_verification import CheckedPair
from retrieval.index.query_embedder import ImageEmbedder, NoModel
from retrieval.index.search import Index

log = logging.getLogger(__name__)
# members holding the content at this share of the most pixels or more (along a side) count as holding it whole:
# the fitted scale is measured to a few per cent
RESOLUTION_TOLERANCE = 1.1
TURN_TOLERANCE = 2.0  # degrees within which two members are upright alike (the fitted turn's error: under 1)


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


class KeptImage:
    """Which image of a verified group is kept (``copy_groups``' ``keep``): an original rather than its copies. Each
    member is placed against the group's first by its verified comparison (the fitted scale and turn) and its file's
    size, read from its header:

    1. the members holding the content at the most pixels (its size times the fitted scale, within
       ``RESOLUTION_TOLERANCE``): a downscaled copy holds it at fewer; a canvas widened by a turn adds none;
    2. of those, the ones upright with the most members (within ``TURN_TOLERANCE`` degrees): a turned copy is turned
       against the original and its other copies; where a turn splits them evenly, the side with the smaller
       canvas (a turn widens it);
    3. of those, the most pixels (an original holds what its crops hold and more); then a name that another
       member's extends (photo.jpg before photo (1).jpg or photo_small.jpg); then the largest file (the least
       compressed: the catalogue's bytes); then the first path."""

    def __init__(self, index: Index, loaded_sides: Mapping[int, int] | None = None) -> None:
        self.index, self.loaded_sides = index, loaded_sides or {}

    def __call__(self, head: int, joined: Sequence[tuple[int, CheckedPair]]) -> int:
        """The member of the group (``head`` and ``joined``: each with its pair against ``head``) to keep."""
        members = [head, *(i for i, _ in joined)]
        rows = self.index.indexed_rows(members)
        sizes = {i: self._size(i, rows.get(i)) for i in members}
        resolution, turn = {head: 0.0}, {head: 0.0}  # against the head: log of pixels per pixel, degrees
        for other, pair in joined:
            comparison, sides = pair.comparison, [max(sizes[i]) for i in (pair.first, pair.second)]
            if comparison is None or comparison.scale is None or comparison.rotation is None or not all(sides):
                resolution[other], turn[other] = -math.inf, math.inf
                continue
            # the scale maps the first's working image (its longer side at one size) onto the second's
            ratio = math.log(comparison.scale * sides[1] / sides[0])
            resolution[other], turn[other] = (ratio, comparison.rotation) if pair.first == head else \
                (-ratio, -comparison.rotation)
        best = max(resolution.values())
        full = [i for i in members if resolution[i] >= best - math.log(RESOLUTION_TOLERANCE)]

        def upright_with(i: int) -> list[int]:
            return [m for m in full if abs(turn[m] - turn[i]) <= TURN_TOLERANCE]

        def pixels(i: int) -> int:
            return sizes[i][0] * sizes[i][1]

        votes = {i: sum(abs(turn[m] - turn[i]) <= TURN_TOLERANCE for m in members) for i in full}
        most = max(votes.values())
        side = min((i for i in full if votes[i] == most), key=lambda i: (max(map(pixels, upright_with(i))), i))
        candidates = upright_with(side)
        stems = {i: _stem(rows.get(i)) for i in members}
        return min(candidates, key=lambda i: (
            -pixels(i), any(stems[i] != stems[m] and stems[i].startswith(stems[m]) for m in candidates),
            -int((rows.get(i) or {}).get("size") or 0), str((rows.get(i) or {}).get("path", "")), i))

    def _size(self, image_id: int, row: dict[str, Any] | None) -> tuple[int, int]:
        """(width, height) of the image's file as its header states it, else its longer side as it was loaded
        (both sides; 0: unknown)."""
        size = _header_size(self.index.image_file(row["path"])) if row is not None else None
        if size is None:
            side = int(self.loaded_sides.get(image_id, 0))
            return side, side
        return size


def _stem(row: dict[str, Any] | None) -> str:
    """The catalogued path without its extension (a copy's name often extends its original's)."""
    return "" if row is None else str(PurePath(str(row["path"])).with_suffix(""))


def _header_size(path: str | None) -> tuple[int, int] | None:
    """(width, height) as the image file's header states it (no pixel decoded); None when it cannot be read."""
    from retrieval.data.decode import DEFAULT_MAX_PIXELS, open_regular_file
    from retrieval.data.formats import ACCEPTED_FORMATS

    if path is None:
        return None
    try:
        with warnings.catch_warnings():
            # a header past Pillow's pixel limit is an error (DecompressionBombWarning/Error), caught below
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            # only the formats the decoder opens: no other plugin sees a gallery's bytes
            with open_regular_file(path) as handle, Image.open(handle, formats=ACCEPTED_FORMATS) as image:
                width, height = image.size
    except Exception:  # noqa: BLE001  (an unreadable or oversized file ranks by what was loaded of it)
        return None
    # a header claiming more than the decoder loads is not believed: the loaded size ranks the file
    return (int(width), int(height)) if 0 < width * height <= DEFAULT_MAX_PIXELS else None
