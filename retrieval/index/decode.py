"""Reading, checking and preprocessing gallery images in DataLoader workers.

A bad file never stops a build: each image comes back either as a preprocessed array or as an error
reason (empty file, unreadable, not an image, truncated, or over the pixel limit, which guards against
decompression bombs). The sha256 of the file's bytes is computed here, so exact duplicates are found
without decoding twice.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps
from torch.utils.data import Dataset

# PIL's own default limit (about 89.5 megapixels, a 1 GB RGBA buffer); larger images are refused.
DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


@dataclass
class Decoded:
    id: int
    size: int | None = None
    sha256: str | None = None
    array: np.ndarray | None = None  # float32 [3, S, S] when readable
    error: str | None = None


def read_image_bytes(data: bytes, max_pixels: int) -> Image.Image:
    """Decode fully (so truncation shows up now) and return an RGB image with EXIF orientation applied."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > max_pixels:
                raise Image.DecompressionBombError(
                    f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels} "
                    "(possible decompression bomb; raise --max-pixels to allow it)"
                )
            image.load()
            return ImageOps.exif_transpose(image).convert("RGB")


def describe_error(exc: BaseException) -> str:
    if isinstance(exc, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"too large: {exc}"
    if isinstance(exc, Image.UnidentifiedImageError):
        return "not an image (unrecognised format)"
    if isinstance(exc, PermissionError):
        return f"unreadable: permission denied ({exc.strerror})"
    if isinstance(exc, OSError) and "truncated" in str(exc).lower():
        return f"truncated image: {exc}"
    return f"unreadable: {type(exc).__name__}: {exc}"


def decode_file(image_id: int, path: str, transform: Any, max_pixels: int) -> Decoded:
    result = Decoded(image_id)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        result.size, result.sha256 = len(data), hashlib.sha256(data).hexdigest()
        if not data:
            result.error = "empty file (0 bytes)"
            return result
        image = read_image_bytes(data, max_pixels)
        result.array = np.asarray(transform(image), dtype=np.float32)
    except Exception as exc:  # noqa: BLE001  (any failure of one file is recorded, never fatal)
        result.error = describe_error(exc)
        result.array = None
    return result


class GalleryDecodeDataset(Dataset):
    """``dataset[i]`` decodes the i-th pending image into a ``Decoded`` record."""

    def __init__(
        self,
        items: Sequence[tuple[int, str]],
        model_config: Mapping[str, Any],
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.items = list(items)
        self.model_config = dict(model_config)
        self.max_pixels = int(max_pixels)
        self._transform = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Decoded:
        if self._transform is None:  # built lazily: once per worker process
            from retrieval.data import build_transforms

            self._transform = build_transforms(self.model_config, train=False)
        image_id, path = self.items[index]
        return decode_file(image_id, path, self._transform, self.max_pixels)


@dataclass
class DecodedBatch:
    records: list[Decoded]  # every image of the batch, arrays dropped
    ok_index: list[int]  # positions in records of the readable images, in batch order
    batch: torch.Tensor | None  # float32 [n_ok, 3, S, S]


def collate_decoded(records: list[Decoded]) -> DecodedBatch:
    """Runs in the worker: stack the readable images into one contiguous batch.

    The batch is a torch tensor so that the DataLoader hands it over through shared memory; a NumPy array
    would be pickled through a pipe (about 19 MB per batch of 32 at 224 px), costing both processes CPU.
    """
    ok = [i for i, r in enumerate(records) if r.array is not None]
    batch = None
    if ok:
        arrays = [torch.from_numpy(records[i].array) for i in ok]
        # stacked straight into shared memory: the DataLoader then passes a handle, not another copy
        batch = torch.empty((len(ok), *arrays[0].shape), dtype=torch.float32)
        if torch.utils.data.get_worker_info() is not None:
            batch.share_memory_()
        torch.stack(arrays, out=batch)
    for record in records:
        record.array = None
    return DecodedBatch(records, ok, batch)
