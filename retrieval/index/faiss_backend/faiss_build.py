"""The faiss part of an index folder, from the shards: built (trained on a sample, filled by the engine, tuned) or
updated in place to the catalogue's ``done`` rows (step 4 of the writer's resumability, see ``writer``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue
from retrieval.index.faiss_backend import faiss_files, faiss_gpu, faiss_keys, faiss_measure, faiss_params, faiss_tuning
from retrieval.index.layout import IndexLayout
from retrieval.index.shards import ShardStore
from retrieval.index.sources import printable_path
from retrieval.index.vectors import Chunks, done_chunks, gather_rows
from retrieval.records.index_info import IndexInfo

log = logging.getLogger(__name__)

AddVectors = Callable[[faiss.Index, Chunks, Path, int], faiss.Index]  # ``IngestEngine.add_vectors``


def add_sequentially(index: faiss.Index, chunks: Chunks) -> faiss.Index:
    """Add (ids, vectors) chunks to a trained index in this process."""
    for ids, vectors in chunks:
        index.add_with_ids(vectors, ids)
    return index


def build_faiss(
    layout: IndexLayout,
    catalogue: Catalogue,
    store: ShardStore,
    key_request: str,
    dim: int,
    gpu: bool = False,
    policy: faiss_keys.AutoPolicy = faiss_keys.AUTO_POLICY,
    seed: int = 0,
    add_vectors: AddVectors | None = None,
) -> dict[str, Any]:
    """Build, train, fill and tune a fresh faiss index from the shards; write it atomically.

    ``add_vectors(trained index, shard chunks, index folder, vector count)`` fills it and returns the filled
    index: an engine's ``IngestEngine.add_vectors`` (e.g. Ray's per-shard tasks and merge); None adds them here.
    """
    done = catalogue.done_shards()
    n = len(done)
    if n == 0:
        errors = catalogue.error_examples(1)
        example = f"; first error: {printable_path(errors[0]['path'])}: {errors[0]['error']}" if errors else ""
        raise ValueError(
            f"no image could be indexed into {layout.root} ({catalogue.error_count()} errors"
            f"{example}); check the gallery's images and the errors in catalogue.sqlite"
        )
    if key_request == "auto":
        key = faiss_keys.choose_index_key(n, dim, policy=policy)
    else:
        key = faiss_keys.expand_key(key_request, n, dim)
    estimate = faiss_keys.estimated_index_bytes(key, n, dim) if policy.max_index_memory is not None else None
    if estimate is not None and estimate > policy.max_index_memory:  # an explicit key over the budget
        # the other settings are named in backticks: the command line shows them as its options
        raise ParameterError(
            "key_request", f"{key} needs about {estimate / 2**20:.0f} MiB for {n} vectors, over "
            f"`max_index_memory` {policy.max_index_memory / 2**20:.0f} MiB; rerun with `index_key` auto to get the "
            "best index that fits (the embeddings are kept: only the faiss part is built again)"
        )
    index = faiss_keys.new_index(key, dim)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_queries = min(policy.tune_queries, max(1, n // 10))
    query_positions, train_positions = order[:n_queries], order[n_queries : n_queries + policy.max_train]
    resources = faiss_gpu.require_gpu() if gpu else None
    if not index.is_trained:
        # train on vectors other than the tuning queries, so that tuning measures held-out queries
        sample = gather_rows(store, done, train_positions if len(train_positions) else order)
        if resources is not None:
            faiss_gpu.train_on_gpu(index, sample, resources)
        else:
            index.train(sample)
    chunks = done_chunks(store, done)
    index = add_sequentially(index, chunks) if add_vectors is None else add_vectors(index, chunks, layout.root, n)
    tuning = {
        "params": {},
        "recall_1_at_1": 1.0,
        "recall_10_at_10": 1.0,
        "target_met": True,
        "queries": int(n_queries),
        "note": "exact search",
    }
    if faiss_params.search_param_grid(index, 10) != [{}]:
        # held-out queries: gallery vectors never used for training, their own ids dropped from results
        queries, query_ids = gather_rows(store, done, query_positions, with_ids=True)
        _, exact = faiss_measure.exact_knn(queries, done_chunks(store, done), 11)
        exact = faiss_measure.drop_self(exact, query_ids, 10)
        result = faiss_tuning.tune_search_params(index, queries, exact, policy.target_recall, self_ids=query_ids,
                                              max_query_ms=policy.max_query_ms)
        tuning = dataclasses.asdict(result) | {"queries": int(n_queries), "target": policy.target_recall}
        if not result.target_met:
            log.warning(
                "%s reaches only %.3f 10-recall@10 at the setting chosen (%s); choose a larger index key "
                "(e.g. Flat or IVF...,Flat)%s", key, result.recall_10_at_10, result.params,
                " or allow more time per query (max_query_ms)" if policy.max_query_ms is not None else "",
            )
    elif policy.max_query_ms is not None:  # exact search: only its time can miss the budget
        queries = gather_rows(store, done, query_positions)
        latency = faiss_measure.latency_ms(lambda q: index.search(q, 10), queries, repeats=100)["p50_ms"]
        tuning |= {"latency_ms": round(latency, 4), "latency_met": latency <= policy.max_query_ms}
    if tuning.get("latency_met") is False:
        log.warning("%s answers one query in %.2f ms at its fastest setting, over the time per query allowed "
                    "(max_query_ms) %g",
                    key, tuning["latency_ms"], policy.max_query_ms)
    require_same_ids(layout, index, done)
    faiss_files.write_index_atomic(index, layout.faiss)
    budget = {}
    if policy.max_index_memory is not None or policy.max_query_ms is not None:
        budget = {"budget": {
            "max_index_memory": policy.max_index_memory, "estimated_bytes": estimate,
            "memory_met": None if policy.max_index_memory is None else estimate <= policy.max_index_memory,
            "max_query_ms": policy.max_query_ms, "latency_ms": tuning.get("latency_ms"),
            "latency_met": tuning.get("latency_met"),
        }}
    return {
        "index_key": key,
        "index_key_requested": key_request,
        "params": tuning["params"],
        "tuning": tuning,
        "count": int(index.ntotal),
        "built_on": "gpu" if gpu else "cpu",
        **budget,
    }


def require_same_ids(layout: IndexLayout, index: faiss.Index, done: Mapping[int, str]) -> None:
    """Refuse to write a faiss index that disagrees with the catalogue (naming the repair command)."""
    problem = faiss_params.faiss_mismatch(index, done)
    if problem is not None:
        raise layout.inconsistent(problem)


def update_faiss(
    layout: IndexLayout,
    catalogue: Catalogue,
    store: ShardStore,
    info: IndexInfo,
    gpu: bool = False,
    index: faiss.Index | None = None,
    policy: faiss_keys.AutoPolicy = faiss_keys.AUTO_POLICY,
    changed: np.ndarray | None = None,
) -> dict[str, Any]:
    """Bring the index (read from ``layout.faiss`` unless given) in line with the ``done`` rows; no retraining.
    ``changed``: ids whose vectors the shards now hold anew (an upgrade), replaced in faiss.

    Flat storage and an IVF index that keeps catalogue ids in its lists remove ids in place. Other types are
    emptied and filled again from the shards, keeping their training: inside IDMap2 an IVF index keeps its rows'
    old positions on removal and HNSW cannot remove at all, and either would leave the wrapper pointing at the
    wrong rows.
    """
    index = faiss_files.read_index(layout.faiss) if index is None else index
    done = catalogue.done_shards()
    present = faiss_params.index_ids(index)
    done_ids = np.fromiter(done, np.int64, len(done))
    to_remove = np.setdiff1d(present, done_ids)
    to_add = np.setdiff1d(done_ids, present)
    if changed is not None and len(changed):
        changed = np.asarray(changed, dtype=np.int64)
        to_remove = np.union1d(to_remove, np.intersect1d(changed, present))
        to_add = np.union1d(to_add, np.intersect1d(changed, done_ids))
    updated_by = f"added {len(to_add)}, removed {len(to_remove)} in place"
    emptied = False
    removes_in_place = isinstance(faiss_params.inner(index), faiss.IndexFlatCodes) or (
        not faiss_params.has_id_map(index) and faiss_params.ivf_of(index) is not None)
    if len(to_remove) and not removes_in_place:
        faiss_files.detach_on_disk_lists(index, layout.root, keep_entries=False)  # emptied next: nothing to copy
        emptied = True
        try:
            index.reset()
        except RuntimeError:  # no reset either: build afresh from the shards with the same key
            record = info
            key, dim = record.vectors.index_key, int(record.model.embedding_dim)  # type: ignore[arg-type]
            rebuilt = build_faiss(layout, catalogue, store, key, dim, gpu, policy=policy)
            return rebuilt | {
                "index_key_requested": record.requested_index_key,
                "updated_by": "rebuild (this index type cannot remove ids)",
            }
        to_remove, to_add = np.zeros(0, np.int64), done_ids
        updated_by = (
            f"rebuild from the shards, keeping its training ({len(done_ids)} vectors; this index type "
            "cannot remove ids in place)"
        )
    if not len(to_remove) and not len(to_add):
        return {"count": int(index.ntotal), "updated_by": "nothing to change"}
    if not emptied:  # changed in place, but never in the lists file that index.faiss names and readers map
        faiss_files.detach_on_disk_lists(index, layout.root)
    if len(to_remove):
        index.remove_ids(to_remove)
    if len(to_add):
        for ids, vectors in done_chunks(store, {int(i): done[int(i)] for i in to_add}):
            index.add_with_ids(vectors, ids)
    faiss_params.set_search_params(index, info.vectors.params or {})
    require_same_ids(layout, index, done)
    faiss_files.write_index_atomic(index, layout.faiss)
    return {"count": int(index.ntotal), "updated_by": updated_by}
