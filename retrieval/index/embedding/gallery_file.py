"""One gallery file: hash its bytes, decode it and preprocess it, without torch (both index engines use it).

A bad file never stops a build: the image comes back either as a preprocessed array or as an error reason
from ``retrieval.data.decode.read_image`` (empty, not a regular file, not an image, truncated, or over the
pixel limit). The sha256 of the file's bytes is computed here, so exact duplicates are found without
decoding twice.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from retrieval.data.decode import describe_decode_error, open_regular_file, read_image

HASH_CHUNK = 1 << 20


@dataclass
class Decoded:
    id: int
    size: int | None = None
    sha256: str | None = None
    array: np.ndarray | None = None  # the transform's output when readable (float32 or uint8 [3, S, S])
    error: str | None = None


def file_digest(handle: BinaryIO) -> tuple[str, int]:
    """(sha256 hex, size in bytes) of an open file's bytes from where it stands, read in chunks."""
    digest, size = hashlib.sha256(), 0
    while chunk := handle.read(HASH_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return digest.hexdigest(), size


def decode_file(image_id: int, path: str, transform: Any, max_pixels: int) -> Decoded:
    """Hash the file's bytes (streamed, for duplicate detection), then decode and preprocess it."""
    result = Decoded(image_id)
    try:
        with open_regular_file(path) as handle:
            result.sha256, result.size = file_digest(handle)
            handle.seek(0)
            image = read_image(handle, max_pixels).image
        result.array = np.asarray(transform(image))
    except Exception as exc:  # noqa: BLE001  (any failure of one file is recorded, never fatal)
        result.error = describe_decode_error(exc)
        result.array = None
    return result
