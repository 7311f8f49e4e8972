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

One writer at a time: every command here holds the folder's writer lock (``IndexLayout.write_lock``)
for its whole run. ``repair_index`` finishes or mends whatever a crash (or, before the lock, two writers
at once) left: it reconciles the shards, points each ``done`` row at a shard that holds its vector
(re-embedding only rows no shard holds), embeds the pending rows, brings faiss in line and checks that
faiss holds exactly the ``done`` ids. Every "unfinished" or "inconsistent" message names it.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from retrieval.index import faiss_ops
from retrieval.index.catalogue import Catalogue, Outcome
from retrieval.index.decode import (
    DEFAULT_MAX_PIXELS,
    Decoded,
    DecodedBatch,
    GalleryDecodeDataset,
    collate_decoded,
)
from retrieval.index.embedder import Embedder, ModelMismatchError, load_model, prepare_vectors
from retrieval.index.layout import IndexLayout, repair_command
from retrieval.index.shards import ShardStore
from retrieval.index.sources import IMAGE_EXTENSIONS, Gallery, is_utf8, list_gallery, printable_path
from retrieval.workers import default_workers

DEFAULT_SHARD_SIZE = 4096


@dataclasses.dataclass
class IngestOptions:
    batch_size: int = 64
    workers: int | None = None
    shard_size: int = DEFAULT_SHARD_SIZE
    max_pixels: int = DEFAULT_MAX_PIXELS
    progress: bool = True
    engine: str = "local"  # a key of ENGINES
    ray: Any = None  # ``ray_engine.RayOptions`` for ``engine="ray"`` (None: its defaults)


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

    def run(self) -> None:
        pending = self.catalogue.pending()
        if not pending:
            return
        dataset = GalleryDecodeDataset(pending, self.embedder.model_config, self.options.max_pixels)
        workers = default_workers() if self.options.workers is None else self.options.workers
        loader = DataLoader(
            dataset,
            batch_size=self.options.batch_size,
            num_workers=workers,
            shuffle=False,
            collate_fn=collate_decoded,
            prefetch_factor=4 if workers else None,
        )
        with self.progress_bar(len(pending)) as bar:
            for decoded in loader:
                self._take(decoded)
                if len(self.buffer) >= self.options.shard_size:
                    self._flush()
                bar.update(len(decoded.records))
        self._flush()

    def progress_bar(self, total: int, desc: str = "index") -> tqdm:
        """Images done so far, on stderr (off with ``options.progress``)."""
        return tqdm(
            total=total, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True, disable=not self.options.progress
        )

    def admit(self, record: Decoded) -> bool:
        """Buffer the outcome of one decoded image; True when its vector belongs in the shard (the caller
        then appends it): readable and not an exact duplicate of an image already indexed."""
        if record.error is not None:
            self.buffer.outcomes.append(Outcome(record.id, "error", record.sha256, record.size, record.error))
            return False
        original = self.seen.get(record.sha256)
        if original is not None:
            self.buffer.outcomes.append(
                Outcome(record.id, "duplicate", record.sha256, record.size, duplicate_of=original)
            )
            return False
        self.seen[record.sha256] = record.id
        self.buffer.outcomes.append(Outcome(record.id, "done", record.sha256, record.size))
        self.buffer.ids.append(record.id)
        return True

    def _take(self, decoded: DecodedBatch) -> None:
        # positions in decoded.batch of the images to embed
        keep = [decoded.ok_index.index(p) for p, record in enumerate(decoded.records) if self.admit(record)]
        if keep:
            batch = decoded.batch.numpy()
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


# --- engines: who decodes and embeds, and who fills faiss ---------------------------------------------
Chunks = Iterable[tuple[np.ndarray, np.ndarray]]


def add_sequentially(index: faiss.Index, chunks: Chunks, workdir: Path | None = None, count: int = 0) -> faiss.Index:
    """Add (ids, vectors) chunks to a trained index in this process (the signature of ``add_vectors``)."""
    for ids, vectors in chunks:
        index.add_with_ids(vectors, ids)
    return index


class LocalEngine:
    """``--engine local``: decode in DataLoader workers, embed in this process, fill faiss here."""

    name = "local"

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def ingest(self, catalogue: Catalogue, store: ShardStore, embedder: Embedder, options: IngestOptions) -> None:
        Ingestor(catalogue, store, embedder, options).run()

    def add_vectors(self, index: faiss.Index, chunks: Chunks, workdir: Path, count: int) -> faiss.Index:
        return add_sequentially(index, chunks)


def _ray_engine(options: IngestOptions) -> Any:
    from retrieval.index.ray_engine import RayEngine  # Ray itself is imported only when it connects

    return RayEngine(options.ray)


ENGINES: dict[str, Callable[[IngestOptions], Any]] = {"local": lambda options: LocalEngine(), "ray": _ray_engine}


def open_engine(options: IngestOptions) -> Any:
    """The engine ``options.engine`` names, as a context manager (the Ray one connects to its cluster)."""
    if options.engine not in ENGINES:
        raise ValueError(f"unknown --engine {options.engine!r}; choose one of {', '.join(ENGINES)}")
    return ENGINES[options.engine](options)


THROUGHPUT_META = "throughput"


def ingest(engine: Any, catalogue: Catalogue, store: ShardStore, embedder: Embedder, options: IngestOptions) -> None:
    """Embed the pending rows with ``engine`` and add the run to its throughput record (``index stats``)."""
    pending = catalogue.counts()["pending"]
    started = time.perf_counter()
    engine.ingest(catalogue, store, embedder, options)
    if pending:
        record = json.loads(catalogue.get_meta(THROUGHPUT_META) or "{}")
        seconds = time.perf_counter() - started
        total = record.get(engine.name, {"images": 0, "seconds": 0.0, "runs": 0})
        total = {"images": total["images"] + pending, "seconds": total["seconds"] + seconds, "runs": total["runs"] + 1}
        record[engine.name] = total | {"images_per_s": round(total["images"] / max(total["seconds"], 1e-9), 1)}
        catalogue.set_meta(**{THROUGHPUT_META: json.dumps(record)})


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


def missing_vectors(catalogue: Catalogue, store: ShardStore) -> set[int]:
    """Ids of ``done`` rows whose vector is not in the shard the catalogue names (reads only the ids)."""
    done = catalogue.done_shards()
    missing = set(done)
    for name in store.names():
        if missing:
            missing.difference_update(i for i in store.read_ids(name).tolist() if done.get(i) == name)
    return missing


def mend_done_rows(catalogue: Catalogue, store: ShardStore) -> dict[str, int]:
    """Give every ``done`` row a shard holding its vector: re-point it to another shard that holds the
    same image (same sha256), else send it back to ``pending`` to be embedded again.

    Two writers at once could overwrite each other's shards (same next name) and leave rows so.
    """
    missing = missing_vectors(catalogue, store)
    if not missing:
        return {"repointed": 0, "requeued": 0}
    rows = catalogue.rows(sorted(missing))
    found: dict[int, str] = {}
    for name in reversed(store.names()):  # newest first
        shard = store.read(name)
        held = set(shard.ids.tolist())
        for o in shard.outcomes:
            if o.id in missing and o.id not in found and o.status == "done" and o.id in held:
                if o.sha256 is not None and o.sha256 == rows[o.id]["sha256"]:
                    found[o.id] = name
    repointed = [
        Outcome(i, "done", rows[i]["sha256"], rows[i]["size"], shard=name) for i, name in sorted(found.items())
    ]
    requeued = [Outcome(i, "pending") for i in sorted(missing - found.keys())]
    catalogue.record(repointed + requeued)
    return {"repointed": len(repointed), "requeued": len(requeued)}


def mend(catalogue: Catalogue, store: ShardStore) -> dict[str, int]:
    """Steps every writer runs first: record unrecorded shards, then check each done row's vector."""
    return {"reconciled": reconcile(catalogue, store), **mend_done_rows(catalogue, store)}


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
    add_vectors: Callable[[faiss.Index, Chunks, Path, int], faiss.Index] = add_sequentially,
) -> dict[str, Any]:
    """Build, train, fill and tune a fresh faiss index from the shards; write it atomically.

    ``add_vectors(trained index, shard chunks, index folder, vector count)`` fills it and returns the filled
    index (an engine's own, e.g. Ray's per-shard tasks and merge).
    """
    policy = policy or faiss_ops.AUTO_POLICY
    done = catalogue.done_shards()
    n = len(done)
    if n == 0:
        errors = catalogue.error_examples(1)
        example = f"; first error: {printable_path(errors[0]['path'])}: {errors[0]['error']}" if errors else ""
        raise ValueError(
            f"no image could be indexed into {layout.root} ({catalogue.error_count()} errors"
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
    index = add_vectors(index, done_chunks(store, done), layout.root, n)
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
    require_same_ids(layout, index, done)
    faiss_ops.write_index_atomic(index, layout.faiss)
    return {
        "index_key": key,
        "index_key_requested": key_request,
        "params": tuning["params"],
        "tuning": tuning,
        "count": int(index.ntotal),
        "built_on": "gpu" if gpu else "cpu",
    }


def faiss_mismatch(index: faiss.Index, done: Mapping[int, str]) -> str | None:
    """How the ids in faiss differ from the catalogue's ``done`` rows, or None when they agree."""
    present = np.sort(faiss_ops.index_ids(index))
    expected = np.fromiter(sorted(done), np.int64, len(done))
    if np.array_equal(present, expected):
        return None
    lacking, extra = len(np.setdiff1d(expected, present)), len(np.setdiff1d(present, expected))
    return (
        f"its faiss part holds {len(present)} vectors but the catalogue has {len(expected)} indexed images "
        f"({lacking} missing from faiss, {extra} not indexed in the catalogue)"
    )


def require_same_ids(layout: IndexLayout, index: faiss.Index, done: Mapping[int, str]) -> None:
    """Refuse to write a faiss index that disagrees with the catalogue (naming the repair command)."""
    problem = faiss_mismatch(index, done)
    if problem is not None:
        raise layout.inconsistent(problem)


def update_faiss(
    layout: IndexLayout,
    catalogue: Catalogue,
    store: ShardStore,
    info: dict[str, Any],
    gpu: bool = False,
    index: faiss.Index | None = None,
) -> dict[str, Any]:
    """Bring the index (read from ``layout.faiss`` unless given) in line with the ``done`` rows; no retraining.

    Flat storage removes ids in place. Other types are emptied and filled again from the shards, keeping
    their training: an IVF index keeps its rows' old positions on removal and HNSW cannot remove at all,
    and either would leave the IDMap2 wrapper pointing at the wrong rows.
    """
    index = faiss_ops.read_index(layout.faiss) if index is None else index
    done = catalogue.done_shards()
    present = faiss_ops.index_ids(index)
    done_ids = np.fromiter(done, np.int64, len(done))
    to_remove = np.setdiff1d(present, done_ids)
    to_add = np.setdiff1d(done_ids, present)
    updated_by = f"added {len(to_add)}, removed {len(to_remove)} in place"
    emptied = False
    if len(to_remove) and not isinstance(faiss_ops.inner(index), faiss.IndexFlatCodes):
        faiss_ops.detach_on_disk_lists(index, layout.root, keep_entries=False)  # emptied next: nothing to copy
        emptied = True
        try:
            index.reset()
        except RuntimeError:  # no reset either: build afresh from the shards with the same key
            rebuilt = build_faiss(layout, catalogue, store, info["index_key"], int(info["embedding_dim"]), gpu)
            return rebuilt | {
                "index_key_requested": info.get("index_key_requested", info["index_key"]),
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
        faiss_ops.detach_on_disk_lists(index, layout.root)
    if len(to_remove):
        index.remove_ids(to_remove)
    if len(to_add):
        for ids, vectors in done_chunks(store, {int(i): done[int(i)] for i in to_add}):
            index.add_with_ids(vectors, ids)
    faiss_ops.set_search_params(index, info.get("params", {}))
    require_same_ids(layout, index, done)
    faiss_ops.write_index_atomic(index, layout.faiss)
    return {"count": int(index.ntotal), "updated_by": updated_by}


# --- commands --------------------------------------------------------------------------------------
def _summary(catalogue: Catalogue, started: float, mended: Mapping[str, int]) -> dict[str, Any]:
    counts = catalogue.counts()
    return {
        "indexed": counts["done"],
        "errors": catalogue.error_count(),
        "duplicates": counts["duplicate"],
        "removed": counts["removed"],
        "pending": counts["pending"],
        "reconciled_rows": mended.get("reconciled", 0),
        "repointed_rows": mended.get("repointed", 0),
        "requeued_rows": mended.get("requeued", 0),
        "not_listed": counts["not_listed"],
        "error_examples": catalogue.error_examples(10),
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


def _info_from_meta(catalogue: Catalogue) -> dict[str, Any]:
    """The model and gallery fields of ``index.json``, from what the build recorded when it started."""
    get = catalogue.get_meta
    info = {
        "model_path": get("model_path"),
        "model_hash": get("model_hash"),
        "embedding_dim": int(get("embedding_dim") or 0),
        "model_normalized": get("model_normalized") == "True",
        "similarity": get("similarity"),
    }
    if get("gallery_root") is not None:
        info["gallery_root"] = get("gallery_root")
    return info


def _check_same_model(catalogue: Catalogue, embedder: Embedder, root: Path) -> None:
    built_by = catalogue.get_meta("model_hash")
    if built_by is not None and built_by != embedder.model_hash:
        raise ModelMismatchError(
            f"{root} was started with model {catalogue.get_meta('model_path')} (model_hash {built_by}) "
            f"but this "
            f"model has model_hash {embedder.model_hash}; use the same model, or a new --out to build afresh"
        )


def _list(images: str | Path, split: str | None) -> Gallery:
    gallery = list_gallery(images, split)
    if not gallery.items:
        example = f"; e.g. {gallery.errors[0].path}: {gallery.errors[0].error}" if gallery.errors else ""
        raise ValueError(
            f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found in {images}"
            f"{f' ({len(gallery.errors)} paths could not be listed{example})' if gallery.errors else ''}"
        )
    return gallery


def _inconsistency(layout: IndexLayout, catalogue: Catalogue, store: ShardStore) -> str | None:
    """Why a finished index is not whole (unembedded rows, lost vectors, faiss off the catalogue), or None."""
    if not layout.faiss.is_file() or not layout.info.is_file():
        return "its faiss part or index.json is missing"
    pending = catalogue.counts()["pending"]
    if pending:
        return f"{pending} catalogued images were never embedded"
    missing = missing_vectors(catalogue, store)
    if missing:
        return f"{len(missing)} indexed images have no vector in their shard"
    try:
        index = faiss_ops.read_index(layout.faiss)
    except RuntimeError as exc:
        return f"its faiss part cannot be read ({str(exc).splitlines()[0]})"
    return faiss_mismatch(index, catalogue.done_shards())


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
    """Build (or finish an interrupted build of) an index of the images in ``out``; returns a summary.

    ``options.engine`` chooses who decodes and embeds (``local``, or ``ray`` on a Ray cluster); every
    engine writes the same folder layout, so an index is resumed, searched and updated the same way.
    """
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
    engine = open_engine(options)
    with engine, layout.write_lock("build an index in"), Catalogue(layout.catalogue) as catalogue:
        state = catalogue.get_meta("state")
        store = ShardStore(layout.shards)
        if state == "complete":
            problem = _inconsistency(layout, catalogue, store)
            if problem is not None:
                raise FileExistsError(
                    f"{layout.root} already holds a finished index, but {problem}; run "
                    f"`{repair_command(layout.root)}` to mend it"
                )
            raise FileExistsError(
                f"{layout.root} already holds a finished index; add images with "
                f"`retrieval index add {layout.root} --images ...` or choose a new --out"
            )
        if state is not None:
            _check_same_model(catalogue, embedder, layout.root)
            if catalogue.get_meta("index_key") != index_key:
                raise ValueError(
                    f"the interrupted build in {layout.root} used --index-key "
                    f"{catalogue.get_meta('index_key')}; rerun with that key or choose a new --out"
                )
        gallery = _list(images, split)
        if state is None:
            fields = _model_fields(embedder, str(model) if model else None)
            catalogue.set_meta(
                state="building",
                index_key=index_key,
                **{k: str(v) for k, v in fields.items() if v is not None},
            )
        if catalogue.get_meta("gallery_root") is None:  # what repair re-lists if planning never finished
            catalogue.set_meta(
                gallery_root=gallery.root, gallery_images=str(Path(images).expanduser().resolve()),
                **({"gallery_split": split} if split is not None else {}),
            )
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        print(f"building the faiss index of {layout.root}", file=sys.stderr, flush=True)
        built = build_faiss(
            layout, catalogue, store, index_key, int(embedder.embedding_dim), gpu, add_vectors=engine.add_vectors
        )
        layout.write_info(_info_from_meta(catalogue) | built)
        catalogue.set_meta(state="complete")
        return {
            "index_dir": str(layout.root),
            "index_key": built["index_key"],
            "params": built["params"],
            **_summary(catalogue, started, mended),
        }


def _require_complete(layout: IndexLayout, catalogue: Catalogue) -> dict[str, Any]:
    """index.json of a finished index (``add``/``remove`` work only on one), else the error naming repair."""
    layout.require_finished()
    if catalogue.get_meta("state") != "complete":
        raise layout.unfinished()
    return layout.read_info()


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
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    options = options or IngestOptions()
    engine = open_engine(options)
    with engine, layout.write_lock("add images to"), Catalogue(layout.catalogue) as catalogue:
        info = _require_complete(layout, catalogue)
        if embedder is None:
            path = model or info.get("model_path")
            if path is None:
                raise ValueError("this index records no model path; pass --model")
            embedder = load_model(path)
        _check_same_model(catalogue, embedder, layout.root)
        gallery = list_gallery(images, split)
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        store = ShardStore(layout.shards)
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        updated = update_faiss(layout, catalogue, store, info, gpu)
        layout.write_info(info | updated)
        return {"index_dir": str(layout.root), **updated, **_summary(catalogue, started, mended)}


def remove_images(
    index_dir: str | Path, ids: Sequence[int] = (), paths: Sequence[str] = ()
) -> dict[str, Any]:
    """Mark images removed in the catalogue, then take them out of the faiss index."""
    started = time.perf_counter()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    with layout.write_lock("remove images from"), Catalogue(layout.catalogue) as catalogue:
        info = _require_complete(layout, catalogue)
        wanted = [int(i) for i in ids]
        if paths:
            resolved = [str(Path(p).expanduser().resolve()) for p in paths]
            found = catalogue.ids_for_paths([p for p in resolved if is_utf8(p)])  # others are never catalogued
            missing = [printable_path(p) for p in resolved if p not in found]
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
            **_summary(catalogue, started, {}),
        }


def repair_index(
    index_dir: str | Path,
    model: str | Path | None = None,
    embedder: Embedder | None = None,
    rebuild: bool = False,
    gpu: bool = False,
    options: IngestOptions | None = None,
) -> dict[str, Any]:
    """Finish an interrupted build/add, or mend an index whose parts disagree; returns a summary.

    Re-embeds only images that no shard holds (the model is loaded only then). faiss is updated in
    place (or rebuilt from the shards: an unfinished build, an unreadable faiss file, or ``rebuild``),
    and the result is checked: faiss holds exactly the catalogue's ``done`` ids.
    """
    started = time.perf_counter()
    options = options or IngestOptions()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    with layout.write_lock("repair"), Catalogue(layout.catalogue) as catalogue:
        state = catalogue.get_meta("state")
        if state is None or catalogue.get_meta("model_hash") is None:
            raise FileNotFoundError(
                f"{layout.root} holds no started build, so there is nothing to repair; build it with "
                f"`retrieval index build --model ... --images ... --out {layout.root}`"
            )
        store = ShardStore(layout.shards)
        mended = mend(catalogue, store)
        source = catalogue.get_meta("gallery_images")
        if catalogue.counts()["total"] == 0 and source is not None:  # killed while planning: plan again
            gallery = _list(source, catalogue.get_meta("gallery_split"))
            catalogue.plan(gallery.items, gallery.source, gallery.errors)
        if catalogue.counts()["pending"]:
            if embedder is None:
                path = model or catalogue.get_meta("model_path")
                if path is None:
                    raise ValueError(
                        f"{catalogue.counts()['pending']} images of {layout.root} need embedding and the "
                        "index records no model path; pass --model"
                    )
                embedder = load_model(path)
            _check_same_model(catalogue, embedder, layout.root)
            Ingestor(catalogue, store, embedder, options).run()
        info = _info_from_meta(catalogue)
        old = _readable_info(layout) if state == "complete" else None
        index = _readable_faiss(layout) if old is not None and not rebuild else None
        if old is not None and index is not None:
            updated = update_faiss(layout, catalogue, store, old, gpu, index=index)
            info = old | updated
        else:
            key = old["index_key"] if old is not None else catalogue.get_meta("index_key") or "auto"
            built = build_faiss(layout, catalogue, store, key, info["embedding_dim"], gpu)
            if old is not None:
                built["index_key_requested"] = old.get("index_key_requested", key)
            info = (old or {}) | info | built
        layout.write_info(info)
        catalogue.set_meta(state="complete")
        return {
            "index_dir": str(layout.root),
            "index_key": info["index_key"],
            "faiss": info.get("updated_by", "rebuilt from the shards"),
            "vectors": info["count"],
            **_summary(catalogue, started, mended),
        }


def _readable_info(layout: IndexLayout) -> dict[str, Any] | None:
    try:
        info = layout.read_info()
    except (OSError, ValueError):
        return None
    return info if "index_key" in info and "embedding_dim" in info else None


def _readable_faiss(layout: IndexLayout) -> faiss.Index | None:
    try:
        return faiss_ops.read_index(layout.faiss)
    except RuntimeError:  # missing or damaged: rebuilt from the shards
        return None
