"""A running server follows its index's writers: after ``retrieval index add/remove`` it serves
the new state within seconds, each request from one state (old or new, never a mix), and none fails meanwhile.

The writers are the real CLI, run as separate processes on a copy of the shared test index.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sample_images import encode_png
from serve_fixtures import BackgroundServer

from retrieval.index import remove_images
from retrieval.serve.api import create_api
from retrieval.serve.server import ServerConfig, build_app
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
SWAP_DEADLINE_S = 15.0  # the watcher polls every second: a swap shows well within this


def copy_index(artifacts, tmp_path: Path) -> Path:
    """A private copy of the shared index, for the writers to change."""
    index_dir = tmp_path / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    return index_dir


def new_image(tmp_path: Path) -> tuple[Path, bytes]:
    """A folder holding one image unlike the gallery's (noise), and the image file's bytes."""
    pixels = np.random.default_rng(24).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    data = encode_png(Image.fromarray(pixels))
    path = tmp_path / "new" / "fresh" / "noise.png"
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return path.parent.parent, data


def run_writer(*args: str | Path) -> None:
    """``retrieval index ARGS`` in its own process (a real writer: it takes the folder's lock)."""
    command = [sys.executable, "-m", "retrieval", "index", *map(str, args)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]


def wait_for(condition: Callable[[], bool], what: str, deadline_s: float = SWAP_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {deadline_s} s in vain for {what}"
        time.sleep(0.1)


def search(client, data: bytes, k: int, exclude_self: bool = False) -> dict:
    flag = "&exclude_self=true" if exclude_self else ""
    response = client.post(f"/search?k={k}{flag}", files={"image": ("q.png", data, "image/png")})
    assert response.status_code == 200, response.text
    return response.json()


def ids_of(response: dict) -> list[int]:
    return [r["id"] for r in response["results"]]


def vectors(client) -> int:
    return client.get("/health").json()["vectors"]


@pytest.fixture
def served(artifacts, tmp_path):
    """A copy of the index, a service over it with its watcher, and an API client."""
    index_dir = copy_index(artifacts, tmp_path)
    service = SearchService(index_dir)
    with TestClient(create_api(service)) as client:
        yield index_dir, service, client
    service.close()


# --- a writer's change reaches a running server --------------------------------------------------------
def test_an_added_image_is_served_once_the_writer_finishes(artifacts, served, tmp_path):
    """/health counts the new image, and a search with its bytes names it as query_item and finds it first."""
    index_dir, _, client = served
    folder, data = new_image(tmp_path)
    before = vectors(client)
    assert search(client, data, 3)["query_item"] is None
    run_writer("add", index_dir, "--images", folder, "--workers", "0")
    wait_for(lambda: vectors(client) == before + 1, "the server to count the added image")
    found = search(client, data, 3)
    item = found["query_item"]
    root = json.loads((Path(index_dir) / "index.json").read_text())["gallery_root"]
    shown = os.path.relpath((folder / "fresh" / "noise.png").resolve(), root)  # added from outside: walks up
    assert item is not None and item["path"] == shown and shown.startswith("../")
    assert ids_of(found)[0] == item["id"] and found["results"][0]["score"] == pytest.approx(1, abs=1e-4)
    excluded = search(client, data, 3, exclude_self=True)
    assert excluded["excluded_self"] and excluded["count"] == 3 and item["id"] not in ids_of(excluded)
    assert ids_of(excluded) == ids_of(search(client, data, 4))[1:]
    assert client.get(f"/items/{item['id']}").json()["path"] == shown
    stats = client.get("/stats").json()
    assert stats["service"]["vectors"] == before + 1 and stats["index"]["vectors"] == before + 1


def test_removing_the_top_hits_still_gives_k_results(artifacts, served):
    """After `index remove` of a query's top-2, a k=2 search returns 2 results, neither of them removed."""
    index_dir, _, client = served
    data = artifacts.query_paths[0].read_bytes()
    before = vectors(client)
    top = ids_of(search(client, data, 2, exclude_self=True))
    run_writer("remove", index_dir, "--ids", ",".join(map(str, top)))
    wait_for(lambda: vectors(client) == before - 2, "the server to drop the removed images")
    after = search(client, data, 2, exclude_self=True)
    assert after["count"] == 2 and not set(ids_of(after)) & set(top)
    assert all(client.get(f"/items/{i}").status_code == 404 for i in top)


# --- one state per request -----------------------------------------------------------------------------
def test_a_request_keeps_the_state_it_took_across_a_swap(artifacts, tmp_path):
    """A state taken before a swap answers as the index was (k results, the removed items among them) and is
    closed only after it is let go; requests after the swap see the new state."""
    index_dir = copy_index(artifacts, tmp_path)
    service = SearchService(index_dir, reload_interval_s=None)
    service.live.grace_s = 0  # close a replaced state as soon as nobody holds it
    data = artifacts.query_paths[0].read_bytes()
    try:
        with service.live.acquire() as old:
            first = service.search(data, 2, exclude_self=True)
            top = [r.id for r in first.results]
            remove_images(index_dir, ids=top)
            assert service.search(data, 2, exclude_self=True).results == first.results  # not yet reloaded
            assert service.reload() is True and service.live.current is not old
            embedding = old.index.faiss_index.reconstruct(first.query_item.id)
            assert [r.id for r in old.index.search(embedding, 2, [first.query_item.id])[0]] == top
            assert old.query_item(data).id == first.query_item.id
            fresh = service.search(data, 2, exclude_self=True)
            assert len(fresh.results) == 2 and not {r.id for r in fresh.results} & set(top)
            assert len(service) == len(old) - 2 and service.item(top[0]) is None
        assert service.reload() is False  # nothing new; it closes the state let go
        with pytest.raises(sqlite3.ProgrammingError):
            old.index.catalogue.rows(top)
    finally:
        service.close()


def test_a_broken_or_busy_folder_keeps_the_old_state(artifacts, tmp_path, caplog):
    """A corrupt index.faiss is logged once and not served; while a writer holds the lock nothing is opened;
    once the folder is whole again the new state is swapped in."""
    index_dir = copy_index(artifacts, tmp_path)
    service = SearchService(index_dir, reload_interval_s=None)
    data = artifacts.query_paths[0].read_bytes()
    expected = [r.id for r in service.search(data, 3).results]
    faiss_file = index_dir / "index.faiss"
    saved = faiss_file.read_bytes()
    try:
        with caplog.at_level(logging.WARNING, logger="retrieval.index.live"):
            faiss_file.write_bytes(b"not a faiss index")
            assert service.reload() is False and service.reload() is False
            assert [r.id for r in service.search(data, 3).results] == expected
        assert len(caplog.records) == 1 and "still serving the previous one" in caplog.records[0].getMessage()
        with holding_writer_lock(index_dir):
            faiss_file.write_bytes(saved)
            assert service.reload() is False
        assert service.reload() is True and [r.id for r in service.search(data, 3).results] == expected
    finally:
        service.close()


@contextlib.contextmanager
def holding_writer_lock(index_dir: Path) -> Iterator[None]:
    """Another process holds the folder's writer lock for the block, as a running `retrieval index add` would."""
    code = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(index_dir / "writer.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.kill()
        holder.wait(10)


def reversed_head_model(source: Path, out: Path) -> Path:
    """Another model (another model_hash): the source with its embedding dimensions in reverse order."""
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(source))
    for init in proto.graph.initializer:
        if init.name == "head.linear.weight":
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init)[::-1].copy(), init.name))
    onnx.save(proto, str(out))
    return out


def test_an_index_built_with_another_model_is_searched_with_that_model(artifacts, tmp_path):
    """The served folder (a symlink, swapped to an index of another model, blue/green) is reloaded with that
    model and its own batcher; the old model's batcher stops once its state is let go."""
    from retrieval.index import IngestOptions, build_index

    model = reversed_head_model(artifacts.model, tmp_path / "other.onnx")
    build_index(artifacts.gallery, tmp_path / "green", model=model,
                options=IngestOptions(batch_size=16, workers=0, progress=False))
    served = tmp_path / "served"
    served.symlink_to(copy_index(artifacts, tmp_path), target_is_directory=True)
    service = SearchService(served, reload_interval_s=None)
    service.live.grace_s = 0
    data = artifacts.query_paths[5].read_bytes()
    try:
        blue = service.current().model
        assert service.search(data, 1).results[0].score == pytest.approx(1, abs=1e-4)
        (tmp_path / "next").symlink_to(tmp_path / "green", target_is_directory=True)
        os.replace(tmp_path / "next", served)
        assert service.reload() is True
        assert service.current().embedder.model_hash != blue.embedder.model_hash and service.current().model is not blue
        found = service.search(data, 1)
        assert found.results[0].id == found.query_item.id and found.results[0].score == pytest.approx(1, abs=1e-4)
        with pytest.raises(RuntimeError, match="closed"):
            blue.batcher.run(np.zeros((1, 3, 64, 64), np.float32))
    finally:
        service.close()


def test_the_live_view_is_read_side_only():
    """retrieval.index.live (imported by servers) pulls in neither the writers nor torch."""
    writer = {f"retrieval.index.{name}" for name in ("writer", "ingest", "engines", "faiss_build", "mend")}
    code = f"import sys, retrieval.index.live; print(sorted(set({sorted(writer | {'torch'})!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


# --- under load ----------------------------------------------------------------------------------------
K = 5
CLIENTS = 3
PAUSE_S = 0.02  # between a client's requests: a bounded load, leaving the writers CPU on a 2-core machine
MAX_REQUESTS = 1000  # per client: a bound in case the writers hang


def test_no_request_fails_or_mixes_states_while_writers_run(artifacts, tmp_path):
    """Clients on loopback search the new image's bytes with k=K while `index add` then `index remove` run:
    every request succeeds with K results, each exactly the answer of the state before the add, between the
    two writers, or after the remove (ids and query_item together)."""
    index_dir = copy_index(artifacts, tmp_path)
    folder, data = new_image(tmp_path)
    app, service = build_app(ServerConfig(index_dir=index_dir, ui=False))
    responses: list[tuple[int, dict | str]] = []
    stop = threading.Event()

    def answer(body: dict) -> tuple[frozenset[int], int | None]:
        return frozenset(ids_of(body)), body["query_item"]["id"] if body["query_item"] else None

    try:
        with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:

            def load() -> None:
                with httpx.Client(base_url=server.url, timeout=60) as own:
                    for _ in range(MAX_REQUESTS):
                        if stop.is_set():
                            return
                        try:
                            r = own.post(f"/search?k={K}", files={"image": ("q.png", data, "image/png")})
                            responses.append((r.status_code, r.json() if r.status_code == 200 else r.text))
                        except Exception as exc:  # noqa: BLE001  (any failure is recorded, and fails the test)
                            responses.append((0, repr(exc)))
                        time.sleep(PAUSE_S)

            before = vectors(client)
            states = [answer(search(client, data, K))]
            threads = [threading.Thread(target=load) for _ in range(CLIENTS)]
            for thread in threads:
                thread.start()
            run_writer("add", index_dir, "--images", folder, "--workers", "0")
            wait_for(lambda: vectors(client) == before + 1, "the server to count the added image")
            added = search(client, data, K)
            states.append(answer(added))
            neighbours = ids_of(added)[1:3]  # the new image's nearest others
            run_writer("remove", index_dir, "--ids", ",".join(map(str, neighbours)))
            wait_for(lambda: vectors(client) == before - 1, "the server to drop the removed images")
            states.append(answer(search(client, data, K)))
            swapped = len(responses)  # each client finishes at most one request it sent before the swap
            wait_for(lambda: len(responses) >= swapped + 2 * CLIENTS, "requests after the last swap")
            stop.set()
            for thread in threads:
                thread.join(60)
    finally:
        stop.set()
        service.close()
    failed = [(status, body) for status, body in responses if status != 200]
    assert not failed, failed[:3]
    assert all(body["count"] == K for _, body in responses)
    new_id = states[1][1]
    assert states[0][1] is None and new_id is not None and states[2][1] == new_id
    assert new_id in states[1][0] and not set(neighbours) & states[2][0]
    seen = [answer(body) for _, body in responses]
    mixed = [s for s in seen if s not in states]
    assert not mixed, f"{len(mixed)} of {len(seen)} responses match no state of the index, e.g. {mixed[0]}"
    assert {states.index(s) for s in seen} == {0, 1, 2}  # the swaps happened under load
