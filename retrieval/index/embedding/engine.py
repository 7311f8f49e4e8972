"""What an ingest engine is (``IngestEngine``) and how the index commands are configured (``IngestOptions``).

An engine decodes and embeds the pending catalogue rows into shards, and fills a trained faiss index from the
shards' vectors. Every engine writes the same folder layout, so an index is resumed, searched and updated the same
way whoever built it. This module imports no engine: they import it (``engines`` names them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import faiss

from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.index.faiss_backend.faiss_keys import AUTO_POLICY, AutoPolicy
from retrieval.index.vectors import Chunks

if TYPE_CHECKING:
    from retrieval.index.catalogue import Catalogue
    from retrieval.index.query_embedder import ImageEmbedder
    from retrieval.index.shards import ShardStore

DEFAULT_SHARD_SIZE = 4096


@dataclasses.dataclass
class RayOptions:
    """``--engine ray``: where the cluster is and how the embedding actor pool is shaped."""

    address: str = "auto"  # auto | local | ray://HOST:PORT | HOST:PORT
    actors: int = 1  # embedding actors (each loads the model once)
    gpus_per_actor: float = 0.0
    cpus_per_actor: float = 1.0  # also onnxruntime's thread count in each actor
    connect_timeout: float = 10.0  # seconds to reach an explicit address
    wave_size: int = 100_000  # pending images per Ray Data run (bounds the driver's memory)
    merge_on_disk: bool | None = None  # IVF merge into an .ivfdata file; None: when it would not fit in memory
    add_tasks_in_flight: int = 4  # per-shard faiss tasks submitted ahead of the merge


@dataclasses.dataclass
class IngestOptions:
    """How the index commands decode, embed and shard, which engine does it, and how ``--index-key auto`` chooses."""

    batch_size: int = 64
    workers: int | None = None  # decoding threads (None: ``retrieval.utils.workers.default_decode_threads``)
    shard_size: int = DEFAULT_SHARD_SIZE
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress: bool = True
    engine: str = "local"  # a name in ``engines.ENGINES``
    ray: RayOptions | None = None  # for ``engine="ray"`` (None: its defaults)
    policy: AutoPolicy = AUTO_POLICY


class IngestEngine(Protocol):
    """Who decodes and embeds, and who fills faiss; a context manager (the Ray one holds its cluster connection)."""

    name: str  # the key of its throughput record (``index stats``)

    def __enter__(self) -> IngestEngine: ...

    def __exit__(self, *exc: object) -> None: ...

    def ingest(self, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions) -> None:
        """Embed the catalogue's pending rows into shards, recording each shard's outcomes atomically."""
        ...

    def add_vectors(self, index: faiss.Index, chunks: Chunks, workdir: Path, count: int) -> faiss.Index:
        """Fill the trained, empty ``index`` with ``count`` vectors from ``chunks``; may write under ``workdir``
        (``faiss_build.AddVectors``; ``faiss_build.add_sequentially`` fills it in this process)."""
        ...

