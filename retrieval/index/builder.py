"""Building and updating an index folder: plan, decode + embed in shards, reconcile, (re)build faiss.

Resumability, step by step (a kill -9 at any point loses nothing and duplicates nothing):
1. plan: every gallery path gets a ``pending`` catalogue row in one transaction (idempotent: a path
   already catalogued keeps its row and id);
2. ingest: pending images are decoded in DataLoader workers and embedded in batches; a shard file
   (ids, vectors and the outcomes of its images) is written atomically, then its rows are marked
   done/error/duplicate in one transaction;
3. reconcile (at the start of every run): a shard written but not yet recorded (a kill between the
   two steps of 2) has its outcomes recorded from the file itself;
4. faiss: the index is rebuilt from the shards (rows ``done``) and written atomically, then
   ``index.json``; ``add``/``remove`` update it in place by set difference between the ids the index
   holds and the ``done`` rows, which is idempotent too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from retrieval.index import faiss_ops
from retrieval.index.catalogue import Catalogue, Outcome
from retrieval.index.decode import DEFAULT_MAX_PIXELS, DecodedBatch, GalleryDecodeDataset, collate_decoded
from retrieval.index.embedder import Embedder, ModelMismatchError, load_model, prepare_vectors
from retrieval.index.layout import IndexLayout
from retrieval.index.shards import ShardStore
from retrieval.index.sources import list_gallery

DEFAULT_SHARD_SIZE = 4096
# Test hook: "after_shard_write:N" or "after_commit:N" makes the build stop (sleep) after its N-th shard,
# so that a test can kill it at a known point.
PAUSE_ENV = "RETRIEVAL_INDEX_TEST_PAUSE"


def _test_pause(point: str, shard_number: int) -> None:
    wanted = os.environ.get(PAUSE_ENV, "")
    if wanted and wanted == f"{point}:{shard_number}":
        print(f"RETRIEVAL_INDEX_PAUSED {wanted}", file=sys.stderr, flush=True)
        time.sleep(600)


@dataclasses.dataclass
class IngestOptions:
    batch_size: int = 64
    workers: int | None = None
    shard_size: int = DEFAULT_SHARD_SIZE
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress: bool = True


# --- ingest ----------------------------------------------------------------------------------------
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
        self, catalogue: Catalogue, store: ShardStore, embedder: Embedder, options: IngestOptions
    ) -> None:
        self.catalogue, self.store, self.embedder, self.options = catalogue, store, embedder, options
        self.seen = catalogue.done_sha256()  # sha256 -> id of an indexed original
        self.buffer = ShardBuffer()
        self.shards_written = 0

    def run(self) -> None:
        pending = self.catalogue.pending()
        if not pending:
            return
        dataset = GalleryDecodeDataset(pending, self.embedder.model_config, self.options.max_pixels)
        workers = self.options.workers
        workers = min(4, max(0, (os.cpu_count() or 1) - 1)) if workers is None else workers
        loader = DataLoader(
            dataset,
            batch_size=self.options.batch_size,
            num_workers=workers,
            shuffle=False,
            collate_fn=collate_decoded,
            prefetch_factor=4 if workers else None,
        )
        with tqdm(
            total=len(pending),
            desc="index",
            unit="img",
            file=sys.stderr,
            dynamic_ncols=True,
            disable=not self.options.progress,
        ) as bar:
            for decoded in loader:
                self._take(decoded)
                if len(self.buffer) >= self.options.shard_size:
                    self._flush()
                bar.update(len(decoded.records))
        self._flush()

    def _take(self, decoded: DecodedBatch) -> None:
        keep = []  # positions in decoded.batch of the images to embed
        for position, record in enumerate(decoded.records):
            if record.error is not None:
                self.buffer.outcomes.append(
                    Outcome(record.id, "error", record.sha256, record.size, record.error)
                )
                continue
            original = self.seen.get(record.sha256)
            if original is not None:
                self.buffer.outcomes.append(
                    Outcome(record.id, "duplicate", record.sha256, record.size, duplicate_of=original)
                )
                continue
            self.seen[record.sha256] = record.id
            keep.append(decoded.ok_index.index(position))
            self.buffer.outcomes.append(Outcome(record.id, "done", record.sha256, record.size))
            self.buffer.ids.append(record.id)
        if keep:
            batch = decoded.batch.numpy()
            batch = batch if len(keep) == len(batch) else np.ascontiguousarray(batch[keep])
            vectors = self.embedder.embed(batch)
            self.buffer.vectors.append(prepare_vectors(vectors, self.embedder.embedding_dim))

    def _flush(self) -> None:
        if not len(self.buffer):
            return
        d = self.embedder.embedding_dim
        vectors = np.concatenate(self.buffer.vectors) if self.buffer.vectors else np.zeros((0, d), np.float32)
        name = self.store.write(np.asarray(self.buffer.ids, np.int64), vectors, self.buffer.outcomes)
        self.shards_written += 1
        _test_pause("after_shard_write", self.shards_written)
        self.catalogue.record([dataclasses.replace(o, shard=name) for o in self.buffer.outcomes])
        _test_pause("after_commit", self.shards_written)
        self.buffer = ShardBuffer()


def reconcile(catalogue: Catalogue, store: ShardStore) -> int:
    """Record the outcomes of shards written before a crash but not yet marked; returns how many rows."""
    last = catalogue.last_recorded_shard()
    fixed = 0
    for name in store.names():
        if name <= last:  # recorded (its rows may since have been removed and re-added: not stale news)
            continue
        shard = store.read(name)
        statuses = catalogue.status_of([o.id for o in shard.outcomes])
        todo = [o for o in shard.outcomes if statuses.get(o.id) == "pending"]
        catalogue.record(todo)
        fixed += len(todo)
    return fixed


# --- faiss from shards -----------------------------------------------------------------------------
def done_chunks(store: ShardStore, done: Mapping[int, str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) of the ``done`` rows (id -> shard, from ``Catalogue.done_shards``), shard by shard.

    Each vector is read from the shard the catalogue names: an image removed and added again also has an
    older vector in an older shard, which must not come back.
    """
    for shard in store:
        mask = np.fromiter((done.get(int(i)) == shard.name for i in shard.ids), bool, len(shard.ids))
        if mask.any():
            yield shard.ids[mask], np.ascontiguousarray(shard.vectors[mask])


def gather_rows(
    store: ShardStore, done: Mapping[int, str], positions: np.ndarray, with_ids: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The vectors (and ids) at global ``positions`` (in shard order over the done rows)."""
    wanted = np.sort(positions)
    out, out_ids, offset = [], [], 0
    for ids, vectors in done_chunks(store, done):
        local = wanted[(wanted >= offset) & (wanted < offset + len(ids))] - offset
        out.append(vectors[local])
        out_ids.append(ids[local])
        offset += len(ids)
    vectors = np.ascontiguousarray(np.concatenate(out))
    return (vectors, np.concatenate(out_ids)) if with_ids else vectors


def build_faiss(
    layout: IndexLayout,
    catalogue: Catalogue,
    store: ShardStore,
    key_request: str,
    dim: int,
    gpu: bool = False,
    policy: faiss_ops.AutoPolicy | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Build, train, fill and tune a fresh faiss index from the shards; write it atomically."""
    policy = policy or faiss_ops.AUTO_POLICY
    done = catalogue.done_shards()
    n = len(done)
    if n == 0:
        errors = catalogue.problems("error", 1)
        example = f"; first error: {errors[0]['path']}: {errors[0]['error']}" if errors else ""
        raise ValueError(
            f"no image could be indexed into {layout.root} ({catalogue.counts()['error']} errors"
            f"{example}); check --images and the errors in catalogue.sqlite"
        )
    if key_request == "auto":
        key = faiss_ops.choose_index_key(n, dim, policy=policy)
    else:
        key = faiss_ops.expand_key(key_request, n, dim)
    index = faiss_ops.new_index(key, dim)
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    n_queries = min(policy.tune_queries, max(1, n // 10))
    query_positions, train_positions = order[:n_queries], order[n_queries : n_queries + policy.max_train]
    resources = faiss_ops.require_gpu() if gpu else None
    if not index.is_trained:
        # train on vectors other than the tuning queries, so that tuning measures held-out queries
        sample = gather_rows(store, done, train_positions if len(train_positions) else order)
        if resources is not None:
            faiss_ops.train_on_gpu(index, sample, resources)
        else:
            index.train(sample)
    for ids, vectors in done_chunks(store, done):
        index.add_with_ids(vectors, ids)
    tuning = {
        "params": {},
        "recall_1_at_1": 1.0,
        "recall_10_at_10": 1.0,
        "target_met": True,
        "queries": int(n_queries),
        "note": "exact search",
    }
    if faiss_ops.search_param_grid(index, 10) != [{}]:
        # held-out queries: gallery vectors never used for training, their own ids dropped from results
        queries, query_ids = gather_rows(store, done, query_positions, with_ids=True)
        _, exact = faiss_ops.exact_knn(queries, done_chunks(store, done), 11)
        exact = faiss_ops.drop_self(exact, query_ids, 10)
        result = faiss_ops.tune_search_params(index, queries, exact, policy.target_recall, self_ids=query_ids)
        tuning = dataclasses.asdict(result) | {"queries": int(n_queries), "target": policy.target_recall}
        if not result.target_met:
            print(
                f"warning: {key} reaches only {result.recall_10_at_10:.3f} 10-recall@10 "
                f"at its most expensive "
                f"setting {result.params}; choose a larger index key (e.g. Flat or IVF...,Flat)",
                file=sys.stderr,
            )
    faiss_ops.write_index_atomic(index, layout.faiss)
    return {
        "index_key": key,
        "index_key_requested": key_request,
        "params": tuning["params"],
        "tuning": tuning,
        "count": int(index.ntotal),
        "built_on": "gpu" if gpu else "cpu",
    }


def update_faiss(
    layout: IndexLayout, catalogue: Catalogue, store: ShardStore, info: dict[str, Any], gpu: bool = False
) -> dict[str, Any]:
    """Bring the index in line with the ``done`` rows: remove_ids / add_with_ids, no retraining.

    Index types that cannot remove ids (HNSW, Refine) are rebuilt from the shards with the same key.
    """
    index = faiss.read_index(str(layout.faiss))
    done = catalogue.done_shards()
    present = faiss_ops.index_ids(index)
    done_ids = np.fromiter(done, np.int64, len(done))
    to_remove = np.setdiff1d(present, done_ids)
    to_add = np.setdiff1d(done_ids, present)
    if len(to_remove):
        try:
            index.remove_ids(to_remove)
        except RuntimeError:  # e.g. HNSW: no removal in faiss; rebuild from the shards instead
            rebuilt = build_faiss(
                layout, catalogue, store, info["index_key"], int(info["embedding_dim"]), gpu
            )
            return rebuilt | {
                "index_key_requested": info.get("index_key_requested", info["index_key"]),
                "updated_by": "rebuild (this index type cannot remove ids)",
            }
    if len(to_add):
        for ids, vectors in done_chunks(store, {int(i): done[int(i)] for i in to_add}):
            index.add_with_ids(vectors, ids)
    faiss_ops.set_search_params(index, info.get("params", {}))
    faiss_ops.write_index_atomic(index, layout.faiss)
    return {
        "count": int(index.ntotal),
        "updated_by": f"added {len(to_add)}, removed {len(to_remove)} in place",
    }


# --- commands --------------------------------------------------------------------------------------
def _summary(catalogue: Catalogue, started: float, reconciled: int) -> dict[str, Any]:
    counts = catalogue.counts()
    return {
        "indexed": counts["done"],
        "errors": counts["error"],
        "duplicates": counts["duplicate"],
        "removed": counts["removed"],
        "pending": counts["pending"],
        "reconciled_rows": reconciled,
        "error_examples": catalogue.problems("error", 10),
        "duplicate_examples": catalogue.problems("duplicate", 10),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _model_fields(embedder: Embedder, model_path: str | None) -> dict[str, Any]:
    return {
        "model_path": str(Path(model_path).resolve()) if model_path else None,
        "model_hash": embedder.model_hash,
        "embedding_dim": int(embedder.embedding_dim),
        "model_normalized": bool(embedder.normalized),
        "similarity": "inner product of L2-normalised vectors (cosine)",
    }


def _check_same_model(catalogue: Catalogue, embedder: Embedder, root: Path) -> None:
    built_by = catalogue.get_meta("model_hash")
    if built_by is not None and built_by != embedder.model_hash:
        raise ModelMismatchError(
            f"{root} was started with model {catalogue.get_meta('model_path')} (model_hash {built_by}) "
            f"but this "
            f"model has model_hash {embedder.model_hash}; use the same model, or a new --out to build afresh"
        )


def build_index(
    images: str | Path,
    out: str | Path,
    model: str | Path | None = None,
    embedder: Embedder | None = None,
    index_key: str = "auto",
    split: str | None = None,
    gpu: bool = False,
    options: IngestOptions | None = None,
) -> dict[str, Any]:
    """Build (or finish an interrupted build of) an index of the images in ``out``; returns a summary."""
    started = time.perf_counter()
    if gpu:
        faiss_ops.require_gpu()  # fail before any work
    if embedder is None:
        if model is None:
            raise ValueError("give --model (an exported .onnx file) to embed the images with")
        embedder = load_model(model)
    options = options or IngestOptions()
    layout = IndexLayout(out)
    layout.root.mkdir(parents=True, exist_ok=True)
    with Catalogue(layout.catalogue) as catalogue:
        state = catalogue.get_meta("state")
        if state == "complete":
            raise FileExistsError(
                f"{layout.root} already holds a finished index; add images with "
                f"`retrieval index add {layout.root} --images ...` or choose a new --out"
            )
        if state is None:
            fields = _model_fields(embedder, str(model) if model else None)
            catalogue.set_meta(
                state="building",
                index_key=index_key,
                **{k: str(v) for k, v in fields.items() if v is not None},
            )
        else:
            _check_same_model(catalogue, embedder, layout.root)
            if catalogue.get_meta("index_key") != index_key:
                raise ValueError(
                    f"the interrupted build in {layout.root} used --index-key "
                    f"{catalogue.get_meta('index_key')}; rerun with that key or choose a new --out"
                )
        items = list_gallery(images, split)
        if not items:
            raise ValueError(f"no images (jpg, jpeg, png, webp, bmp, gif) found in {images}")
        catalogue.plan(items)
        store = ShardStore(layout.shards)
        reconciled = reconcile(catalogue, store)
        Ingestor(catalogue, store, embedder, options).run()
        built = build_faiss(layout, catalogue, store, index_key, int(embedder.embedding_dim), gpu)
        layout.write_info(_model_fields(embedder, catalogue.get_meta("model_path")) | built)
        catalogue.set_meta(state="complete")
        return {
            "index_dir": str(layout.root),
            "index_key": built["index_key"],
            "params": built["params"],
            **_summary(catalogue, started, reconciled),
        }


def _open_for_update(index_dir: str | Path) -> tuple[IndexLayout, dict[str, Any]]:
    layout = IndexLayout(index_dir)
    layout.require_finished()
    return layout, layout.read_info()


def add_images(
    index_dir: str | Path,
    images: str | Path,
    model: str | Path | None = None,
    embedder: Embedder | None = None,
    split: str | None = None,
    gpu: bool = False,
    options: IngestOptions | None = None,
) -> dict[str, Any]:
    """Embed new images with the index's own model and add them without rebuilding (resumable too)."""
    started = time.perf_counter()
    layout, info = _open_for_update(index_dir)
    if embedder is None:
        path = model or info.get("model_path")
        if path is None:
            raise ValueError("this index records no model path; pass --model")
        embedder = load_model(path)
    options = options or IngestOptions()
    with Catalogue(layout.catalogue) as catalogue:
        _check_same_model(catalogue, embedder, layout.root)
        items = list_gallery(images, split)
        catalogue.plan(items)
        store = ShardStore(layout.shards)
        reconciled = reconcile(catalogue, store)
        Ingestor(catalogue, store, embedder, options).run()
        updated = update_faiss(layout, catalogue, store, info, gpu)
        layout.write_info(info | updated)
        return {"index_dir": str(layout.root), **updated, **_summary(catalogue, started, reconciled)}


def remove_images(
    index_dir: str | Path, ids: Sequence[int] = (), paths: Sequence[str] = ()
) -> dict[str, Any]:
    """Mark images removed in the catalogue, then take them out of the faiss index."""
    started = time.perf_counter()
    layout, info = _open_for_update(index_dir)
    with Catalogue(layout.catalogue) as catalogue:
        wanted = [int(i) for i in ids]
        if paths:
            resolved = [str(Path(p).expanduser().resolve()) for p in paths]
            found = catalogue.ids_for_paths(resolved)
            missing = [p for p in resolved if p not in found]
            if missing:
                raise KeyError(f"not in the catalogue: {', '.join(missing[:5])}")
            wanted += list(found.values())
        statuses = catalogue.status_of(wanted)
        unknown = [i for i in wanted if i not in statuses]
        if unknown:
            raise KeyError(f"no catalogue rows with ids {unknown[:10]}")
        catalogue.mark_removed(wanted)
        store = ShardStore(layout.shards)
        updated = update_faiss(layout, catalogue, store, info)
        layout.write_info(info | updated)
        return {
            "index_dir": str(layout.root),
            "removed_ids": sorted(set(wanted)),
            **updated,
            **_summary(catalogue, started, 0),
        }
