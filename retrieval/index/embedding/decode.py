"""The local engine's decoding in worker processes: ``gallery_file.decode_file`` per image, batched.

``decoded_batches`` gives the batches in order from one of two loaders: torch's DataLoader when torch is installed
(its batches cross to the embedding process in shared memory), else, in the base install (no torch), a process
pool of the standard library's (``pool_batches``; its batches are pickled through a pipe). Both decode with
``GalleryDecodeDataset``. A bad file never stops a build: each image comes back either as a preprocessed array or as
an error reason (see ``gallery_file``).
"""

from __future__ import annotations

import importlib.util
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.embedding.gallery_file import Decoded, decode_file

if TYPE_CHECKING:
    import torch

__all__ = ["Decoded", "DecodedBatch", "GalleryDecodeDataset", "collate_decoded", "decode_file", "decoded_batches",
           "pool_batches", "stack_decoded"]

PREFETCH = 4  # batches decoded ahead per worker process (the DataLoader's prefetch_factor)


class GalleryDecodeDataset:
    """``dataset[i]`` decodes the i-th pending image into a ``Decoded`` record (a map-style data set for torch's
    DataLoader, which needs no base class, and for ``pool_batches``)."""

    def __init__(
        self,
        items: Sequence[tuple[int, str]],
        preprocessing: ModelPreprocessing,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.items = list(items)
        self.preprocessing = preprocessing
        self.max_pixels = int(max_pixels)
        self._transform = None

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Decoded:
        if self._transform is None:  # built lazily: once per worker process
            self._transform = EvalPreprocess(self.preprocessing)
        image_id, path = self.items[index]
        return decode_file(image_id, path, self._transform, self.max_pixels)


@dataclass
class DecodedBatch:
    records: list[Decoded]  # every image of the batch, arrays dropped
    ok_index: list[int]  # positions in records of the readable images, in batch order
    batch: np.ndarray | torch.Tensor | None  # float32 [n_ok, 3, S, S]: a tensor from the DataLoader

    def array(self) -> np.ndarray:
        """The readable images' batch as a NumPy array (a view of the DataLoader's tensor, not a copy)."""
        return np.asarray(self.batch)


def collate_decoded(records: list[Decoded]) -> DecodedBatch:
    """Runs in the DataLoader's worker: stack the readable images into one contiguous batch.

    The batch is a torch tensor so that the DataLoader hands it over through shared memory; a NumPy array
    would be pickled through a pipe (about 19 MB per batch of 32 at 224 px), costing both processes CPU.
    """
    import torch  # only the DataLoader calls this, so torch is installed

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


def stack_decoded(records: list[Decoded]) -> DecodedBatch:
    """``collate_decoded`` without torch: the readable images stacked into one NumPy batch."""
    ok = [i for i, r in enumerate(records) if r.array is not None]
    batch = np.stack([records[i].array for i in ok]).astype(np.float32, copy=False) if ok else None
    for record in records:
        record.array = None
    return DecodedBatch(records, ok, batch)


def decoded_batches(dataset: GalleryDecodeDataset, batch_size: int, workers: int) -> Iterable[DecodedBatch]:
    """``dataset``'s batches in order, decoded in ``workers`` processes (0: in this one): torch's DataLoader when
    torch is installed, else ``pool_batches``."""
    if importlib.util.find_spec("torch") is None:
        return pool_batches(dataset, batch_size, workers)
    from torch.utils.data import DataLoader

    return DataLoader(dataset, batch_size=batch_size, num_workers=workers, shuffle=False, collate_fn=collate_decoded,
                      prefetch_factor=PREFETCH if workers else None)


def decode_items(items: Sequence[tuple[int, str]], preprocessing: ModelPreprocessing, max_pixels: int
                 ) -> DecodedBatch:
    """One batch of ``(id, path)`` items decoded and stacked (a pool task: everything it needs is in its arguments)."""
    dataset = GalleryDecodeDataset(items, preprocessing, max_pixels)
    return stack_decoded([dataset[i] for i in range(len(dataset))])


def pool_batches(dataset: GalleryDecodeDataset, batch_size: int, workers: int) -> Iterator[DecodedBatch]:
    """``dataset``'s batches in order, decoded by a pool of ``workers`` processes (0: in this one), at most
    ``PREFETCH`` batches per process ahead of the caller, so memory stays bounded on any gallery."""
    batches = (dataset.items[start:start + batch_size] for start in range(0, len(dataset), batch_size))
    if workers == 0:
        for items in batches:
            yield decode_items(items, dataset.preprocessing, dataset.max_pixels)
        return
    pool = ProcessPoolExecutor(workers)
    ahead: deque[Future[DecodedBatch]] = deque()
    try:
        for items in batches:
            ahead.append(pool.submit(decode_items, items, dataset.preprocessing, dataset.max_pixels))
            if len(ahead) >= workers * PREFETCH:
                yield _result(ahead.popleft())
        while ahead:
            yield _result(ahead.popleft())
    finally:  # also when the caller stops early: the batches not started are dropped, not decoded
        pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future[DecodedBatch]) -> DecodedBatch:
    try:
        return future.result()
    except BrokenProcessPool as exc:  # a worker was killed (out of memory, a signal): say so, not the pool's words
        raise RuntimeError("an image-decoding worker process died (out of memory?); run the command again to resume "
                           "where it stopped, with fewer `workers` or a smaller `max_pixels`") from exc
