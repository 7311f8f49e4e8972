"""Ingest: the pending catalogue rows decoded, embedded and written as shards, each shard's outcomes recorded
atomically with it (``Ingestor``); ``LocalEngine`` (``--engine local``) runs it in this process.

Step 2 of the writer's resumability (see ``writer``): a shard file (ids, vectors and the outcomes of its
images) is written atomically, then its rows are marked done/error/duplicate in one transaction.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import faiss
import numpy as np
from tqdm.std import tqdm

from retrieval.index.catalogue import THROUGHPUT_META, Catalogue, Outcome, Status
from retrieval.index.embedding.decode import Decoded, DecodedBatch, GalleryDecodeDataset, thread_batches
from retrieval.index.embedding.engine import IngestEngine, IngestOptions
from retrieval.index.faiss_backend.faiss_build import add_sequentially
from retrieval.index.query_embedder import ImageEmbedder, prepare_vectors
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import Chunks
from retrieval.utils.progress import progress_bar
from retrieval.utils.workers import default_decode_threads


class ShardBuffer:
    """Vectors and outcomes waiting to be written as one shard."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.vectors: list[np.ndarray] = []
        self.outcomes: list[Outcome] = []

    def __len__(self) -> int:
        return len(self.outcomes)


class Ingestor:
    """Turns the pending catalogue rows into shards, recording each shard's outcomes atomically."""

    def __init__(
        self, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions
    ) -> None:
        self.catalogue, self.store, self.embedder, self.options = catalogue, store, embedder, options
        self.seen = catalogue.done_sha256()  # sha256 -> id of an indexed original
        self.buffer = ShardBuffer()

    def run(self) -> None:
        pending = self.catalogue.pending()
        if not pending:
            return
        dataset = GalleryDecodeDataset(pending, self.embedder.preprocessing, self.options.max_pixels)
        threads = default_decode_threads() if self.options.workers is None else self.options.workers
        loader = thread_batches(dataset, self.options.batch_size, threads)
        with self.progress_bar(len(pending)) as bar:
            for decoded in loader:
                self._take(decoded)
                if len(self.buffer) >= self.options.shard_size:
                    self._flush()
                bar.update(len(decoded.records))
        self._flush()

    def progress_bar(self, total: int, desc: str = "index") -> tqdm:
        """Images done so far, on stderr (off with ``options.progress``)."""
        return progress_bar(
            total=total, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True, disable=not self.options.progress
        )

    def admit(self, record: Decoded) -> bool:
        """Buffer the outcome of one decoded image; True when its vector belongs in the shard (the caller
        then appends it): readable and not an exact duplicate of an image already indexed."""
        if record.error is not None:
            self.buffer.outcomes.append(Outcome(record.id, Status.ERROR, record.sha256, record.size, record.error))
            return False
        original = self.seen.get(record.sha256)
        if original is not None:
            self.buffer.outcomes.append(
                Outcome(record.id, Status.DUPLICATE, record.sha256, record.size, duplicate_of=original)
            )
            return False
        self.seen[record.sha256] = record.id
        self.buffer.outcomes.append(Outcome(record.id, Status.DONE, record.sha256, record.size))
        self.buffer.ids.append(record.id)
        return True

    def _take(self, decoded: DecodedBatch) -> None:
        # positions in decoded.batch of the images to embed
        keep = [decoded.ok_index.index(p) for p, record in enumerate(decoded.records) if self.admit(record)]
        if keep:
            batch = decoded.array()
            batch = batch if len(keep) == len(batch) else np.ascontiguousarray(batch[keep])
            vectors = self.embedder.embed(batch)
            self.buffer.vectors.append(prepare_vectors(vectors, self.embedder.embedding_dim))

    def _write_shard(self, ids: np.ndarray, vectors: np.ndarray, outcomes: list[Outcome]) -> str:
        return self.store.write(ids, vectors, outcomes)

    def _flush(self) -> None:
        if not len(self.buffer):
            return
        d = self.embedder.embedding_dim
        vectors = np.concatenate(self.buffer.vectors) if self.buffer.vectors else np.zeros((0, d), np.float32)
        name = self._write_shard(np.asarray(self.buffer.ids, np.int64), vectors, self.buffer.outcomes)
        self.catalogue.record([dataclasses.replace(o, shard=name) for o in self.buffer.outcomes])
        self.buffer = ShardBuffer()


class LocalEngine:
    """``--engine local``: decode in threads of this process while the model embeds the batch before
    (``decode.thread_batches``), fill faiss here."""

    name = "local"

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def ingest(self, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions) -> None:
        Ingestor(catalogue, store, embedder, options).run()

    def add_vectors(self, index: faiss.Index, chunks: Chunks, workdir: Path, count: int) -> faiss.Index:
        """Every vector added here, in order (``workdir`` and ``count`` are the Ray engine's)."""
        return add_sequentially(index, chunks)


def ingest(
    engine: IngestEngine, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions
) -> None:
    """Embed the pending rows with ``engine`` and add the run to its throughput record (``index stats``)."""
    pending = catalogue.counts()[Status.PENDING.value]
    started = time.perf_counter()
    engine.ingest(catalogue, store, embedder, options)
    if pending:
        record = json.loads(catalogue.get_meta(THROUGHPUT_META) or "{}")
        seconds = time.perf_counter() - started
        total = record.get(engine.name, {"images": 0, "seconds": 0.0, "runs": 0})
        total |= {"images": total["images"] + pending, "seconds": total["seconds"] + seconds, "runs": total["runs"] + 1}
        # an engine's own timings of the run (Ray: its start-up and actor seconds, for ``ray_engine.estimate_engines``)
        for key, value in getattr(engine, "run_facts", {}).items():
            total[key] = round(total.get(key, 0) + value, 3)
        record[engine.name] = total | {"images_per_s": round(total["images"] / max(total["seconds"], 1e-9), 1)}
        catalogue.set_meta(**{THROUGHPUT_META: json.dumps(record)})
