"""Reading, checking and preprocessing gallery images in DataLoader workers.

A bad file never stops a build: each image comes back either as a preprocessed array or as an error
reason from ``retrieval.data.decode.read_image`` (empty, not a regular file, not an image, truncated, or over
the pixel limit). The sha256 of the file's bytes is computed here, so exact duplicates are found without
decoding twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from retrieval.data.decode import DEFAULT_MAX_PIXELS, describe_decode_error, open_regular_file, read_image

HASH_CHUNK = 1 << 20


@dataclass
class Decoded:
    id: int
    size: int | None = None
    sha256: str | None = None
    array: np.ndarray | None = None  # float32 [3, S, S] when readable
    error: str | None = None


def decode_file(image_id: int, path: str, transform: Any, max_pixels: int) -> Decoded:
    """Hash the file's bytes (streamed, for duplicate detection), then decode and preprocess it."""
    result = Decoded(image_id)
    try:
        with open_regular_file(path) as handle:
            digest, size = hashlib.sha256(), 0
            while chunk := handle.read(HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
            result.size, result.sha256 = size, digest.hexdigest()
            handle.seek(0)
            image = read_image(handle, max_pixels).image
        result.array = np.asarray(transform(image), dtype=np.float32)
    except Exception as exc:  # noqa: BLE001  (any failure of one file is recorded, never fatal)
        result.error = describe_decode_error(exc)
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
