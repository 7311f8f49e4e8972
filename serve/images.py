"""Turning untrusted query bytes into an image, with the errors an HTTP client can act on.

Decoding is ``retrieval.data.decode.read_image``, the function every other path uses too. It estimates from the
header what a decode will hold, refuses an image over ``MAX_DECODE_BYTES`` (one decode stays under 300 MB), and the
decodes running at once share ``DECODE_BUDGET`` (twice that): the server's memory for decoding is bounded by that
budget, not by the number of requests in flight, while many small images still decode at once.
"""

from __future__ import annotations

import base64
import binascii

from retrieval.data.decode import DecodedImage, ImageDecodeError, read_image
from retrieval.data.formats import ACCEPTED_FORMATS_TEXT


class QueryError(ValueError):
    """A bad query; ``status`` is the HTTP status code that describes it."""

    def __init__(self, message: str, status: int = 400, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # a 503 that passes: the Retry-After header


QUERY_MESSAGES = {
    "empty": "the image is empty (0 bytes)",
    "not_image": f"the upload is not an image we can read (expected {ACCEPTED_FORMATS_TEXT})",
}


def decode_query(data: bytes, max_bytes: int, max_pixels: int) -> DecodedImage:
    """Bytes of an image file -> ``DecodedImage`` (RGB or RGBA, notes such as 'animated'), fully decoded now.

    413 when the file is over ``max_bytes``; 400 when it is empty, not an image, truncated, or declares more
    than ``max_pixels`` pixels or more memory than one decode may use (refused before decoding).
    """
    if len(data) > max_bytes:
        raise QueryError(
            f"image is {len(data)} bytes, over the limit of {max_bytes} bytes; send a smaller "
            "image (or start the server with a larger --max-upload-mb)",
            413,
        )
    try:
        return read_image(data, max_pixels)  # waits for its share of DECODE_BUDGET
    except ImageDecodeError as exc:
        if exc.kind == "too_large":
            raise QueryError(f"image refused: {exc}") from exc
        raise QueryError(QUERY_MESSAGES.get(exc.kind, str(exc))) from exc


def decode_base64(text: str, max_bytes: int) -> bytes:
    """A base64 string (or a ``data:image/...;base64,`` URL) -> bytes; 413 when it decodes too large."""
    if not isinstance(text, str):
        raise QueryError("'image' must be a base64 string")
    if text.startswith("data:"):
        _, _, text = text.partition(",")
    # 4 base64 characters carry 3 bytes: refuse an oversized payload before decoding it
    if len(text) * 3 // 4 > max_bytes + 3:
        raise QueryError(
            f"image is about {len(text) * 3 // 4} bytes, over the limit of {max_bytes} bytes", 413
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise QueryError(f"'image' is not valid base64: {exc}") from exc
