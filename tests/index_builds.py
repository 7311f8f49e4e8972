"""Building indexes in the index tests: quick ingest options, a copied gallery, the check that each image is
indexed once, an index folder written straight from vectors, an input folder of a build from embeddings, and the real
CLI with the fake model in a subprocess that the kill tests can pause (this file is that subprocess's script)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from embedders import FakeEmbedder

from retrieval.index import Catalogue, Index, IngestOptions
from retrieval.index.catalogue import Outcome
from retrieval.index.faiss_backend.faiss_params import index_ids
from retrieval.index.layout import IndexLayout
from retrieval.index.shards import ShardStore
from retrieval.index.sources import GalleryItem

QUICK = IngestOptions(batch_size=8, workers=0, shard_size=8, progress=False)
TESTS = Path(__file__).parent


def copy_gallery(digits, tmp_path: Path) -> tuple[Path, list[Path]]:
    """A test's own copy of a module's ``digits`` gallery (folder, paths), for tests that change or break files."""
    folder, paths = digits
    shutil.copytree(folder, tmp_path / "gallery")
    return tmp_path / "gallery", [tmp_path / "gallery" / p.relative_to(folder) for p in paths]


def assert_each_indexed_once(index_dir: Path, expected_paths: list[Path]) -> None:
    """Every readable image is in the catalogue as done, once in the shards and once in faiss."""
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.ids_with_status("done")
        assert catalogue.counts()["pending"] == 0
        rows = catalogue.rows(done)
    assert sorted(r["path"] for r in rows.values()) == sorted(str(p.resolve()) for p in expected_paths)
    shard_ids = np.concatenate([s.ids for s in ShardStore(index_dir / "shards")])
    assert len(shard_ids) == len(set(shard_ids.tolist())) == len(done)
    with Index.open(index_dir) as index:
        ids = index_ids(index.faiss_index)
    assert sorted(ids.tolist()) == sorted(done)


def clustered_unit_vectors(n: int, seed: int, centres: np.ndarray) -> np.ndarray:
    """``n`` unit vectors scattered around ``centres`` (rows): clustered, as real embeddings are."""
    rng = np.random.default_rng(seed)
    x = centres[rng.integers(0, len(centres), n)] + 0.35 * rng.standard_normal((n, centres.shape[1]))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def write_vector_index(
    root, vectors: np.ndarray, shard_size: int = 1000
) -> tuple[IndexLayout, Catalogue, ShardStore]:
    """An index folder whose catalogue and shards hold ``vectors`` (no images needed)."""
    layout = IndexLayout(root)
    layout.root.mkdir(parents=True, exist_ok=True)
    catalogue = Catalogue(layout.catalogue)
    catalogue.plan([GalleryItem(f"/v/{i}.png", None) for i in range(len(vectors))])
    store = ShardStore(layout.shards)
    for start in range(0, len(vectors), shard_size):
        ids = np.arange(start + 1, min(start + shard_size, len(vectors)) + 1)  # SQLite ids start at 1
        outcomes = [Outcome(int(i), "done", f"sha{i}", 1) for i in ids]
        name = store.write(ids, vectors[ids - 1], outcomes)
        catalogue.record([dataclasses.replace(o, shard=name) for o in outcomes])
    return layout, catalogue, store


def write_embeddings_folder(
    root: Path, parts: list[np.ndarray], metadata: list[dict[str, list]] | None = None, folder: str = "embeddings"
) -> Path:
    """An input folder of ``index build --embeddings``: each of ``parts`` saved as it is (``np.save``) in
    ``root/<folder>/``, and, given ``metadata`` (one {column: values} per part), ``root/metadata/`` parquet parts.
    ``folder`` "embeddings" names the files as ``index export --format npy`` does (``part-00000.npy``), "img_emb" as
    clip-retrieval does (``img_emb_0.npy`` beside ``metadata_0.parquet``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    clip = folder == "img_emb"
    (root / folder).mkdir(parents=True, exist_ok=True)
    for number, vectors in enumerate(parts):
        np.save(root / folder / (f"img_emb_{number}.npy" if clip else f"part-{number:05d}.npy"), vectors)
    for number, columns in enumerate(metadata or []):
        (root / "metadata").mkdir(exist_ok=True)
        name = f"metadata_{number}.parquet" if clip else f"part-{number:05d}.parquet"
        pq.write_table(pa.table(columns), root / "metadata" / name)
    return root


# The kill tests' pause points: "after_shard_write:N" stops the build once its N-th shard file is in place but
# before its rows are recorded; "after_commit:N" once those rows are recorded too.
PAUSE_ENV = "RETRIEVAL_INDEX_TEST_PAUSE"
PAUSED = "RETRIEVAL_INDEX_PAUSED"  # printed to stderr when the build has stopped there


def pause_build_at(point: str) -> None:
    """Wrap the writer's two durable steps (``ShardStore.write``, ``Catalogue.record``) in this process so that
    the build stops at ``point``, printing ``PAUSED`` and sleeping until the test kills it."""
    step, number = point.split(":")
    written: list[str] = []  # the shards this process wrote, in order
    write, record = ShardStore.write, Catalogue.record

    def stop() -> None:
        print(f"{PAUSED} {point}", file=sys.stderr, flush=True)
        time.sleep(600)

    def write_then_pause(self, ids, vectors, outcomes):
        name = write(self, ids, vectors, outcomes)
        written.append(name)
        if step == "after_shard_write" and len(written) == int(number):
            stop()
        return name

    def record_then_pause(self, outcomes):
        outcomes = list(outcomes)
        record(self, outcomes)
        if step == "after_commit" and len(written) == int(number) and any(o.shard == written[-1] for o in outcomes):
            stop()

    ShardStore.write, Catalogue.record = write_then_pause, record_then_pause


def run_cli_with_fake(args: list[str]) -> None:
    """Entry point of the subprocess used by the kill tests: the real CLI with the fake model (and the pause
    point named by ``PAUSE_ENV``, if any)."""
    import retrieval.index.writing.writer as writer
    from retrieval.cli.index import index_group

    writer.load_model = lambda path, providers="auto": FakeEmbedder()
    if os.environ.get(PAUSE_ENV):
        pause_build_at(os.environ[PAUSE_ENV])
    index_group.main(args, prog_name="retrieval index")


def run_fake_cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    """``retrieval index ARGS`` with the fake model, in a subprocess the test may kill (see ``run_cli_with_fake``)."""
    return subprocess.Popen(
        [sys.executable, str(TESTS / "index_builds.py"), *args],
        cwd=TESTS.parent,
        env={**os.environ, "PYTHONPATH": str(TESTS.parent), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


if __name__ == "__main__":
    run_cli_with_fake(sys.argv[1:])


WRITER_MODULES = ("retrieval.index.writing.writer", "retrieval.index.writing.records", "retrieval.index.writing.repair")


def load_models_as(monkeypatch, loader) -> None:
    """Every index writer gets ``loader(path, ...)``'s embedder where it would load an ONNX file (a build loads the
    given model, an add or repair the recorded one: each in its own module)."""
    for module in WRITER_MODULES:
        monkeypatch.setattr(f"{module}.load_model", loader)
