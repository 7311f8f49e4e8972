"""A served Milvus collection through Milvus' faults and hostile rows (a Milvus Lite server in its own process,
stopped and started again on the same port and data, as a restart is): searches answer 503 with Retry-After while
Milvus is down, logged once per outage, and 200 again by themselves once it is back, its collection released by the
restart and loaded again; /health says whether search works; filters Milvus cannot carry are 422; rows whose path
names no file or leaves the gallery through a symlinked folder are never served; credentials in the URI are
refused without being echoed; two pushes at once leave one copy of every row; an add whose manifest brings a column
the collection lacks is refused before anything is written."""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

pytest.importorskip("milvus_lite")

from milvus_server import LiteServer  # noqa: E402

from retrieval.cli.main import main  # noqa: E402
from retrieval.index.filters import Both, Compare, Either, Filter, FilterError  # noqa: E402
from retrieval.index.milvus.milvus_collection import (  # noqa: E402
    MAX_EXPRESSION_DEPTH,
    MilvusError,
    MilvusPlace,
    connect,
    milvus_filter,
)
from retrieval.index.milvus.milvus_index import MilvusIndex  # noqa: E402
from retrieval.index.milvus.milvus_push import physical_name, push_index  # noqa: E402
from retrieval.serve.api import create_api  # noqa: E402
from retrieval.serve.service import SearchService  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def lite(tmp_path_factory):
    """A Milvus Lite server process that a test may stop and start again (left running after each test)."""
    server = LiteServer(tmp_path_factory.mktemp("lite"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pushed(lite, artifacts, tmp_path_factory):
    """The served test index, copied and pushed into the server's collection ``gallery`` (FLAT)."""
    index_dir = tmp_path_factory.mktemp("pushed") / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    push_index(index_dir, MilvusPlace.checked(lite.uri, "gallery"), index_type="FLAT", progress=False)
    return index_dir


def embedding_body(dim: int, **extra) -> dict:
    return {"embedding": np.ones(dim).tolist(), "k": 3, **extra}


def wait_for(condition, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.3)
    return False


def test_searches_answer_503_while_milvus_is_down_and_recover_by_themselves_after_a_restart(lite, pushed, caplog):
    service = SearchService("unused", milvus=MilvusPlace.checked(lite.uri, "gallery"), reload_interval_s=0.2)
    try:
        with TestClient(create_api(service)) as client:
            dim = service.current().dim
            assert client.post("/search", json=embedding_body(dim)).status_code == 200
            caplog.clear()
            caplog.set_level(logging.INFO)
            lite.stop()
            answers = [client.post("/search", json=embedding_body(dim)) for _ in range(20)]
            health = client.get("/health")
            for answer in [*answers, health]:
                assert answer.status_code == 503, answer.text
                assert "Milvus" in answer.json()["detail"] and int(answer.headers["Retry-After"]) >= 1
            outages = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
            assert len(outages) == 1  # one line for the outage, not one per request
            assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]

            lite.start()  # the same data on the same port: the collection comes back released
            raw = connect(MilvusPlace.checked(lite.uri, "gallery"))
            assert str(raw.get_load_state(physical_name("gallery", service.current().index.model_hash))["state"]) \
                != "Loaded"
            raw.close()
            assert wait_for(lambda: client.post("/search", json=embedding_body(dim)).status_code == 200)
            assert client.get("/health").status_code == 200
            assert [r for r in caplog.records if "is back after" in r.getMessage()]
    finally:
        service.close()


def test_a_server_started_on_a_released_collection_loads_it_and_answers(lite, pushed):
    lite.stop()
    lite.start()
    service = SearchService("unused", milvus=MilvusPlace.checked(lite.uri, "gallery"), reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            assert client.get("/health").status_code == 200
            found = client.post("/search", json=embedding_body(service.current().dim))
            assert found.status_code == 200 and len(found.json()["results"]) == 3
    finally:
        service.close()


def test_a_long_and_chain_chooses_the_rows_the_local_index_chooses(lite, pushed):
    from retrieval.index import Index

    where = " and ".join(f"id != {i}" for i in range(2, 162, 2))  # 80 terms, every other row left
    with Index.open(pushed) as local, MilvusIndex(MilvusPlace.checked(lite.uri, "gallery")) as remote:
        np.testing.assert_array_equal(remote.matching_ids(where), local.matching_ids(where))
        assert len(remote.search(np.ones(remote.dim, np.float32), 5, where=where)[0]) == 5


def test_a_filter_nested_past_milvus_bound_is_refused_naming_it(lite, pushed):
    node = Compare("id", ">=", 0.0)
    for level in range(MAX_EXPRESSION_DEPTH // 2 + 1):  # alternating connectives: each nests two parentheses
        node = (Both if level % 2 else Either)(node, Compare("id", "!=", float(level)))
    with MilvusIndex(MilvusPlace.checked(lite.uri, "gallery")) as remote:
        with pytest.raises(FilterError, match=f"at most {MAX_EXPRESSION_DEPTH}"):
            milvus_filter(Filter("nested", node), remote.record)


def test_a_lone_surrogate_in_a_filter_is_a_422_not_a_500(lite, pushed):
    service = SearchService("unused", milvus=MilvusPlace.checked(lite.uri, "gallery"), reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            vector = ",".join(["1.0"] * service.current().dim)
            body = '{"embedding": [' + vector + '], "k": 3, "where": "label = \\"\\ud800\\""}'
            answer = client.post("/search", content=body, headers={"content-type": "application/json"})
            assert answer.status_code == 422 and "surrogate" in answer.json()["detail"]
    finally:
        service.close()


def test_rows_naming_no_file_or_leaving_the_gallery_by_a_symlink_are_not_served(lite, pushed, artifacts, tmp_path):
    gallery, outside = tmp_path / "gallery", tmp_path / "outside"
    gallery.mkdir()
    outside.mkdir()
    shutil.copy(artifacts.query_paths[0], gallery / "real.png")
    shutil.copy(artifacts.query_paths[0], outside / "secret.png")
    (gallery / "linked").symlink_to(outside, target_is_directory=True)
    place = MilvusPlace.checked(lite.uri, "hostile")
    push_index(pushed, place, index_type="FLAT", progress=False)
    client = connect(place)
    physical = client.describe_collection("hostile")["collection_name"]
    template = client.query(physical, filter="id >= 0", limit=1, output_fields=["*"])[0]
    rows = {900001: "real.png", 900002: "linked/secret.png", 900003: "a\x00b.png"}
    client.upsert(physical, [{**template, "id": i, "path": path} for i, path in rows.items()])
    client.close()
    service = SearchService("unused", milvus=place, gallery_root=gallery, reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as api:
            assert api.get("/items/900001/image").status_code == 200  # the route serves what is inside
            assert api.get("/items/900002/image").status_code == 404
            assert api.get("/items/900003/image").status_code == 404
    finally:
        service.close()


def test_credentials_in_the_uri_are_refused_without_being_echoed():
    with pytest.raises(MilvusError, match="RETRIEVAL_MILVUS_TOKEN") as refused:
        MilvusPlace.checked("http://admin:hunter2@milvus:19530", "gallery")
    assert "hunter2" not in str(refused.value)
    result = CliRunner().invoke(main, ["serve", "--milvus", "http://admin:hunter2@127.0.0.1:9", "--collection",
                                       "gallery", "--no-ui"])
    assert result.exit_code != 0 and "hunter2" not in result.output and "credentials" in result.output


def test_two_pushes_at_once_leave_one_copy_of_every_row(lite, pushed, artifacts):
    place = MilvusPlace.checked(lite.uri, "race")
    start, outcomes = threading.Barrier(2), []

    def push() -> None:
        start.wait()
        try:
            outcomes.append(push_index(pushed, place, index_type="FLAT", progress=False))
        except MilvusError as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=push) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(outcomes) == 2 and any(isinstance(o, dict) for o in outcomes)
    for refused in (o for o in outcomes if isinstance(o, MilvusError)):
        assert "another `retrieval index push`" in str(refused)
    client = connect(place)
    ids = [row["id"] for row in client.query("race", filter="id >= 0", output_fields=["id"], limit=16384)]
    client.close()
    assert len(ids) == len(set(ids)) == len(artifacts.labels)
    again = push_index(pushed, place, progress=False)  # the loser's command, run again, finds nothing to send
    assert again["sent"] == 0


def catalogued(index_dir) -> list[tuple]:
    """Every catalogue row's id, path, status and metadata."""
    import sqlite3

    with sqlite3.connect(f"file:{index_dir / 'catalogue.sqlite'}?mode=ro", uri=True) as db:
        return db.execute("SELECT i.id, i.path, i.status, m.data FROM images i LEFT JOIN metadata m ON m.id = i.id "
                          "ORDER BY i.id").fetchall()


def test_an_add_bringing_a_column_the_collection_lacks_is_refused_before_anything_is_written(lite, pushed,
                                                                                             artifacts, tmp_path):
    index_dir = tmp_path / "index"
    shutil.copytree(pushed, index_dir)
    place = MilvusPlace.checked(lite.uri, "columns")
    push_index(index_dir, place, index_type="FLAT", progress=False)
    new = tmp_path / "new"
    new.mkdir()
    for n, source in enumerate(artifacts.query_paths[:2]):
        shutil.copy(source, new / f"extra_{n}.png")
    (new / "manifest.csv").write_text("path,label,colour\nextra_0.png,a,red\nextra_1.png,b,green\n")
    info = json.loads((index_dir / "index.json").read_text())
    rows = catalogued(index_dir)
    result = CliRunner().invoke(main, ["index", "add", str(index_dir), "--images", str(new / "manifest.csv"),
                                       "--milvus", lite.uri, "--collection", "columns"])
    assert result.exit_code != 0
    assert "'colour'" in result.output and "Nothing was written" in result.output, result.output
    assert json.loads((index_dir / "index.json").read_text()) == info and catalogued(index_dir) == rows
    assert push_index(index_dir, place, progress=False)["sent"] == 0  # the collection is still kept in step
