"""Embed catalogued gallery files (id, path) with a model, a batch at a time: what an upgrade writes and what a
model comparison reads. Decoding is the index build's (``decode.thread_batches``: threads, the next batch's images
while the model embeds this one); an unreadable file comes back as its reason, never as an exception."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.index.embedding.decode import GalleryDecodeDataset, thread_batches
from retrieval.index.embedding.gallery_file import Decoded
from retrieval.index.query_embedder import ImageEmbedder, prepare_vectors


@dataclass
class EmbeddedRows:
    ids: np.ndarray  # int64 [n] of the readable rows, in the order given
    vectors: np.ndarray  # float32 [n, d], L2-normalised
    records: list[Decoded] = field(default_factory=list)  # every row given: sha256, size, or the error (arrays dropped)


class RowEmbedder:
    """``embed(rows)``: the new vectors of catalogued files, decoded by ``workers`` threads."""

    def __init__(self, embedder: ImageEmbedder, batch_size: int = 64, workers: int = 1,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.embedder, self.batch_size, self.max_pixels = embedder, int(batch_size), int(max_pixels)
        self.workers = max(1, int(workers))

    def embed(self, rows: Sequence[tuple[int, str]]) -> EmbeddedRows:
        """Decode and embed ``rows`` (catalogue id, path), ``batch_size`` images per model call."""
        dim = int(self.embedder.embedding_dim)
        ids, parts, records = [], [np.zeros((0, dim), np.float32)], []
        dataset = GalleryDecodeDataset(rows, self.embedder.preprocessing, self.max_pixels)
        for decoded in thread_batches(dataset, self.batch_size, self.workers):
            if decoded.ok_index:
                parts.append(prepare_vectors(self.embedder.embed(decoded.array()), dim))
                ids += [decoded.records[i].id for i in decoded.ok_index]
            records += decoded.records
        return EmbeddedRows(np.asarray(ids, dtype=np.int64), np.concatenate(parts), records)
