"""``--engine ray`` on a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``): the work lands
on both nodes, and a build whose worker node dies mid-way completes with every image indexed exactly once, with
the vectors of a local build. Also the start-up estimate that ``--engine ray`` prints for small galleries.

Its own module: the cluster is not ``test_index_ray``'s one-node ``ray.init(address="local")``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray
from embedders import write_projection_onnx
from index_builds import assert_each_indexed_once
from ray.cluster_utils import Cluster

from retrieval.data.synthetic import write_digits
from retrieval.index import Catalogue, Index, IngestOptions, build_index
from retrieval.index.embedding import ray_engine
from retrieval.index.embedding.engine import RayOptions
from retrieval.index.embedding.ray_engine import RayIngestor, estimate_engines
from retrieval.index.shards import ShardStore

IMAGES = 960
SHARD_SIZE = 32
BATCH = 8
CONVS = 16  # ~2.5-5 ms per image and thread: the actors are still embedding when the worker node dies


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_projection_onnx(tmp_path_factory.mktemp("model") / "projection.onnx", convs=CONVS)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("gallery") / "images"
    return folder, write_digits(folder, IMAGES)


def shard_nodes(index_dir: Path) -> list[dict[str, int]]:
    """Per shard, the images each node embedded (the shard's ``embedded_on`` metadata)."""
    import pyarrow.parquet as pq

    return [
        json.loads(pq.read_schema(path).metadata[b"embedded_on"])
        for path in sorted((index_dir / "shards").glob("shard-*.parquet"))  # written atomically: complete files
    ]


def vectors_by_path(index_dir: Path) -> dict[str, np.ndarray]:
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.rows(catalogue.ids_with_status("done"))
    return {
        rows[i]["path"]: vector
        for shard in ShardStore(index_dir / "shards")
        for i, vector in zip(shard.ids.tolist(), shard.vectors, strict=True)
    }


@pytest.mark.slow
def test_two_nodes_share_the_build_and_a_lost_node_loses_no_image(model, gallery, tmp_path, caplog):
    """Head (3 logical CPUs) and worker node (1); two embedding actors of 1 CPU, which Ray Data spreads over the
    nodes (its default SPREAD strategy). The head alone can hold the whole pool and a decode task: with less, the
    actor restarted there and the decode tasks left could wait for each other's CPU.
    A thread watching the shards removes the worker node (its raylet and workers killed, no graceful exit) once
    some shards are written: the build completes on the head alone and every image is indexed exactly once."""
    folder, paths = gallery
    local = build_index(
        folder, tmp_path / "local", model=model,
        options=IngestOptions(batch_size=BATCH, shard_size=SHARD_SIZE, workers=1, progress=False),
    )
    assert local["indexed"] == IMAGES
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=1)
    out = tmp_path / "ray"
    killed: dict[str, float] = {}
    try:
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        head_id, worker_id = cluster.head_node.node_id, worker.node_id
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == {head_id, worker_id}

        def kill_worker_mid_build() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                # once each node has embedded a shard (which actor is ready first varies): the worker then holds
                # batches in flight, and most of the 30 shards are still to come
                embedded = {node for shard in shard_nodes(out) for node in shard} if (out / "shards").is_dir() else ()
                if worker_id in embedded and head_id in embedded:
                    killed["shards_before"] = len(list((out / "shards").glob("shard-*.parquet")))
                    killed["at"], killed["wall"] = time.monotonic(), time.time()
                    cluster.remove_node(worker, allow_graceful=False)
                    killed["removed_in"] = time.monotonic() - killed["at"]
                    return
                time.sleep(0.02)

        watcher = threading.Thread(target=kill_worker_mid_build, daemon=True)
        options = IngestOptions(
            batch_size=BATCH, shard_size=SHARD_SIZE, progress=False, engine="ray",
            ray=RayOptions(address=cluster.address, actors=2, cpus_per_actor=1),
        )
        started = time.monotonic()
        watcher.start()
        with caplog.at_level(logging.INFO, logger="retrieval.index.embedding.ray_engine"):
            summary = build_index(folder, out, model=model, options=options)
        finished = time.monotonic()
        watcher.join(timeout=60)
    finally:
        ray.shutdown()
        cluster.shutdown()

    # no thread of Ray Data's usage statistics outlives the cluster in this process (tests/conftest.py turns them off)
    assert "data-usage-metrics-poller" not in {thread.name for thread in threading.enumerate()}
    assert "at" in killed, "the build ended before the worker node could be killed"
    per_shard = shard_nodes(out)
    # what docs/BENCHMARKS.md reports, before the checks ("Ray: two nodes and a lost node")
    counts = {node: sum(s.get(node, 0) for s in per_shard) for node in (head_id, worker_id)}
    retries = [r.getMessage() for r in caplog.records if "lost part of the cluster" in r.getMessage()]
    print(json.dumps({
        "build_s": round(finished - started, 1), "kill_after_s": round(killed["at"] - started, 1),
        "after_kill_s": round(finished - killed["at"], 1), "remove_node_s": round(killed["removed_in"], 1),
        "shards_before_kill": killed["shards_before"], "shards": len(per_shard),
        "images_by_node": {"head": counts[head_id], "worker": counts[worker_id]},
        "shards_by_nodes": {
            "both": sum(len(s) == 2 for s in per_shard),
            "head": sum(set(s) == {head_id} for s in per_shard),
            "worker": sum(set(s) == {worker_id} for s in per_shard),
        },
        "engine_retries": retries,
        "shards_in_order": [  # H: head, W: worker; seconds the shard was written after the kill
            "".join("H" if n == head_id else "W" for n in sorted(shard, key=lambda n: n != head_id))
            + f"{path.stat().st_mtime - killed['wall']:+.1f}"
            for shard, path in zip(per_shard, sorted((out / "shards").glob("shard-*.parquet")), strict=True)
        ],
    }))
    assert killed["shards_before"] < IMAGES // SHARD_SIZE  # killed mid-way through the 30 shards
    # the work landed on both nodes (a shard the worker embedded may still be written after its death: its
    # vectors had reached the driver, and the ordered stream hands them over once the shards before are done)
    embedded = {node for shard in per_shard for node in shard}
    assert embedded == {head_id, worker_id}, (embedded, head_id, worker_id)
    # every image exactly once: catalogue, shards, faiss; and each vector is the local build's
    assert summary["indexed"] == IMAGES and summary["pending"] == 0
    assert_each_indexed_once(out, paths)
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        assert catalogue.counts()["done"] == IMAGES
    with Index.open(out) as index:
        assert index.faiss_index.ntotal == IMAGES
    local_vectors, ray_vectors = vectors_by_path(tmp_path / "local"), vectors_by_path(out)
    assert ray_vectors.keys() == local_vectors.keys() and len(ray_vectors) == IMAGES
    for path, vector in local_vectors.items():
        np.testing.assert_allclose(ray_vectors[path], vector, atol=1e-5)


def test_ray_says_when_the_local_engine_would_be_sooner(caplog):
    """The estimate follows the rates: below the break-even gallery size Ray's start-up is not paid back and the
    line is printed, above it not; a throughput record measured on this machine replaces the defaults."""
    local_rate, actor_rate, startup = (
        ray_engine.LOCAL_IMAGES_PER_S, ray_engine.RAY_ACTOR_IMAGES_PER_S, ray_engine.RAY_STARTUP_S
    )
    break_even = startup / (1 / local_rate - 1 / actor_rate)  # local time == Ray time
    small, large = int(break_even / 10), int(break_even * 2)
    assert estimate_engines(small, {}).local_is_sooner
    assert not estimate_engines(large, {}).local_is_sooner
    message = estimate_engines(small, {}).message()
    local_s = ray_engine._seconds(small / local_rate)
    assert message.startswith(f"about {small:,} images: the local engine would take ~{local_s} s")
    assert f"including its ~{startup:.1f} s start-up" in message and "the local engine for small" in message
    assert f"Ray ~{ray_engine._seconds(startup + small / actor_rate)} s" in message
    # four actors pay the start-up back four times sooner (each on its own cores)
    assert not estimate_engines(int(break_even / 2), {}, actors=4).local_is_sooner

    # this index's record: a local engine at 100 img/s and Ray at 1,000 img/s per actor after 10 s of start-up
    record = {
        "local": {"images": 1000, "seconds": 10.0},
        "ray": {"measured_images": 2000, "actor_seconds": 2.0, "startup_seconds": 20.0, "measured_runs": 2},
    }
    own_break_even = 10.0 / (1 / 100 - 1 / 1000)
    assert estimate_engines(int(own_break_even * 0.9), record).local_is_sooner
    assert not estimate_engines(int(own_break_even * 1.1), record).local_is_sooner
    assert "this index's record" in estimate_engines(10, record).message()


class JobStarted(Exception):
    """Raised by the stubbed Ray Data job: the test stops where the work would start."""


def test_ray_build_prints_the_estimate_before_the_work_only_for_a_small_gallery(model, tmp_path, monkeypatch, caplog):
    """``build --engine ray`` logs the line before the first Ray Data job for a gallery under the break-even, and
    not once the documented start-up it is computed from is gone (no cluster: the job is stubbed)."""
    folder = tmp_path / "images"
    write_digits(folder, 12)
    started: list[int] = []

    def job(self, rows, bar):
        started.append(len(rows))
        raise JobStarted

    monkeypatch.setattr(ray_engine, "connect", lambda address, timeout=10.0: False)
    monkeypatch.setattr(RayIngestor, "_run_wave", job)
    # Ray twice as fast as the local engine once started: only its start-up can make the local engine sooner
    monkeypatch.setattr(ray_engine, "RAY_ACTOR_IMAGES_PER_S", ray_engine.LOCAL_IMAGES_PER_S * 2)
    for startup, expected in ((ray_engine.RAY_STARTUP_S, True), (0.0, False)):
        monkeypatch.setattr(ray_engine, "RAY_STARTUP_S", startup)
        caplog.clear()
        options = IngestOptions(batch_size=4, progress=False, engine="ray", ray=RayOptions(address="local"))
        with caplog.at_level(logging.INFO, logger="retrieval.index.embedding.ray_engine"), pytest.raises(JobStarted):
            build_index(folder, tmp_path / f"idx-{startup}", model=model, options=options)
        lines = [r.getMessage() for r in caplog.records if "use the local engine" in r.getMessage()]
        assert lines == ([estimate_engines(12, {}).message()] if expected else []), lines
    assert started == [12, 12]


def test_a_job_lost_to_the_cluster_runs_again_over_the_rows_not_yet_in_a_shard(tmp_path, monkeypatch, caplog):
    """When a Ray Data job fails because the cluster lost a node (Ray's own restarts did not save it), the engine
    drops the unwritten shard, runs the rows still pending again, and indexes every image exactly once; a failure
    of our own code is not retried. No cluster: the job is stubbed with the real decode stage and the model."""
    from retrieval.data.eval_preprocess import EvalPreprocess
    from retrieval.index.embedding.ray_stages import decode_rows
    from retrieval.index.query_embedder import prepare_vectors

    folder = tmp_path / "images"
    paths = write_digits(folder, 40)
    (folder / "copy.png").write_bytes(paths[3].read_bytes())  # a duplicate: the first copy must stay the original
    small = write_projection_onnx(tmp_path / "projection.onnx")
    jobs: list[int] = []

    def job(self, rows):
        jobs.append(len(rows))
        preprocess = EvalPreprocess(self.embedder.preprocessing)
        for start in range(0, len(rows), BATCH):
            if len(jobs) == 1 and start == 3 * BATCH:  # a shard written, one batch in the buffer: the node dies
                raise RuntimeError("the dataset failed") from ray.exceptions.NodeDiedError("node x died")
            chunk = rows[start : start + BATCH]
            ids, files = np.array([i for i, _ in chunk]), np.array([p for _, p in chunk], object)
            batch = decode_rows({"id": ids, "path": files}, self.embedder.preprocessing, 10**8)
            ok = batch.pop("ok")
            vectors = np.zeros((len(ok), self.embedder.embedding_dim), np.float32)
            pixels = preprocess.normalize(batch.pop("pixels")[ok])
            vectors[ok] = prepare_vectors(self.embedder.embed(pixels), self.embedder.embedding_dim)
            yield batch | {"ok": ok, "embedding": vectors, "node": np.full(len(ok), f"node-{len(jobs)}", object)}

    monkeypatch.setattr(ray_engine, "connect", lambda address, timeout=10.0: False)
    monkeypatch.setattr(RayIngestor, "_embedded", job)
    options = IngestOptions(batch_size=BATCH, shard_size=2 * BATCH, progress=False, engine="ray",
                            ray=RayOptions(address="local"))
    with caplog.at_level(logging.INFO, logger="retrieval.index.embedding.ray_engine"):
        summary = build_index(folder, tmp_path / "ray", model=small, options=options)
    assert jobs == [41, 41 - 2 * BATCH]  # the second job: the rows after the one shard written
    assert summary["indexed"] == 40 and summary["duplicates"] == 1 and summary["pending"] == 0
    local = build_index(folder, tmp_path / "local", model=small,
                        options=IngestOptions(batch_size=BATCH, shard_size=2 * BATCH, workers=0, progress=False))
    local_vectors, ray_vectors = vectors_by_path(tmp_path / "local"), vectors_by_path(tmp_path / "ray")
    assert local["duplicates"] == 1 and len(local_vectors) == 40  # the same copy is the duplicate in both
    assert_each_indexed_once(tmp_path / "ray", [Path(p) for p in local_vectors])
    assert [set(s) for s in shard_nodes(tmp_path / "ray")] == [{"node-1"}] + [{"node-2"}] * 2
    assert any("lost part of the cluster (RuntimeError" in r.getMessage() and f"{BATCH} dropped" in r.getMessage()
               for r in caplog.records)
    assert ray_vectors.keys() == local_vectors.keys()
    for path, vector in local_vectors.items():
        np.testing.assert_allclose(ray_vectors[path], vector, atol=1e-5)

    def broken_model(self, rows):
        jobs.append(len(rows))
        raise RuntimeError("the dataset failed") from ValueError("our own bug")
        yield  # a generator, as the real job

    monkeypatch.setattr(RayIngestor, "_embedded", broken_model)
    write_digits(tmp_path / "more", 4, start=500)
    jobs.clear()
    with pytest.raises(RuntimeError, match="the dataset failed"):
        build_index(tmp_path / "more", tmp_path / "broken", model=small, options=options)
    assert jobs == [4]  # not retried
