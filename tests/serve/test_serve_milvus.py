"""Serving from a Milvus collection: `retrieval index push` then two servers on one collection (a Milvus Lite gRPC
server in its own process, reached over HTTP as a cluster is) answer alike; a removal pushed by `retrieval index
remove --milvus` shows in both at their next request; an alias moved to another collection is swapped in by each
within its reload interval; the command line refuses half a Milvus address."""

from __future__ import annotations

import shutil
import time

import numpy as np
import pytest
from click.testing import CliRunner

pytest.importorskip("milvus_lite")

from milvus_server import milvus_lite_server  # noqa: E402

from retrieval.cli.main import main  # noqa: E402
from retrieval.index.milvus.milvus_collection import MilvusPlace, connect  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def milvus_server(tmp_path_factory):
    """A Milvus Lite server process: the Milvus gRPC API on a loopback port, as a cluster serves it."""
    with milvus_lite_server(tmp_path_factory.mktemp("lite")) as uri:
        yield uri


@pytest.fixture(scope="module")
def pushed(milvus_server, artifacts, tmp_path_factory):
    """A copy of the served test index pushed by the command line into the server's collection ``gallery``."""
    index_dir = tmp_path_factory.mktemp("pushed") / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    result = CliRunner().invoke(main, ["index", "push", str(index_dir), "--milvus", milvus_server, "--collection",
                                       "gallery", "--index-type", "FLAT"])
    assert result.exit_code == 0, result.output
    assert "rows" in result.output and "next: retrieval serve --milvus" in result.output
    return index_dir


def services(uri: str, count: int = 2) -> list:
    from retrieval.serve.service import SearchService

    return [SearchService("unused", milvus=MilvusPlace.checked(uri, "gallery"), reload_interval_s=0.2)
            for _ in range(count)]


def test_two_servers_on_one_collection_answer_alike_and_see_a_removal_at_once(milvus_server, pushed, artifacts):
    first, second = services(milvus_server)
    try:
        query = artifacts.query_paths[0].read_bytes()
        before = [[r.id for r in s.search(query, 5).results] for s in (first, second)]
        assert before[0] == before[1] and len(before[0]) == 5
        removed = before[0][1]
        result = CliRunner().invoke(main, ["index", "remove", str(pushed), "--ids", str(removed), "--milvus",
                                           milvus_server, "--collection", "gallery"])
        assert result.exit_code == 0, result.output
        assert "1 deleted" in result.output
        for service in (first, second):  # the next request, no reload needed: searches read the collection
            found = [r.id for r in service.search(query, 5).results]
            assert removed not in found and found[0] == before[0][0] and len(found) == 5
            assert len(service) == len(artifacts.labels) - 1
    finally:
        first.close()
        second.close()


def test_an_alias_moved_to_another_collection_is_swapped_in_by_each_server(milvus_server, pushed, tmp_path):
    from retrieval.index.milvus.milvus_push import push_index

    first, second = services(milvus_server)
    try:
        other = push_index(pushed, MilvusPlace.checked(milvus_server, "candidate"), index_type="HNSW",
                           progress=False)
        client = connect(MilvusPlace.checked(milvus_server, "gallery"))
        generations = [first.generation, second.generation]
        client.alter_alias(other["physical"], "gallery")
        client.close()
        deadline = time.monotonic() + 10
        while (first.generation == generations[0] or second.generation == generations[1]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.generation > generations[0] and second.generation > generations[1]
        assert all(s.current().index.record.index_type == "HNSW" for s in (first, second))
        vector = np.ones(first.current().dim, np.float32)
        assert [r.id for r in first.search(vector, 3).results] == [r.id for r in second.search(vector, 3).results]
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("args", [["--milvus", "x.db"], ["--collection", "gallery"]])
def test_serve_refuses_half_a_milvus_address(args):
    result = CliRunner().invoke(main, ["serve", *args])
    assert result.exit_code != 0 and "--milvus URI and --collection NAME go together" in result.output


def test_push_refuses_a_bad_address_before_reading_the_index(artifacts):
    result = CliRunner().invoke(main, ["index", "push", str(artifacts.index_dir), "--milvus", "ftp://x",
                                       "--collection", "gallery"])
    assert result.exit_code != 0 and "neither a server URL nor a Milvus Lite file" in result.output


def test_a_watcher_that_cannot_reach_the_server_keeps_the_state_and_opens_nothing(tmp_path, caplog):
    """The server's watcher cannot tell an unreachable Milvus' collection: it opens no new state (the one it holds
    keeps serving, its searches answering 503 until Milvus is back), and logs nothing a tick."""
    from retrieval.index.live import LiveIndex
    from retrieval.index.milvus.milvus_index import watch_identity

    identity = watch_identity(MilvusPlace.checked("http://127.0.0.1:9", "gallery"))  # nothing listens there
    assert identity() is None

    class State:
        identity = ("gallery__x", "hash")

        def __len__(self) -> int:
            return 1

        def close(self) -> None:
            pass

    opened: list[State] = []
    live = LiveIndex(tmp_path, lambda previous: opened.append(State()) or opened[-1], None, identity=identity)
    with caplog.at_level("WARNING"):
        assert not live.reload() and not live.reload()
    assert len(opened) == 1 and live.current is opened[0]
    assert not [r for r in caplog.records if "cannot reload" in r.getMessage()]
    live.close()
