"""``--engine ray`` on a real local Ray cluster: same index as the local engine, resumption after kill -9 of the
driver, a killed Ray worker, the IVF sample-train / per-shard add / merge path, and the connection errors.

One cluster (2 CPUs) serves the whole module; drivers started as subprocesses join it by its address.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
import ray
from click.testing import CliRunner
from embedders import SIZE, write_projection_onnx
from index_builds import assert_each_indexed_once, clustered_unit_vectors, write_vector_index
from sample_images import jpeg_bytes, png_bytes

from retrieval.cli.index import index_group
from retrieval.data.synthetic import bomb_png, write_digits
from retrieval.index import Catalogue, Index, IngestOptions, build_index, index_stats, load_model
from retrieval.index.embedding.engine import RayOptions
from retrieval.index.embedding.ray_engine import RAY_INSTALL, RayEngine
from retrieval.index.faiss_backend import faiss_keys, faiss_measure, faiss_params
from retrieval.index.faiss_backend.faiss_build import build_faiss
from retrieval.index.shards import ShardStore

ROOT = Path(__file__).resolve().parents[2]
BROKEN = {
    "empty.png": b"",
    "truncated.png": png_bytes()[:40],
    "truncated.JPG": jpeg_bytes()[:300],
    "text.jpg": b"this is not an image\n" * 10,
    "bomb.png": bomb_png(),
}


@pytest.fixture(scope="module")
def cluster():
    """A real Ray cluster on this machine for the module; its GCS address for subprocess drivers."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_projection_onnx(tmp_path_factory.mktemp("model") / "projection.onnx")


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> tuple[Path, list[Path]]:
    """60 digits, one exact duplicate and five broken files."""
    folder = tmp_path_factory.mktemp("gallery") / "images"
    paths = write_digits(folder, 60)
    (folder / "broken").mkdir()
    for name, data in BROKEN.items():
        (folder / "broken" / name).write_bytes(data)
    (folder / "copy.png").write_bytes(paths[7].read_bytes())
    return folder, paths


def ray_options(**ray) -> IngestOptions:
    return IngestOptions(batch_size=8, shard_size=16, progress=False, engine="ray", ray=RayOptions(**ray))


def catalogue_view(index_dir: Path) -> dict:
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.rows(catalogue.ids_with_status("done") + catalogue.ids_with_status("duplicate"))
        errors = {r["path"]: r["error"] for r in catalogue.problems("error", 100)}
        duplicates = {r["path"] for r in catalogue.problems("duplicate", 100)}
    paths = {r["path"] for r in rows.values() if r["path"] not in duplicates}
    return {"paths": paths, "errors": errors, "duplicates": duplicates}


def vectors_by_path(index_dir: Path) -> dict[str, np.ndarray]:
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
        rows = catalogue.rows(list(done))
    out = {}
    for shard in ShardStore(index_dir / "shards"):
        for i, vector in zip(shard.ids.tolist(), shard.vectors, strict=True):
            out[rows[i]["path"]] = vector
    return out


def test_ray_build_equals_local_build(cluster, model, gallery, tmp_path, caplog):
    folder, paths = gallery
    options = IngestOptions(batch_size=8, shard_size=16, workers=1, progress=False)
    local = build_index(folder, tmp_path / "local", model=model, options=options)
    built = build_index(folder, tmp_path / "ray", model=model, options=ray_options())
    assert built["indexed"] == local["indexed"] == 60
    assert built["errors"] == local["errors"] == len(BROKEN) and built["duplicates"] == local["duplicates"] == 1
    assert catalogue_view(tmp_path / "ray") == catalogue_view(tmp_path / "local")
    assert {Path(p).name for p in catalogue_view(tmp_path / "ray")["errors"]} == set(BROKEN)
    assert sorted(p.name for p in (tmp_path / "ray" / "shards").iterdir()) == [
        f"shard-{i:06d}.parquet" for i in range(5)  # 66 images in shards of 16
    ]
    local_vectors, ray_vectors = vectors_by_path(tmp_path / "local"), vectors_by_path(tmp_path / "ray")
    assert local_vectors.keys() == ray_vectors.keys()
    for path, vector in local_vectors.items():
        np.testing.assert_allclose(ray_vectors[path], vector, atol=1e-5)
    local_info = json.loads((tmp_path / "local" / "index.json").read_text())
    ray_info = json.loads((tmp_path / "ray" / "index.json").read_text())
    for key in ("format", "model_hash", "embedding_dim", "index_key", "model_path", "count"):
        assert ray_info[key] == local_info[key]
    embedder = load_model(model)
    queries = embedder.embed(paths[:20])
    with Index.open(tmp_path / "local") as a, Index.open(tmp_path / "ray") as b:
        top_local = [[r.path for r in hits] for hits in a.search(queries, 10)]
        top_ray = [[r.path for r in hits] for hits in b.search(queries, 10)]
    assert top_ray == top_local and all(len(t) == 10 for t in top_ray)

    # the ray index is an ordinary index: stats (with per-engine throughput), add with either engine, search
    stats = index_stats(tmp_path / "ray", queries=20)
    assert stats["throughput"]["ray"]["images"] == 66 and stats["throughput"]["ray"]["images_per_s"] > 0
    assert {Path(e["path"]).name for e in stats["error_examples"]} == set(BROKEN)
    extra = write_digits(tmp_path / "extra", 5, start=700)
    args = ["add", str(tmp_path / "ray"), "--images", str(tmp_path / "extra"), "--engine", "ray", "--batch-size", "4",
            "--json"]
    caplog.clear()  # the build above said it too (66 images)
    with caplog.at_level(logging.INFO, logger="retrieval.index.embedding.ray_engine"):
        result = CliRunner().invoke(index_group, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["indexed"] == 65
    # 5 images: Ray's start-up (this index's own record of the build above) is not paid back, and it says so once
    advice = [r.getMessage() for r in caplog.records if "use the local engine for small galleries" in r.getMessage()]
    assert len(advice) == 1 and advice[0].startswith("about 5 images: the local engine would take ~0.0 s, Ray ~")
    assert "ray: this index's record" in advice[0]
    with Index.open(tmp_path / "ray") as index:
        assert index.search_images(extra[:1], k=1)[0][0].path == str(extra[0].resolve())
    assert index_stats(tmp_path / "ray", queries=10)["throughput"]["ray"]["runs"] == 2


def projection_reference(model: Path, pixels: np.ndarray) -> np.ndarray:
    """The projection model's embeddings computed in float64 from the weights in its file: flatten, project, L2."""
    import onnx
    from onnx import numpy_helper

    (weights,) = [numpy_helper.to_array(t) for t in onnx.load(str(model)).graph.initializer]
    projected = pixels.reshape(len(pixels), -1).astype(np.float64) @ weights.astype(np.float64)
    return projected / np.linalg.norm(projected, axis=1, keepdims=True)


TORCH_FREE_ACTOR = """
import sys

import numpy as np

from retrieval.index.embedding import ray_stages

assert "torch" not in sys.modules, "importing retrieval.index.embedding.ray_stages imported torch"
embedder = ray_stages.load_model(sys.argv[1], providers="cpu", intra_op_threads=1)
pixels = np.load(sys.argv[2])
np.save(sys.argv[3], ray_stages.prepare_vectors(embedder.embed(pixels), embedder.embedding_dim))
decoded = ray_stages.decode_rows({"id": np.array([1, 2]), "path": np.array([sys.argv[4], sys.argv[5]], object)},
                                 embedder.preprocessing, 10**7)
assert decoded["pixels"].dtype == np.uint8 and not decoded["pixels"][1].any()  # crops; the broken row stays zero
np.save(sys.argv[6], ray_stages.EvalPreprocess(embedder.preprocessing).normalize(decoded["pixels"][0]))  # as the actor
assert decoded["ok"].tolist() == [True, False] and decoded["error"][1]
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith(("torch.", "torchvision")))
assert not loaded, f"loading the model, decoding and embedding imported {loaded[:5]}"
"""


def test_ray_stages_decode_and_embed_without_torch(model, gallery, tmp_path):
    """Ray runs the decode tasks and each actor in fresh processes: their module must not import torch (~4.5 s here
    per process), and the decode task prepares an image exactly as the local engine (and evaluation) does."""
    from retrieval.data import open_image, preprocess_eval

    pixels = np.random.default_rng(1).standard_normal((5, 3, SIZE, SIZE)).astype(np.float32)
    np.save(tmp_path / "pixels.npy", pixels)
    image = next(p for p in sorted(gallery[0].rglob("*.png")) if p.stat().st_size > 100)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    args = [model, tmp_path / "pixels.npy", tmp_path / "out.npy", image, tmp_path / "broken.png", tmp_path / "dec.npy"]
    result = subprocess.run(
        [sys.executable, "-c", TORCH_FREE_ACTOR, *map(str, args)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), projection_reference(model, pixels), atol=1e-5)
    decoded = np.load(tmp_path / "dec.npy")
    expected = preprocess_eval(open_image(image), load_model(model).preprocessing).numpy()
    assert np.array_equal(decoded, expected)


def test_lazy_packages_keep_their_public_names():
    """``retrieval.index`` and ``retrieval.data`` import on first use: every name of ``__all__`` is there, and the
    data-set registry is filled by its loader modules even in a fresh process that asks for nothing else."""
    import retrieval.data
    import retrieval.index

    for package in (retrieval.index, retrieval.data):
        missing = [name for name in package.__all__ if getattr(package, name, None) is None]
        assert not missing, f"{package.__name__} lacks {missing}"
        assert set(package.__all__) <= set(dir(package))
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        retrieval.index.nonexistent  # noqa: B018
    script = "from retrieval.data import DATASETS; print(' '.join(DATASETS.names()))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert {"digits", "cub", "emoji"} <= set(result.stdout.split())  # one of builtin, official and emoji each


def test_embedding_actor_on_ray_runs_without_torch(cluster, model):
    """The actor class that Ray Data starts, as a real Ray actor: what its worker process imported, what it returns."""
    from retrieval.data.eval_preprocess import EvalPreprocess
    from retrieval.index.embedding.ray_stages import BatchEmbedder

    actor = ray.remote(num_cpus=1)(BatchEmbedder).remote(str(model), load_model(model).model_hash, 1)
    pixels = np.random.default_rng(2).integers(0, 256, (4, 3, SIZE, SIZE), dtype=np.uint8)  # decode_rows' crops
    batch = {
        "id": np.arange(4), "ok": np.array([True, False, True, True]), "sha256": np.array(["a", "", "c", "d"], object),
        "size": np.array([1, -1, 3, 4]), "error": np.array(["", "truncated", "", ""], object), "pixels": pixels,
    }
    try:
        # a closure run inside the actor's process (Ray's developer method for this): its modules and one batch
        loaded, out = ray.get(
            actor.__ray_call__.remote(
                lambda embedder, rows: (
                    sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "torchvision"))),
                    embedder(rows),
                ),
                batch,
            ),
            timeout=120,
        )
    finally:
        ray.kill(actor)
    assert loaded == [], f"the embedding actor imported {loaded[:5]}"
    assert list(out) == ["id", "ok", "sha256", "size", "error", "embedding", "node"]
    assert set(out["node"]) == {ray.get_runtime_context().get_node_id()}  # the one node of this cluster
    np.testing.assert_array_equal(out["embedding"][1], 0)  # unreadable rows are not embedded
    ok = batch["ok"]
    model_input = EvalPreprocess(load_model(model).preprocessing).normalize(pixels[ok])
    np.testing.assert_allclose(out["embedding"][ok], projection_reference(model, model_input), atol=1e-5)


def _driver(args: list[str]) -> subprocess.Popen:
    """``retrieval index ...`` in its own process (the driver that the kill tests kill)."""
    return subprocess.Popen(
        [sys.executable, "-m", "retrieval", "index", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _build_args(model: Path, folder: Path, out: Path, address: str, *extra: str) -> list[str]:
    return ["build", "--model", str(model), "--images", str(folder), "--out", str(out), "--engine", "ray",
            "--ray-address", address, "--batch-size", "4", "--shard-size", "8", "--json", *extra]


def _wait_for(condition, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the driver ended early: {process.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, "timed out waiting for the driver"
        time.sleep(0.01)


def _kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode == -signal.SIGKILL


def shard_count(out: Path) -> int:
    return len(list((out / "shards").glob("shard-*.parquet"))) if (out / "shards").is_dir() else 0


@pytest.fixture(scope="module")
def big_gallery(tmp_path_factory) -> tuple[Path, list[Path]]:
    folder = tmp_path_factory.mktemp("big") / "images"
    return folder, write_digits(folder, 160)


def test_driver_killed_while_embedding_then_resumed(cluster, model, big_gallery, tmp_path):
    folder, paths = big_gallery
    out = tmp_path / "idx"
    process = _driver(_build_args(model, folder, out, cluster))
    _wait_for(lambda: shard_count(out) >= 2, process)
    _kill(process)
    written = shard_count(out)
    assert 2 <= written < 20 and not (out / "index.faiss").exists()  # killed mid-way through the 20 shards
    summary = build_index(folder, out, model=model, options=ray_options(address=cluster))
    assert summary["indexed"] == 160 and summary["pending"] == 0
    assert_each_indexed_once(out, paths)
    with Catalogue(out / "catalogue.sqlite") as catalogue:  # the resumed run embedded only the rest
        assert json.loads(catalogue.get_meta("throughput"))["ray"]["images"] <= 160 - 8 * (written - 1)


def test_driver_killed_while_building_faiss_then_resumed(cluster, model, big_gallery, tmp_path):
    folder, paths = big_gallery
    out = tmp_path / "idx"
    process = _driver(_build_args(model, folder, out, cluster, "--index-key", "IVF4,Flat"))
    for line in process.stderr:  # the driver says when it starts on faiss; kill it there
        if "building the faiss index" in line:  # a log record: whatever format the CLI gives it
            break
    _kill(process)
    assert not (out / "index.faiss").exists() and shard_count(out) == 20
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        assert catalogue.counts()["pending"] == 0 and catalogue.get_meta("state") == "building"
    summary = build_index(folder, out, model=model, index_key="IVF4,Flat", options=ray_options(address=cluster))
    assert summary["indexed"] == 160 and summary["index_key"] == "IVF4,Flat"
    assert shard_count(out) == 20  # nothing embedded again
    assert_each_indexed_once(out, paths)


def _ray_worker_pids(name: str) -> list[int]:
    """PIDs of this machine's Ray worker processes whose title names ``name`` (e.g. the embedding actor)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.startswith("ray::") and name in title:
                pids.append(int(entry.name))
    return pids


def test_killed_ray_worker_is_replaced_and_nothing_is_lost(cluster, model, big_gallery, tmp_path):
    folder, paths = big_gallery
    out = tmp_path / "idx"
    process = _driver(_build_args(model, folder, out, cluster))
    _wait_for(lambda: shard_count(out) >= 1 and _ray_worker_pids("BatchEmbedder"), process)
    victims = _ray_worker_pids("BatchEmbedder")
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    output, errors = process.communicate(timeout=300)
    assert process.returncode == 0, errors[-3000:]
    assert victims and "worker died" in output + errors  # it did die mid-run, and Ray ran its work again
    summary = json.loads(output[output.index('{\n  "index_dir"'):])  # Ray reports the dead worker on stdout too
    assert summary["indexed"] == 160 and summary["pending"] == 0
    assert_each_indexed_once(out, paths)


def test_ivf_from_shards_trained_on_a_sample_added_per_shard_and_merged(cluster, tmp_path, caplog):
    centres = np.random.default_rng(0).standard_normal((64, 32))
    vectors = clustered_unit_vectors(12_000, 1, centres)
    policy = faiss_keys.AutoPolicy(flat_max=1_000, hnsw_max=2_000, tune_queries=300, max_train=4_000)
    built = {}
    for mode in ("memory", "disk"):
        layout, catalogue, store = write_vector_index(tmp_path / mode, vectors, shard_size=1_500)
        engine = RayEngine(RayOptions(merge_on_disk=mode == "disk"))
        caplog.clear()
        with engine, caplog.at_level(logging.INFO, logger="retrieval.index.embedding.ray_engine"):
            built[mode] = build_faiss(
                layout, catalogue, store, "auto", 32, policy=policy, add_vectors=engine.add_vectors
            )
        where = "on disk" if mode == "disk" else "in memory"
        assert f"12000 vectors added in 8 per-shard Ray tasks and merged ({where})" in caplog.text
        layout.write_info({"model_hash": "m", "embedding_dim": 32, "model_path": None} | built[mode])
        catalogue.set_meta(state="complete")
        catalogue.close()
        assert built[mode]["index_key"].startswith("IVF") and built[mode]["index_key"].endswith(",Flat")
        assert built[mode]["tuning"]["target_met"] and built[mode]["tuning"]["recall_10_at_10"] >= 0.95
        assert "nprobe" in built[mode]["params"]
    assert list((tmp_path / "disk").glob("index-*.ivfdata")) and not list((tmp_path / "memory").glob("*.ivfdata"))
    # held-out queries: the merged index at its tuned nprobe against exact search over every vector
    queries = clustered_unit_vectors(500, 2, centres)
    ids = np.arange(1, len(vectors) + 1)
    _, exact = faiss_measure.exact_knn(queries, [(ids, vectors)], 10)
    for mode in ("memory", "disk"):
        with Index.open(tmp_path / mode) as index:
            assert len(index) == 12_000
            assert isinstance(faiss_params.inner(index.faiss_index), faiss.IndexIVF)
            _, found = index.search_arrays(queries, 10)
        assert faiss_measure.recall_at(found, exact, 10, 10) >= 0.95
        assert index_stats(tmp_path / mode, queries=100)["recall_10_at_10"] >= 0.9


def test_unreachable_address_fails_fast_naming_it(model, gallery, tmp_path):
    folder, _ = gallery
    started = time.monotonic()
    process = _driver(_build_args(model, folder, tmp_path / "idx", "127.0.0.1:9"))
    _, errors = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "127.0.0.1:9" in errors and "ray start --head" in errors
    assert time.monotonic() - started < 60  # interpreter start + one probe (timeout 10 s), not ray's long retry
    assert not (tmp_path / "idx" / "catalogue.sqlite").exists()


def test_without_ray_the_engine_names_the_install_command(model, gallery, tmp_path, monkeypatch):
    folder, _ = gallery
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    result = CliRunner().invoke(index_group, _build_args(model, folder, tmp_path / "idx", "local"))
    assert isinstance(result.exception, RuntimeError)
    assert RAY_INSTALL == 'pip install "ray[data]>=2.40"' and RAY_INSTALL in str(result.exception)


def test_parquet_shards_round_trip_in_one_numbering_with_npz(tmp_path):
    from retrieval.index.catalogue import Outcome

    store = ShardStore(tmp_path)
    store.write(np.array([1]), np.ones((1, 3), np.float32), [Outcome(1, "done", "a", 5)])
    only_errors = [Outcome(2, "error", None, 0, "empty file (0 bytes)")]
    assert store.write_parquet(np.zeros(0, np.int64), np.zeros((0, 3), np.float32), only_errors, {2: "/x/é.png"}) == (
        "shard-000001.parquet"
    )
    vectors = np.arange(6, dtype=np.float32).reshape(2, 3)
    outcomes = [Outcome(4, "done", "b", 7), Outcome(5, "duplicate", "b", 7, duplicate_of=4), Outcome(3, "done", "c", 9)]
    name = store.write_parquet(np.array([3, 4]), vectors, outcomes, {3: "/x/3.png", 4: "/x/4.png", 5: "/x/5.png"})
    assert store.names() == ["shard-000000.npz", "shard-000001.parquet", "shard-000002.parquet"]
    assert name == store.names()[-1]
    empty = store.read("shard-000001.parquet")
    assert empty.ids.shape == (0,) and empty.vectors.shape == (0, 3)
    assert empty.outcomes[0].error == "empty file (0 bytes)"
    shard = store.read(name)
    assert shard.ids.tolist() == [4, 3]  # the rows that hold a vector, in row order, each with its own vector
    np.testing.assert_array_equal(shard.vectors, vectors[[1, 0]])
    assert [(o.id, o.status, o.duplicate_of, o.shard) for o in shard.outcomes] == [
        (4, "done", None, name), (5, "duplicate", 4, name), (3, "done", None, name)
    ]
    assert store.read_ids(name).tolist() == [4, 3] and store.next_name() == "shard-000003.npz"


def test_parquet_manifest_is_listed_like_the_csv_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from retrieval.index import list_gallery

    paths = write_digits(tmp_path / "data", 6)
    rows = [(p.relative_to(tmp_path / "data").as_posix(), p.parent.name, "test" if i % 2 else "train")
            for i, p in enumerate(paths)] + [("", "x", "test")]  # a row without a path: a listing error
    (tmp_path / "data" / "m.csv").write_text("path,label,split\n" + "".join(f"{a},{b},{c}\n" for a, b, c in rows))
    columns = dict(zip(("path", "label", "split"), map(list, zip(*rows, strict=True)), strict=True))
    pq.write_table(pa.table(columns), tmp_path / "data" / "m.parquet")
    for split in (None, "test"):
        from_csv = list_gallery(tmp_path / "data" / "m.csv", split)
        from_parquet = list_gallery(tmp_path / "data" / "m.parquet", split)
        assert from_parquet.items == from_csv.items and len(from_parquet.items) == (6 if split is None else 3)
        assert [e.error.split(" (")[0] for e in from_parquet.errors] == ["the row has no path"]

