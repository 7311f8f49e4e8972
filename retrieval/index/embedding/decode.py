"""The local engine's decoding: ``gallery_file.decode_file`` per image, in threads of the embedding process, batched.

``thread_batches`` gives the batches in order while the model embeds the batch before them: PIL decodes and resizes,
and NumPy normalises, with the GIL released, so threads decode in parallel with onnxruntime's own threads, with no
process to start, no torch to import and no batch to copy between processes. Measured (docs/BENCHMARKS.md "CPU
throughput"): a build of 1,000 images ran at 0.9-1.0 of the bare decode + session loop's speed on 2 and on 16 cores,
where torch's DataLoader workers left it at 0.66 (2 cores), and worker processes returning their batches through a
pipe decoded at a third of the threads' rate. A bad file never stops a build: each image comes back either as a
preprocessed array or as an error reason (see ``gallery_file``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.embedding.gallery_file import Decoded, decode_file

__all__ = ["Decoded", "DecodedBatch", "GalleryDecodeDataset", "decode_file", "thread_batches"]

AHEAD = 2  # batches decoded ahead of the one the model embeds: enough to keep the threads busy, bounded in memory


class GalleryDecodeDataset:
    """``dataset[i]`` decodes the i-th pending image into a ``Decoded`` record."""

    def __init__(
        self,
        items: Sequence[tuple[int, str]],
        preprocessing: ModelPreprocessing,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.items = list(items)
        self.preprocessing = preprocessing
        self.max_pixels = int(max_pixels)
        self._transform = EvalPreprocess(preprocessing)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Decoded:
        image_id, path = self.items[index]
        return decode_file(image_id, path, self._transform, self.max_pixels)


@dataclass
class DecodedBatch:
    records: list[Decoded]  # every image of the batch, arrays dropped
    ok_index: list[int]  # positions in records of the readable images, in batch order
    batch: np.ndarray | None  # float32 [n_ok, 3, S, S]

    def array(self) -> np.ndarray:
        """The readable images' batch."""
        return np.asarray(self.batch)


def thread_batches(dataset: GalleryDecodeDataset, batch_size: int, threads: int) -> Iterator[DecodedBatch]:
    """``dataset``'s batches in order, decoded by ``threads`` threads of this process (PIL and NumPy release the GIL
    while they decode, resize and normalise), at most ``AHEAD`` batches ahead of the caller. Each thread writes its
    image into the batch's own array, so the caller's thread, which runs the model, never stacks a batch."""
    size = dataset.preprocessing.input_size
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="decode")
    ahead: deque[tuple[np.ndarray, list[Future[Decoded]]]] = deque()

    def into(batch: np.ndarray, row: int, index: int) -> Decoded:
        record = dataset[index]
        if record.array is not None:
            batch[row] = record.array
            record.array = None
        return record

    def handed_over(batch: np.ndarray, futures: list[Future[Decoded]]) -> DecodedBatch:
        records = [future.result() for future in futures]
        ok = [i for i, record in enumerate(records) if record.error is None]
        kept = batch if len(ok) == len(batch) else batch[ok]  # a copy only where some image could not be read
        return DecodedBatch(records, ok, kept if ok else None)

    try:
        for start in range(0, len(dataset), batch_size):
            indices = range(start, min(start + batch_size, len(dataset)))
            batch = np.empty((len(indices), 3, size, size), np.float32)
            ahead.append((batch, [pool.submit(into, batch, row, i) for row, i in enumerate(indices)]))
            if len(ahead) > AHEAD:
                yield handed_over(*ahead.popleft())
        while ahead:
            yield handed_over(*ahead.popleft())
    finally:  # also when the caller stops early: the images not started are dropped, not decoded
        pool.shutdown(wait=True, cancel_futures=True)
