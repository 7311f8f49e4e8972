"""The local engine's decoding in DataLoader workers: ``gallery_file.decode_file`` per image, batched.

A bad file never stops a build: each image comes back either as a preprocessed array or as an error
reason (see ``gallery_file``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.index.gallery_file import Decoded, decode_file

__all__ = ["Decoded", "DecodedBatch", "GalleryDecodeDataset", "collate_decoded", "decode_file"]

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
            self._transform = EvalPreprocess(self.model_config)
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
