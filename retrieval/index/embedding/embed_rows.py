"""Embed catalogued gallery files (id, path) with a model, a batch at a time: what an upgrade writes and what a
model comparison reads. Decoding runs in threads (``gallery_file.decode_file``: PIL releases the GIL while it
decodes), the next batch's while the model embeds this one; an unreadable file comes back as its reason, never as an
exception."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.index.embedding.gallery_file import Decoded, decode_file
from retrieval.index.query_embedder import ImageEmbedder, prepare_vectors


@dataclass
class EmbeddedRows:
    ids: np.ndarray  # int64 [n] of the readable rows, in the order given
    vectors: np.ndarray  # float32 [n, d], L2-normalised
    records: list[Decoded] = field(default_factory=list)  # every row given: sha256, size, or the error (arrays dropped)


class RowEmbedder:
    """``embed(rows)``: the new vectors of catalogued files; holds a decoding thread pool (a context manager)."""

    def __init__(self, embedder: ImageEmbedder, batch_size: int = 64, workers: int = 1,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
        self.embedder, self.batch_size, self.max_pixels = embedder, int(batch_size), int(max_pixels)
        self.preprocess = EvalPreprocess(embedder.preprocessing)
        self.pool = ThreadPoolExecutor(max(1, int(workers)))

    def __enter__(self) -> RowEmbedder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown()

    def embed(self, rows: Sequence[tuple[int, str]]) -> EmbeddedRows:
        """Decode and embed ``rows`` (catalogue id, path), ``batch_size`` images per model call."""
        dim = int(self.embedder.embedding_dim)
        ids, parts, records = [], [np.zeros((0, dim), np.float32)], []
        starts = range(0, len(rows), self.batch_size)
        pending = [self.pool.submit(self._decode, row) for row in rows[:self.batch_size]]
        for start in starts:
            decoded = [future.result() for future in pending]
            # the next batch decodes while this one is embedded
            pending = [self.pool.submit(self._decode, row)
                       for row in rows[start + self.batch_size:start + 2 * self.batch_size]]
            ok = [d for d in decoded if d.array is not None]
            if ok:
                batch = np.stack([d.array for d in ok]).astype(np.float32, copy=False)
                parts.append(prepare_vectors(self.embedder.embed(batch), dim))
                ids += [d.id for d in ok]
            for d in decoded:
                d.array = None
            records += decoded
        return EmbeddedRows(np.asarray(ids, dtype=np.int64), np.concatenate(parts), records)

    def _decode(self, row: tuple[int, str]) -> Decoded:
        return decode_file(row[0], row[1], self.preprocess, self.max_pixels)
