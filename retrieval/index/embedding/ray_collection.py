"""``--engine ray`` into a Milvus collection: the Ray Data job of ``ray_engine`` with one more stage, the
``CollectionWriter`` actors, which write each embedded batch into the collection and pass on only the rows' facts
(id, readable, sha256, size, error, node). The driver records them in the catalogue as they come, shard by shard
(``IN_COLLECTION`` stands for the shard), and deletes from the collection the exact copies it finds: what
``milvus_build`` describes. Ray is imported only when the job runs.
"""

from __future__ import annotations

import collections
import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from retrieval.index.catalogue import Catalogue, Outcome
from retrieval.index.embedding.engine import IngestOptions, RayOptions
from retrieval.index.embedding.gallery_file import Decoded
from retrieval.index.embedding.ray_engine import RayEngine, RayIngestor, import_ray
from retrieval.index.embedding.ray_stages import CollectionWriter
from retrieval.index.milvus.milvus_build import IN_COLLECTION, CollectionBuild, PlannedRows, delete_ids, row_fields
from retrieval.index.milvus.milvus_collection import MILVUS_TOKEN_ENV
from retrieval.index.milvus.milvus_push import BATCH_ROWS
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.shards import ShardStore

# A writer waits on Milvus, not on a CPU: reserving one would leave a small node's decoders without theirs (with 2
# CPUs, one embedding actor and one decode task take both) and stall the job.
WRITER_CPUS = 0.0


def write_into(engine: RayEngine, build: CollectionBuild, client: Any) -> None:
    """Send the vectors of ``engine``'s next ingests into ``build``'s collection (``milvus_build``) through writer
    actors, instead of streaming them back to shards; ``client`` deletes the copies the driver finds."""
    engine.ingestor = functools.partial(CollectionIngestor, build=build, client=client)


class CollectionIngestor(RayIngestor):
    """``RayIngestor`` whose vectors go from the embedding actors through ``CollectionWriter`` actors into the
    build's collection; this process receives and records only each row's facts."""

    def __init__(self, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions,
                 ray_options: RayOptions, model_path: str, build: CollectionBuild, client: Any) -> None:
        super().__init__(catalogue, store, embedder, options, ray_options, model_path)
        self.build, self.client = build, client
        self.planned = PlannedRows.read(catalogue)
        self.gallery_root = catalogue.get_meta("gallery_root") or "/"
        self.unwanted: list[int] = []  # ids of the buffer the collection must not hold: later copies, unreadable

    def _items(self, rows: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
        fields = row_fields(self.planned, self.build.record, self.gallery_root, [i for i, _ in rows])
        return [{"id": int(i), "path": p, "fields": fields[int(i)]} for i, p in rows]

    def _after_embedding(self, dataset: Any) -> Any:
        ray = import_ray()
        token = os.environ.get(MILVUS_TOKEN_ENV)
        # the credentials reach the writers through Ray's runtime environment, never through a process's arguments
        secret = {"runtime_env": {"env_vars": {MILVUS_TOKEN_ENV: token}}} if token else {}
        return dataset.map_batches(
            CollectionWriter,
            fn_constructor_kwargs={"uri": self.build.place.uri, "collection": self.build.physical,
                                   "batch_rows": BATCH_ROWS},
            batch_size=self.options.batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=self.ray_options.actors),
            num_cpus=WRITER_CPUS,
            **secret,
        )

    def _take_embedded(self, batch: dict[str, np.ndarray]) -> None:
        columns = zip(batch["id"], batch["ok"], batch["sha256"], batch["size"], batch["error"], strict=True)
        for i, ok, sha, size, error in columns:
            record = Decoded(int(i), None if size < 0 else int(size), sha or None, None, None if ok else error)
            if not self.admit(record):
                self.unwanted.append(int(i))
        self.buffer_nodes.update(str(node) for node in batch["node"])

    def _write_shard(self, ids: np.ndarray, vectors: np.ndarray, outcomes: list[Outcome]) -> str:
        # before the catalogue records them: a kill in between re-sends these rows, and deletes them again
        delete_ids(self.client, self.build.physical, self.unwanted)
        self.unwanted = []
        self.nodes.update(self.buffer_nodes)
        self.buffer_nodes = collections.Counter()
        return IN_COLLECTION

    def _replan(self, wave: Sequence[tuple[int, str]], bar: Any, exc: BaseException) -> list[tuple[int, str]]:
        self.unwanted = []  # their rows are pending again, and judged again when they come back
        return super()._replan(wave, bar, exc)
