"""``retrieval index build --engine ray --milvus URI --collection NAME`` on a real local Ray cluster and a real Milvus
Lite server process: the Ray actors write the vectors straight into the collection, which then holds exactly the
rows a local build pushed would hold and serves the local Flat index's top 10; an interrupted build resumed never
holds a row twice; exact copies are left out; the folder points the commands that need local vectors at the
collection; a Milvus Lite file is refused.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import numpy as np
import pytest

pytest.importorskip("milvus_lite")
pytest.importorskip("ray")

import ray  # noqa: E402
from click.testing import CliRunner  # noqa: E402
from embedders import write_projection_onnx  # noqa: E402
from milvus_server import milvus_lite_server  # noqa: E402

from retrieval.cli.main import main  # noqa: E402
from retrieval.data.synthetic import write_digits  # noqa: E402
from retrieval.index import Catalogue, Index, IngestOptions, build_index, load_model  # noqa: E402
from retrieval.index.embedding.engine import RayOptions  # noqa: E402
from retrieval.index.embedding.ray_collection import CollectionIngestor  # noqa: E402
from retrieval.index.layout import VectorsInMilvusError  # noqa: E402
from retrieval.index.milvus.milvus_collection import (  # noqa: E402
    COMPLETE,
    ID,
    LABEL,
    PATH,
    SHA256,
    SIZE,
    VECTOR,
    MilvusError,
    MilvusPlace,
    connect,
    read_record,
)
from retrieval.index.milvus.milvus_index import MilvusIndex  # noqa: E402
from retrieval.index.milvus.milvus_push import physical_name, push_index  # noqa: E402
from retrieval.index.search import public_path  # noqa: E402

pytestmark = pytest.mark.timeout(240)
FIELDS = [ID, VECTOR, PATH, LABEL, SHA256, SIZE]


@pytest.fixture(scope="module")
def cluster():
    """A real Ray cluster on this machine for the module."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with milvus_lite_server(tmp_path_factory.mktemp("lite")) as uri:
        yield uri


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_projection_onnx(tmp_path_factory.mktemp("model") / "projection.onnx")


@pytest.fixture(scope="module")
def gallery(tmp_path_factory) -> Path:
    """40 digits in class folders, one exact copy of an earlier one, and one unreadable file."""
    folder = tmp_path_factory.mktemp("gallery") / "images"
    paths = write_digits(folder, 40)
    (folder / "9").mkdir(exist_ok=True)
    (folder / "9" / "zz-copy.png").write_bytes(paths[3].read_bytes())
    (folder / "9" / "zz-broken.png").write_bytes(b"not an image")
    return folder


def ray_options() -> IngestOptions:
    return IngestOptions(batch_size=8, shard_size=16, progress=False, engine="ray", ray=RayOptions())


def collection_rows(uri: str, name: str) -> list[dict]:
    """Every row the collection (or alias) ``name`` holds, ids repeated as Milvus holds them."""
    client = connect(MilvusPlace.checked(uri, name))
    try:
        return client.query(name, filter=f"{ID} >= 0", output_fields=FIELDS, limit=16384)
    finally:
        client.close()


@pytest.fixture(scope="module")
def built(cluster, server, model, gallery, tmp_path_factory):
    """The gallery built locally and pushed (``local``), and built by the Ray engine into a collection."""
    root = tmp_path_factory.mktemp("built")
    local = build_index(gallery, root / "local", model=model, index_key="Flat",
                        options=IngestOptions(batch_size=8, shard_size=16, workers=1, progress=False))
    push_index(root / "local", MilvusPlace.checked(server, "pushed"), index_type="FLAT", progress=False)
    result = CliRunner().invoke(main, [
        "index", "build", "--model", str(model), "--images", str(gallery), "--out", str(root / "ray"), "--engine",
        "ray", "--batch-size", "8", "--shard-size", "16", "--milvus", server, "--collection", "gallery",
        "--index-type", "FLAT", "--json"])
    assert result.exit_code == 0, result.output
    return root, local, json.loads(result.stdout)


def test_the_collection_holds_the_rows_a_local_build_pushed_would(built, server):
    root, local, summary = built
    assert summary["indexed"] == local["indexed"] == 40
    assert summary["duplicates"] == local["duplicates"] == 1 and summary["errors"] == local["errors"] == 1
    pushed = {row[ID]: row for row in collection_rows(server, "pushed")}
    written = collection_rows(server, "gallery")
    assert len(written) == len({row[ID] for row in written}) == len(pushed) == 40  # one row per image, no copy
    for row in written:
        wanted = pushed[row[ID]]
        assert [row[f] for f in (PATH, LABEL, SHA256, SIZE)] == [wanted[f] for f in (PATH, LABEL, SHA256, SIZE)]
        np.testing.assert_allclose(row[VECTOR], wanted[VECTOR], atol=1e-5)
    client = connect(MilvusPlace.checked(server, "gallery"))
    try:
        assert read_record(client, "gallery").state == COMPLETE
        assert client.describe_collection("gallery")["collection_name"] == physical_name("gallery",
                                                                                          local_hash(root))
    finally:
        client.close()


def local_hash(root: Path) -> str:
    return json.loads((root / "local" / "index.json").read_text())["model_hash"]


def test_the_collection_serves_the_local_flat_indexs_top_ten(built, server, model, gallery):
    root, *_ = built
    queries = load_model(model).embed(sorted(gallery.rglob("*.png"))[:12])
    with Index.open(root / "local") as flat, MilvusIndex(MilvusPlace.checked(server, "gallery")) as served:
        got, wanted = served.search(queries, 10), flat.search(queries, 10)
        assert [[r.id for r in row] for row in got] == [[r.id for r in row] for row in wanted]
        assert [[r.path for r in row] for row in got] == [[flat.public_path(r.path) for r in row] for row in wanted]


def test_the_folder_holds_the_catalogue_and_points_local_readers_at_the_collection(built, server):
    root, *_ = built
    folder = root / "ray"
    assert not (folder / "index.faiss").exists() and not any((folder / "shards").glob("shard-*"))
    info = json.loads((folder / "index.json").read_text())
    assert info["vectors_in"]["collection"] == "gallery" and info["vectors_in"]["milvus"] == server
    with Catalogue(folder / "catalogue.sqlite") as catalogue:
        assert catalogue.counts()["pending"] == 0 and len(catalogue.ids_with_status("done")) == 40
    with pytest.raises(VectorsInMilvusError, match="retrieval serve --milvus"):
        Index.open(folder)
    result = CliRunner().invoke(main, ["index", "stats", str(folder)])
    assert result.exit_code != 0 and "keeps its vectors in the Milvus collection gallery" in result.output


def test_an_interrupted_build_resumes_without_writing_a_row_twice(cluster, server, model, gallery, tmp_path,
                                                                   monkeypatch):
    taken = CollectionIngestor._take_embedded
    calls = {"n": 0}

    def dies_on_the_third_batch(self, batch):  # rows written by then, and some never recorded
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed")
        taken(self, batch)

    monkeypatch.setattr(CollectionIngestor, "_take_embedded", dies_on_the_third_batch)
    place = MilvusPlace.checked(server, "resumed")
    with pytest.raises(KeyboardInterrupt):
        build_index(gallery, tmp_path / "ray", model=model, options=ray_options(), milvus=place)
    with Catalogue(tmp_path / "ray" / "catalogue.sqlite") as catalogue:
        pending = catalogue.counts()["pending"]
    written = collection_rows(server, physical_name("resumed", load_model(model).model_hash))
    assert 0 < pending < 42 and len(written) > 42 - pending  # rows in the collection the catalogue does not know
    client = connect(place)
    assert not client.has_collection("resumed")  # the name is created only once the build is complete
    client.close()

    monkeypatch.setattr(CollectionIngestor, "_take_embedded", taken)
    summary = build_index(gallery, tmp_path / "ray", model=model, options=ray_options(), milvus=place)
    assert summary["indexed"] == 40 and summary["duplicates"] == 1
    rows = collection_rows(server, "resumed")
    assert len(rows) == len({row[ID] for row in rows}) == 40
    assert len({row[SHA256] for row in rows}) == 40  # the copy written before the kill was deleted


@pytest.mark.parametrize(("args", "says"), [
    (["--engine", "ray", "--milvus", "{tmp}/gallery.db", "--collection", "g"], "only one process can open"),
    (["--milvus", "http://127.0.0.1:1", "--collection", "g"], "--engine is local, and a build writes into a Milvus"),
    (["--engine", "ray", "--milvus", "http://127.0.0.1:1"], "together"),
    (["--engine", "ray", "--milvus", "http://127.0.0.1:1", "--collection", "g", "--index-key", "Flat"],
     "--index-key shape the folder's faiss index"),
])
def test_the_command_line_refuses_a_build_it_cannot_write_before_any_work(model, gallery, tmp_path, args, says):
    result = CliRunner().invoke(main, ["index", "build", "--model", str(model), "--images", str(gallery), "--out",
                                       str(tmp_path / "out"), *[a.format(tmp=tmp_path) for a in args]])
    assert result.exit_code != 0 and says in result.output
    assert not (tmp_path / "out").exists() and not (tmp_path / "gallery.db").exists()


def test_a_milvus_lite_file_or_the_local_engine_is_refused_before_any_work(model, gallery, tmp_path):
    with pytest.raises(MilvusError, match="only one process can open"):
        build_index(gallery, tmp_path / "a", model=model, options=ray_options(),
                    milvus=MilvusPlace.checked(str(tmp_path / "gallery.db"), "gallery"))
    with pytest.raises(MilvusError, match="with the ray engine only"):
        build_index(gallery, tmp_path / "b", model=model, milvus=MilvusPlace.checked("http://127.0.0.1:1", "g"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "gallery.db").exists()


def test_a_collection_of_another_model_is_refused_naming_both_hashes(built, server, gallery, tmp_path):
    root, *_ = built
    other = write_projection_onnx(tmp_path / "other.onnx", seed=7)
    with pytest.raises(MilvusError) as refused:
        build_index(gallery, tmp_path / "other", model=other, options=ray_options(),
                    milvus=MilvusPlace.checked(server, "gallery"))
    assert load_model(other).model_hash in str(refused.value) and local_hash(root) in str(refused.value)


def test_add_and_remove_write_the_collection_of_an_index_built_into_it(built, server, model, tmp_path):
    root, *_ = built
    folder, place = root / "ray", MilvusPlace.checked(server, "gallery")
    sync = ["--milvus", server, "--collection", "gallery"]
    with MilvusIndex(place) as served:
        removed = int(served.ids[5])
    result = CliRunner().invoke(main, ["index", "remove", str(folder), "--ids", str(removed), *sync])
    assert result.exit_code == 0, result.output
    assert "written there by the command itself" in result.output
    extra = write_digits(tmp_path / "extra", 4, start=900)
    refused = CliRunner().invoke(main, ["index", "add", str(folder), "--images", str(tmp_path / "extra"), *sync])
    assert refused.exit_code != 0 and "--engine is local" in refused.output
    result = CliRunner().invoke(main, ["index", "add", str(folder), "--images", str(tmp_path / "extra"), "--engine",
                                       "ray", "--batch-size", "4", *sync])
    assert result.exit_code == 0, result.output
    rows = collection_rows(server, "gallery")
    assert len(rows) == len({row[ID] for row in rows}) == 40 - 1 + 4 and removed not in {row[ID] for row in rows}
    with MilvusIndex(place) as served:
        hit = served.search(load_model(model).embed(extra[:1]), 1)[0][0]
    assert hit.path == public_path(str(extra[0].resolve()), gallery_root(folder))  # outside the gallery: ../
    other = CliRunner().invoke(main, ["index", "push", str(folder), "--milvus", server, "--collection", "elsewhere"])
    assert other.exit_code != 0 and "cannot be sent to another collection" in other.output


def gallery_root(folder: Path) -> PurePosixPath:
    return PurePosixPath(json.loads((folder / "index.json").read_text())["gallery_root"])
