"""Turning untrusted query bytes into a PIL image, with the errors an HTTP client can act on."""

from __future__ import annotations

import base64
import binascii
import warnings

from PIL import Image

from retrieval.index.decode import read_image_bytes


class QueryError(ValueError):
    """A bad query; ``status`` is the HTTP status code that describes it."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def decode_image(data: bytes, max_bytes: int, max_pixels: int) -> Image.Image:
    """Bytes of an image file -> RGB PIL image (EXIF orientation applied), fully decoded now.

    413 when the file is over ``max_bytes``; 400 when it is empty, not an image, truncated, or
    declares more than ``max_pixels`` pixels (a decompression bomb is refused before decoding).
    """
    if len(data) > max_bytes:
        raise QueryError(
            f"image is {len(data)} bytes, over the limit of {max_bytes} bytes; send a smaller "
            "image (or start the server with a larger --max-upload-mb)",
            413,
        )
    if not data:
        raise QueryError("the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return read_image_bytes(data, max_pixels)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise QueryError(f"image refused as a possible decompression bomb: {exc}") from exc
    except Image.UnidentifiedImageError as exc:
        raise QueryError(
            "the upload is not an image PIL can read (expected JPEG, PNG, WebP, BMP or GIF)"
        ) from exc
    except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
        raise QueryError(f"the image could not be decoded ({type(exc).__name__}: {exc})") from exc


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
