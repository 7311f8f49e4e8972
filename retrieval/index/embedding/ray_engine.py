"""``--engine ray``: decode and embed a gallery with Ray Data on a Ray cluster, fill faiss in parallel tasks.

The driver (this process) keeps every job of the local engine that touches the index folder, with the same
functions: it lists the gallery, plans the catalogue, writes each shard atomically and records its outcomes
(``ingest.Ingestor``), so resumption after a kill -9 works exactly as for a local build. Ray does the heavy,
stateless parts:

- Ray Data reads, hashes, decodes and preprocesses the pending images in CPU tasks (``ray_stages.decode_rows``
  over ``gallery_file.decode_file``: the local engine's decoder, preprocessing and bad-file rules), then embeds
  them in an actor pool that loads the ONNX model once per actor (``ray_stages.BatchEmbedder``: onnxruntime's CUDA
  provider when the actor has a GPU and onnxruntime-gpu is installed; that module never imports torch, which every
  fresh worker process would pay). The driver streams the embeddings back in order and writes them as parquet
  shards (``ShardStore.write_parquet``).
- For an IVF index key, ``build_faiss`` trains the coarse quantizer on a random sample of the shards (as for a
  local build); every shard's vectors are then added to a copy of the trained index in a Ray task, and the
  per-shard indexes are merged: in memory, or with faiss' ``contrib.ondisk.merge_ondisk`` into an
  ``.ivfdata`` file when the index would not fit in memory. Other keys (Flat, HNSW) are filled in the driver.

The images and the model file must be readable at the same paths on every node (shared storage), as for any
Ray batch-inference job. Ray is imported only when the engine connects, so the core imports without it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.catalogue import THROUGHPUT_META, Catalogue, Outcome
from retrieval.index.embedding.engine import IngestOptions, RayOptions
from retrieval.index.embedding.gallery_file import Decoded
from retrieval.index.embedding.ingest import Ingestor, ShardBuffer
from retrieval.index.embedding.ray_stages import BatchEmbedder, decode_rows
from retrieval.index.faiss_backend import faiss_files, faiss_keys, faiss_params
from retrieval.index.faiss_backend.faiss_build import add_sequentially
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import Chunks

DECODE_MEMORY = 2**30  # the worker process (no torch: ~200 MB) and one decode (< 300 MB, read_image), with margin
RAY_INSTALL = 'pip install "ray[data]>=2.40"'
START_CLUSTER = (
    "start one with `ray start --head` (then `ray start --address=HEAD_IP:6379` on the other machines), "
    "or give the address local to start Ray on this machine only"
)

# Where a small gallery is faster locally (``estimate_engines``): the rates when neither this index's throughput
# record (catalogue meta ``THROUGHPUT_META``) holds a measured run. Measured on the 2-core reference machine,
# docs/BENCHMARKS.md, "Ray engine", runs A-C (uint8 crops):
LOCAL_IMAGES_PER_S = 370.0  # the local engine end to end (325-424 img/s over runs A-C)
RAY_ACTOR_IMAGES_PER_S = 390.0  # one embedding actor after the job's start-up (run B, 10,000 images: 385-399 img/s)
RAY_STARTUP_S = 4.0  # Ray Data's fixed cost per job until the first embeddings (2.7-4.9 s warm, 5.7 s cold)
# Ray Data jobs started again after the cluster lost a node, an actor or objects under a job (``RayIngestor``)
MAX_JOB_RETRIES = 3

log = logging.getLogger(__name__)


def import_ray() -> Any:
    """The ``ray`` module, or the error that says how to install it."""
    try:
        import ray
        import ray.data  # noqa: F401  (Ray Data comes with the [data] extra)
    except ImportError as exc:
        raise RuntimeError(
            f"the ray engine needs Ray Data, which is not installed ({exc}); install it with: {RAY_INSTALL}"
        ) from exc
    return ray


def _probe(address: str, timeout: float) -> None:
    """Fail fast when nothing listens at ``[ray://]HOST:PORT`` (ray.init would wait much longer)."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ParameterError(
            "address", f"{address!r} is not auto, local, ray://HOST:PORT or HOST:PORT; for a cluster started with "
            "`ray start --head`, give HEAD_IP:6379 (or auto on a machine of the cluster)"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach the Ray cluster at {address} within {timeout:g} s ({exc}); {START_CLUSTER}"
        ) from exc


def connect(address: str, timeout: float = 10.0) -> bool:
    """Join (or start, for ``local``) a Ray cluster; True when this call started the connection.

    A process already connected (``ray.init`` called before, e.g. by a test) keeps its connection.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    if address not in ("auto", "local"):
        _probe(address, timeout)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot connect to the Ray cluster at {address!r} ({exc}); {START_CLUSTER}") from exc
    return True


class RayEngine:
    """``--engine ray`` (an ``IngestEngine``): a context manager holding the cluster connection.

    ``policy`` bounds the memory an IVF merge may take before it merges on disk (``RayOptions.merge_on_disk``).
    """

    name = "ray"

    def __init__(
        self, options: RayOptions | None = None, policy: faiss_keys.AutoPolicy = faiss_keys.AUTO_POLICY
    ) -> None:
        self.options, self.policy = options or RayOptions(), policy
        if self.options.actors < 1:
            raise ParameterError("actors", f"must be >= 1, got {self.options.actors}")
        if self.options.gpus_per_actor < 0:
            raise ParameterError("gpus_per_actor", f"must be >= 0, got {self.options.gpus_per_actor}")
        if self.options.cpus_per_actor <= 0:
            raise ParameterError("cpus_per_actor", f"must be > 0, got {self.options.cpus_per_actor}")
        self._started = False
        # what runs each ingest's Ray job, made with RayIngestor's arguments: ``ray_collection.write_into`` puts in
        # one that writes into a Milvus collection, so this module knows nothing of collections
        self.ingestor: Callable[..., RayIngestor] = RayIngestor
        self.run_facts: dict[str, float] = {}  # the last ingest's start-up and actor time (``ingest.ingest`` sums them)

    def __enter__(self) -> RayEngine:
        self._started = connect(self.options.address, self.options.connect_timeout)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._started:
            import_ray().shutdown()
            self._started = False

    def ingest(self, catalogue: Catalogue, store: ShardStore, embedder: ImageEmbedder, options: IngestOptions) -> None:
        model_path = getattr(embedder, "path", None) or catalogue.get_meta("model_path")
        if model_path is None:
            raise ValueError("the ray engine loads the model in each actor from its file: give the `model` file")
        # absolute: the actors' working folder is not this one
        model_path = str(Path(model_path).resolve())
        ingestor = self.ingestor(catalogue, store, embedder, options, self.options, model_path)
        ingestor.run()
        self.run_facts = ingestor.facts

    def add_vectors(self, index: faiss.Index, chunks: Chunks, workdir: Path, count: int) -> faiss.Index:
        """Per-shard Ray tasks for an IVF index, merged here; any other index is filled in this process."""
        core = faiss_params.inner(index)
        # a fresh IVF index keeps the catalogue ids in its lists (faiss_keys.new_index); any other is filled here
        if not isinstance(core, faiss.IndexIVF) or faiss_params.has_id_map(index) or index.ntotal:
            return add_sequentially(index, chunks)
        on_disk = self.options.merge_on_disk
        if on_disk is None:  # the merged lists (codes + ids) against the memory the auto policy may use
            budget = faiss_keys.available_memory() * self.policy.memory_fraction
            on_disk = count * (core.code_size + 8) > budget
        return ShardedIvfBuilder(index, core, workdir, on_disk, self.options.add_tasks_in_flight).fill(chunks)


@dataclasses.dataclass(frozen=True)
class EngineEstimate:
    """How long ``images`` would take on each engine, and what the rates came from."""

    images: int
    local_s: float
    ray_s: float
    startup_s: float
    source: str

    @property
    def local_is_sooner(self) -> bool:
        """True when the local engine would finish before Ray (Ray's fixed start-up not yet paid back)."""
        return self.local_s < self.ray_s

    def message(self) -> str:
        """The one line the ray engine logs before a gallery the local engine would finish sooner."""
        return (
            f"about {self.images:,} images: the local engine would take ~{_seconds(self.local_s)} s, Ray "
            f"~{_seconds(self.ray_s)} s including its ~{_seconds(self.startup_s)} s start-up ({self.source}); "
            "use the local engine for small galleries"
        )


def _seconds(value: float) -> str:
    """Seconds as the estimate prints them: tenths under 10 s (a small gallery's ~0.3 s), whole seconds above."""
    return f"{value:.1f}" if value < 10 else f"{value:.0f}"


def estimate_engines(images: int, record: Mapping[str, Any], actors: int = 1) -> EngineEstimate:
    """Local against Ray time for ``images``, from a throughput record (``THROUGHPUT_META``) where it has measured
    runs, else the documented defaults; Ray's steady rate is per actor times ``actors`` (each on its own cores)."""
    local, ray = record.get("local") or {}, record.get("ray") or {}
    sources = []
    local_rate = LOCAL_IMAGES_PER_S
    if local.get("seconds", 0) > 0 and local.get("images", 0) > 0:
        local_rate = local["images"] / local["seconds"]
        sources.append("local: this index's record")
    actor_rate, startup = RAY_ACTOR_IMAGES_PER_S, RAY_STARTUP_S
    if ray.get("measured_runs", 0) > 0 and ray.get("actor_seconds", 0) > 0:  # runs that timed their start-up
        actor_rate = ray["measured_images"] / ray["actor_seconds"]
        startup = ray["startup_seconds"] / ray["measured_runs"]
        sources.append("ray: this index's record")
    source = "; ".join(sources) if sources else "rates measured in docs/BENCHMARKS.md"
    if len(sources) == 1:
        source += ", the other from docs/BENCHMARKS.md"
    return EngineEstimate(
        images, images / local_rate, startup + images / (actor_rate * max(1, actors)), startup, source
    )


class RayIngestor(Ingestor):
    """``Ingestor`` whose images are decoded and embedded by Ray Data; shards are written as parquet here.

    Fault tolerance: Ray Data restarts a dead actor (``max_restarts=-1``) and retries its tasks, also on another
    node; when a job fails anyway because the cluster lost a node, an actor or the objects under it, the rows not
    yet written to a shard are still ``pending`` in the catalogue, so the wave runs again over just those
    (``MAX_JOB_RETRIES`` times): every image lands in exactly one shard.
    """

    def __init__(
        self,
        catalogue: Catalogue,
        store: ShardStore,
        embedder: ImageEmbedder,
        options: IngestOptions,
        ray_options: RayOptions,
        model_path: str,
    ) -> None:
        super().__init__(catalogue, store, embedder, options)
        self.ray_options, self.model_path = ray_options, model_path
        self.paths: dict[int, str] = {}
        self.buffer_nodes: collections.Counter[str] = collections.Counter()  # node id -> images of the buffer
        self.nodes: collections.Counter[str] = collections.Counter()  # node id -> images embedded there
        self.facts: dict[str, float] = {}  # start-up and actor time of this run, for the throughput record
        self.retries = 0

    def run(self) -> None:
        pending = self.catalogue.pending()
        if not pending:
            return
        self._advise(len(pending))
        with self.progress_bar(len(pending), "index (ray)") as bar:
            self.started, self.first = time.perf_counter(), None
            for start in range(0, len(pending), self.ray_options.wave_size):
                wave = pending[start : start + self.ray_options.wave_size]
                self.paths, rows = dict(wave), wave
                while True:
                    try:
                        self._run_wave(rows, bar)
                        break
                    except Exception as exc:
                        if self.retries >= MAX_JOB_RETRIES or not lost_to_the_cluster(exc):
                            raise
                        rows = self._replan(wave, bar, exc)
        if self.first is not None:
            steady = time.perf_counter() - self.first
            self.facts = {
                "startup_seconds": self.first - self.started,
                "actor_seconds": steady * self.ray_options.actors,
                "measured_images": len(pending),
                "measured_runs": 1,
            }
        if self.nodes:
            log.info("ray: embedded on %d node(s): %s", len(self.nodes),
                     ", ".join(f"{node[:12]} {n} images" for node, n in self.nodes.most_common()))

    def _advise(self, images: int) -> None:
        """Say so (never refuse) when the local engine would finish this gallery before Ray's start-up pays off."""
        record = json.loads(self.catalogue.get_meta(THROUGHPUT_META) or "{}")
        estimate = estimate_engines(images, record, self.ray_options.actors)
        if estimate.local_is_sooner:
            log.warning("%s", estimate.message())

    def _run_wave(self, rows: Sequence[tuple[int, str]], bar: Any) -> None:
        """One Ray Data job over ``rows``: take its batches in order, write full shards and the rest."""
        for batch in self._embedded(rows):
            if self.first is None:  # start-up: the decode workers and the actors start, the actors load the model
                self.first = time.perf_counter()
                log.info("ray: first embeddings after %.1f s", self.first - self.started)
            self._take_embedded(batch)
            if len(self.buffer) >= self.options.shard_size:
                self._flush()
            bar.update(len(batch["id"]))
        self._flush()

    def _replan(self, wave: Sequence[tuple[int, str]], bar: Any, exc: BaseException) -> list[tuple[int, str]]:
        """After a job lost to the cluster: forget the unwritten buffer and return the wave's rows still pending."""
        self.retries += 1
        dropped = len(self.buffer)
        bar.update(-dropped)
        self.buffer, self.buffer_nodes = ShardBuffer(), collections.Counter()
        self.seen = self.catalogue.done_sha256()  # the dropped rows were admitted: they are not indexed yet
        still = {i for i, _ in self.catalogue.pending()}
        rows = [row for row in wave if row[0] in still]
        log.warning(
            "ray: the job lost part of the cluster (%s: %s); running the %d images not yet in a shard again "
            "(%d dropped from the unwritten shard; retry %d of %d)",
            type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "", len(rows), dropped,
            self.retries, MAX_JOB_RETRIES,
        )
        return rows

    def _embedded(self, rows: Sequence[tuple[int, str]]) -> Iterator[dict[str, np.ndarray]]:
        """The rows' decode + embed results, streamed back in the rows' order."""
        ray = import_ray()
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # the first copy of a duplicate is kept, as locally
        context.enable_progress_bars = False  # the driver's own bar counts images
        batch_size, size = self.options.batch_size, self.embedder.preprocessing.input_size
        opts = self.ray_options
        dataset = ray.data.from_items(
            self._items(rows), override_num_blocks=max(1, -(-len(rows) // (4 * batch_size)))
        )
        dataset = dataset.map_batches(
            decode_rows,
            fn_kwargs={
                "preprocessing": self.embedder.preprocessing,
                "max_pixels": self.options.max_pixels,
            },
            batch_size=batch_size,
            batch_format="numpy",
            # the memory one task may use: its worker, one image decode and the batch, in and out;
            # requesting it also keeps decoding a stage of its own (Ray Data fuses stages with equal
            # resources into the actors, whose CPUs or GPUs should only embed)
            memory=DECODE_MEMORY + 2 * batch_size * 3 * size * size,  # uint8 crops
        )
        dataset = dataset.map_batches(
            BatchEmbedder,
            fn_constructor_kwargs={
                "model_path": self.model_path,
                "model_hash": self.embedder.model_hash,
                "threads": max(1, int(opts.cpus_per_actor)),
                # the output the index's vectors come from (a compatible one: an old model's space)
                "output": getattr(self.embedder, "output_name", None),
            },
            batch_size=batch_size,
            batch_format="numpy",
            compute=ray.data.ActorPoolStrategy(size=opts.actors),
            num_cpus=opts.cpus_per_actor,
            num_gpus=opts.gpus_per_actor or None,
        )
        dataset = self._after_embedding(dataset)
        yield from dataset.iter_batches(batch_size=batch_size, batch_format="numpy", prefetch_batches=2)

    def _items(self, rows: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
        """The job's input rows: what the decode stage reads (and what later stages carry through)."""
        return [{"id": int(i), "path": p} for i, p in rows]

    def _after_embedding(self, dataset: Any) -> Any:
        """Stages after the embedding actors (none: the embeddings stream back to this process)."""
        return dataset

    def _take_embedded(self, batch: dict[str, np.ndarray]) -> None:
        columns = zip(batch["id"], batch["ok"], batch["sha256"], batch["size"], batch["error"], strict=True)
        wanted = [
            self.admit(Decoded(int(i), None if size < 0 else int(size), sha or None, None, None if ok else error))
            for i, ok, sha, size, error in columns
        ]
        if any(wanted):
            self.buffer.vectors.append(np.ascontiguousarray(np.asarray(batch["embedding"], np.float32)[wanted]))
        self.buffer_nodes.update(str(node) for node in batch["node"])

    def _write_shard(self, ids: np.ndarray, vectors: np.ndarray, outcomes: list[Outcome]) -> str:
        # which nodes embedded the shard's rows: what a multi-node run did, readable from each shard
        metadata = {"embedded_on": json.dumps(dict(self.buffer_nodes))}
        name = self.store.write_parquet(ids, vectors, outcomes, self.paths, metadata)
        self.nodes.update(self.buffer_nodes)
        self.buffer_nodes = collections.Counter()
        return name


def lost_to_the_cluster(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it was raised from) is Ray losing a node, an actor or an object, not an
    error of our code (a bad model file fails at once instead of three more times)."""
    ray = import_ray()
    lost = (
        ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError,
        ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
    )
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if "ModelMismatchError" in type(current).__name__ or "UserCodeException" in type(current).__name__:
            return False
        if isinstance(current, lost):
            return True
        current = current.__cause__ or current.__context__
    return False


# --- faiss: per-shard tasks and merge ----------------------------------------------------------------
def add_shard(trained: bytes, ids: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Ray task: the trained, empty IVF index with one shard's vectors added under their catalogue ids."""
    index = faiss.deserialize_index(np.frombuffer(trained, np.uint8))
    index.add_with_ids(np.ascontiguousarray(vectors, np.float32), np.ascontiguousarray(ids, np.int64))
    return faiss.serialize_index(index)


class ShardedIvfBuilder:
    """Fills an empty trained IVF index that keeps the catalogue ids in its lists from per-shard indexes built in
    Ray tasks, each adding its shard's vectors under their ids, as a sequential ``add_with_ids`` would have."""

    def __init__(
        self, index: faiss.Index, ivf: faiss.IndexIVF, workdir: Path, on_disk: bool, in_flight: int = 4
    ) -> None:
        self.index, self.ivf, self.workdir = index, ivf, Path(workdir)
        self.on_disk, self.max_in_flight = on_disk, max(1, in_flight)

    def fill(self, chunks: Chunks) -> faiss.Index:
        ray = import_ray()
        task = ray.remote(num_cpus=1)(add_shard)
        trained = ray.put(faiss.serialize_index(self.ivf).tobytes())
        parts_dir = self.workdir / "ivf-parts"  # the per-shard indexes of an on-disk merge
        if self.on_disk:
            parts_dir.mkdir(exist_ok=True)
        parts: list[str] = []
        in_flight: list[Any] = []
        offset = 0

        def merge_oldest() -> None:
            part = faiss.deserialize_index(ray.get(in_flight.pop(0)))
            if self.on_disk:
                parts.append(str(parts_dir / f"part-{len(parts):06d}.index"))
                faiss.write_index(part, parts[-1])
            else:
                self.ivf.merge_from(part, 0)

        started, shards = time.perf_counter(), 0
        for ids, vectors in chunks:
            shards += 1
            offset += len(ids)
            in_flight.append(task.remote(trained, ids, vectors))
            while len(in_flight) > self.max_in_flight:
                merge_oldest()
        while in_flight:
            merge_oldest()
        if self.on_disk:
            self._merge_on_disk(parts, parts_dir)
        log.info(
            "faiss: %d vectors added in %d per-shard Ray tasks and merged (%s) in %.1f s",
            offset, shards, "on disk" if self.on_disk else "in memory", time.perf_counter() - started,
        )
        return self.index

    def _merge_on_disk(self, parts: list[str], parts_dir: Path) -> None:
        """Merge the per-shard lists into a new ``index-<time>.ivfdata`` that the written index.faiss names."""
        from faiss.contrib.ondisk import merge_ondisk

        if not (self.workdir / "index.faiss").exists():  # a build killed before: nothing refers to older data
            for stale in self.workdir.glob(faiss_files.ON_DISK_LISTS):
                with contextlib.suppress(OSError):
                    stale.unlink()
        with faiss_files.faiss_prints_to_stderr():  # merge_ondisk reports with printf: stdout stays the CLI's JSON
            merge_ondisk(self.ivf, parts, str(faiss_files.new_lists_file(self.workdir)))
        for part in parts:
            Path(part).unlink(missing_ok=True)
        parts_dir.rmdir()
