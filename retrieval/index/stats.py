"""``retrieval index stats`` of an index folder: counts, index type, size on disk, recall against exact search,
latency (``Index.stats``; a Milvus collection measures itself, ``MilvusIndex.stats``; ``searchable.opening.index_stats``
opens either and asks it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import faiss
import numpy as np

from retrieval.index.catalogue_reader import CatalogueReader
from retrieval.index.catalogue_schema import THROUGHPUT_META
from retrieval.index.faiss_backend import faiss_measure
from retrieval.index.faiss_backend.faiss_params import faiss_mismatch
from retrieval.index.layout import IndexLayout
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks, gather_rows
from retrieval.records.index_info import IndexInfo


class FolderIndex(Protocol):
    """What the statistics read of an opened index folder (``search.Index``, which imports this module)."""

    layout: IndexLayout
    catalogue: CatalogueReader
    faiss_index: faiss.Index
    info: IndexInfo

    @property
    def has_model(self) -> bool: ...

    def __len__(self) -> int: ...

    def search_arrays(self, embeddings: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]: ...


def failed_images(directory: str | Path) -> Iterator[dict[str, Any]]:
    """Every image of the index that could not be read or listed, with why (an unfinished build's too)."""
    layout = IndexLayout(directory)
    layout.require_catalogue()
    catalogue = CatalogueReader(layout.catalogue)
    try:
        yield from catalogue.iter_errors()
    finally:
        catalogue.close()


def opened_index_stats(
    index: FolderIndex, ids: np.ndarray | None = None, queries: int = 500, seed: int = 1
) -> dict[str, Any]:
    """Measure an opened index as it is saved, without opening the folder again: recall of its search settings vs
    exact search, p50/p99 latency. Queries are a random sample of the indexed vectors; each query's own id is left
    out of both the exact and the approximate results, so that they measure like unseen queries. ``ids``
    (sorted): the ids it answers for, whatever the catalogue marks them now (a server's state, ``live.Snapshot``);
    their vectors are read from the shards the catalogue names for them. None: the catalogue's indexed rows, which
    faiss must hold. InconsistentIndexError when the catalogue names no vector for some of them."""
    counts = index.catalogue.counts()
    store = ShardStore(index.layout.shards, read_only=True)
    if ids is None:
        done = index.catalogue.done_shards()
        mismatch = faiss_mismatch(index.faiss_index, done)  # the ids, not only their number
        if mismatch is not None:
            raise index.layout.inconsistent(mismatch)
    else:
        done = index.catalogue.shards_of(ids)
        if len(done) != len(ids):  # sent back to pending by a writer since: its vector is not recorded now
            raise index.layout.inconsistent(
                f"the catalogue records no vector for {len(ids) - len(done)} of the {len(ids)} images this index "
                "state serves: a writer changed them since it was opened")
    n = len(done)
    nq = min(queries, n)
    positions = np.random.default_rng(seed).choice(n, nq, replace=False)
    sample, sample_ids = gather_rows(store, done, positions, with_ids=True)
    k = min(10, n - 1)
    if k < 1:
        raise ValueError("recall needs at least 2 indexed images")
    # each query's own id is dropped from both result lists: they measure like unseen queries
    _, exact = faiss_measure.exact_knn(sample, done_chunks(store, done), k + 1)
    exact = faiss_measure.drop_self(exact, sample_ids, k)
    _, found = index.search_arrays(sample, k + 1)
    found = faiss_measure.drop_self(found, sample_ids, k)
    latency = faiss_measure.latency_ms(lambda q: index.search_arrays(q, k), sample)
    info, model = index.info, index.info.model
    return {
        "index_dir": str(index.layout.root),
        "counts": counts,
        "errors": index.catalogue.error_count(),
        "error_examples": index.catalogue.error_examples(10),
        # per engine: images decoded + embedded + written to shards, seconds, images/s (faiss not included)
        "throughput": json.loads(index.catalogue.get_meta(THROUGHPUT_META) or "{}"),
        "vectors": len(index),
        "index_key": info.vectors.index_key,
        "index_key_requested": info.vectors.index_key_requested,
        "params": info.vectors.params if info.holds("params") else {},
        "tuning": info.vectors.tuning,
        # --max-index-memory / --max-query-ms: the limits, the estimate and the latency tuning measured
        **({"budget": info.vectors.budget} if info.vectors.budget else {}),
        "model": {"model_path": model.path, "model_hash": model.hash, "embedding_dim": model.embedding_dim,
                  "model_normalized": model.normalized, "model_output": model.output}
        | ({} if index.has_model else {"source": info.catalogue.source,  # built from embeddings: no model
                                       "embeddings_dir": info.catalogue.embeddings_dir}),
        "size_on_disk_bytes": index.layout.size_on_disk(),
        "queries": int(nq),
        "recall_1_at_1": faiss_measure.recall_at(found, exact, 1, 1),
        f"recall_{k}_at_{k}": faiss_measure.recall_at(found, exact, k, k),
        "latency": latency,
        # an upgrade under way or the last one: what it checked first (the model's verdict, the index's labels,
        # --force), and whether it kept the text model or turned it off
        **({"upgrade": info.upgrade.under_way} if info.upgrade.under_way else {}),
        **({"last_upgrade": info.upgrade.last} if info.upgrade.last else {}),
        # the "no good match" floor of text queries with the recorded text model, or why there is none
        **({"text_no_match": recorded_floor(info, str(index.layout.root))} if info.text.hash else {}),
    }


def recorded_floor(info: IndexInfo, index_shown: str) -> dict[str, Any]:
    """The no-match floor index.json records for its recorded text model (``retrieval.text.no_match``), described."""
    from retrieval.text.no_match import read_floor  # the text package reads index records: imported when needed

    return read_floor(info, info.text.hash, index_shown).describe()
