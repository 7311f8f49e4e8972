"""Index files written by someone who can write the index folder: a forged vector count in index.faiss, a sparse
1 GiB index.json, a FIFO in place of writer.lock. Each is refused quickly, with a message that names the fix, and
without costing what it declares; a server does not retry unchanged files, and no read blocks."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
import pytest
from fastapi.testclient import TestClient

from retrieval.index.faiss_backend import faiss_files, faiss_keys
from retrieval.index.layout import IndexLayout, IndexLockedError
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
HEADER = 37  # faiss' index header: fourcc, d, ntotal, two unused int64, is_trained, metric
FORGED = 2**22  # vectors: 1 GiB of float32 at d = 64


@pytest.fixture
def index_dir(artifacts, tmp_path) -> Path:
    copy = tmp_path / "index"
    shutil.copytree(artifacts.index_dir, copy)
    return copy


def forge_flat(path: Path, count: int = FORGED) -> None:
    """Declare ``count`` vectors in an IDMap2,Flat index.faiss: both headers and the count of its floats."""
    data = bytearray(path.read_bytes())
    assert data[:4] == b"IxM2" and data[HEADER : HEADER + 4] == b"IxFI"
    (d,) = struct.unpack_from("<i", data, 4)
    struct.pack_into("<q", data, 8, count)
    struct.pack_into("<q", data, HEADER + 8, count)
    struct.pack_into("<Q", data, 2 * HEADER, count * d)
    path.write_bytes(bytes(data))


def returns_within(call: Callable[[], object], seconds: float = 5.0) -> object:
    """``call()`` in a thread; fails this test (in its own thread) if it has not returned within ``seconds``."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001  (handed to the test's thread)
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{call} blocked for more than {seconds} s"
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome.get("value")


# --- a forged vector count in index.faiss ----------------------------------------------------------------------
def test_a_forged_flat_count_is_refused_before_faiss_reads_the_file(index_dir, monkeypatch):
    forge_flat(index_dir / "index.faiss")

    def read_index(*args: object) -> None:
        raise AssertionError("faiss.read_index was called on a file that declares more than it holds")

    monkeypatch.setattr(faiss, "read_index", read_index)
    started = time.monotonic()
    with pytest.raises(faiss_files.DamagedIndexFileError, match=r"declares 4194304 vectors.*--rebuild"):
        faiss_files.read_index(index_dir / "index.faiss")
    assert time.monotonic() - started < 1


def test_a_forged_count_costs_no_large_allocation(tmp_path):
    """In a fresh process (its peak memory is its own): the file that made faiss allocate 1 GiB is refused at a
    small peak."""
    # VmHWM: this process's peak resident memory (ru_maxrss would carry pytest's own peak over the fork)
    code = f"""
import re, struct, faiss, numpy as np
from retrieval.index.faiss_backend import faiss_files, faiss_keys
index = faiss_keys.new_index("Flat", 64)
index.add_with_ids(np.random.rand(50, 64).astype("float32"), np.arange(50))
faiss.write_index(index, "index.faiss")
data = bytearray(open("index.faiss", "rb").read())
struct.pack_into("<q", data, 8, {FORGED}); struct.pack_into("<q", data, {HEADER + 8}, {FORGED})
struct.pack_into("<Q", data, {2 * HEADER}, {FORGED * 64})
open("index.faiss", "wb").write(data)
try:
    faiss_files.read_index("index.faiss")
except RuntimeError as exc:
    peak_kib = re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)
    print(type(exc).__name__, int(peak_kib) // 1024)
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    kind, peak_mib = result.stdout.split()
    assert kind == "DamagedIndexFileError" and int(peak_mib) < 512, result.stdout + result.stderr


@pytest.mark.parametrize("key", ["HNSW8", "IVF4,Flat", "OPQ4_16,IVF4,PQ4x4np"])
def test_a_forged_count_of_another_kind_is_bounded_by_the_file_size(tmp_path, key):
    """Every vector's id takes 8 bytes of index.faiss, in an IDMap2 or in an IVF index's lists (alone or behind a
    rotation): a count beyond size / 8 is refused."""
    index = faiss_keys.new_index(key, 16)
    vectors = np.random.default_rng(0).random((400, 16), dtype=np.float32)  # OPQ trains 256 centroids
    index.train(vectors)
    index.add_with_ids(vectors[:20], np.arange(20))
    path = tmp_path / "index.faiss"
    faiss.write_index(index, str(path))
    faiss_files.read_index(path)  # the real one opens
    data = bytearray(path.read_bytes())
    struct.pack_into("<q", data, 8, 2**40)
    struct.pack_into("<q", data, HEADER + 8, 2**40)
    path.write_bytes(bytes(data))
    with pytest.raises(faiss_files.DamagedIndexFileError, match="ids alone"):
        faiss_files.read_index(path)


def test_a_server_keeps_serving_and_logs_a_forged_index_once(index_dir, caplog):
    service = SearchService(index_dir, reload_interval_s=None)
    try:
        vectors = len(service)
        forge_flat(index_dir / "index.faiss")
        with caplog.at_level(logging.WARNING, logger="retrieval.index.live"):
            assert service.reload() is False and service.reload() is False
        assert len(service) == vectors
        assert len(caplog.records) == 1 and "--rebuild" in caplog.records[0].getMessage()
    finally:
        service.close()


# --- a sparse 1 GiB index.json ---------------------------------------------------------------------------------
def test_a_huge_index_json_is_refused_without_reading_it_whole(index_dir):
    info = index_dir / "index.json"
    with open(info, "r+b") as handle:
        handle.truncate(2**30)  # sparse: no disk, but 1 GiB to whoever reads it
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"larger than 4 MiB.*retrieval index repair"):
            IndexLayout(index_dir).read_info()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 32 * 2**20


def test_files_that_failed_to_open_are_tried_again_only_once_they_change(index_dir, monkeypatch):
    """Unchanged files fail the same way at a high cost (a damaged index.faiss, a huge index.json): however long
    ago they failed, they are not opened again until a writer changes the folder."""
    import retrieval.index.live as live

    service = SearchService(index_dir, reload_interval_s=None)
    opens: list[int] = []
    open_state = service.live._open
    service.live._open = lambda previous: (opens.append(1), open_state(previous))[1]
    info = index_dir / "index.json"
    saved = info.read_bytes()
    try:
        with open(info, "r+b") as handle:
            handle.truncate(2**30)
        assert service.reload() is False and len(opens) == 1
        later = time.monotonic() + 3600.0
        monkeypatch.setattr(live.time, "monotonic", lambda: later)
        assert service.reload() is False and len(opens) == 1  # an hour on: still not reopened
        monkeypatch.undo()
        info.write_bytes(saved)  # a writer replaces it: a new identity
        assert service.reload() is True and len(opens) == 2
    finally:
        service.close()


# --- a FIFO in place of writer.lock ----------------------------------------------------------------------------
@pytest.fixture
def fifo_lock(index_dir):
    """writer.lock replaced by a FIFO; whatever is still blocked on it is released at the end."""
    lock = index_dir / "writer.lock"
    lock.unlink(missing_ok=True)
    os.mkfifo(lock)
    yield lock
    try:  # a reader blocked in open() (the old code) returns once a writer opens the FIFO
        os.close(os.open(lock, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def test_probing_a_fifo_writer_lock_does_not_block(index_dir, fifo_lock):
    holder = returns_within(IndexLayout(index_dir).writer)
    assert isinstance(holder, dict) and "not a regular file" in holder["problem"]


def test_a_server_neither_blocks_nor_swaps_while_writer_lock_is_a_fifo(index_dir, fifo_lock):
    """A reload probes the lock: it counts as held (nothing is opened) and returns at once; /stats, /health and
    /items answer meanwhile, after a killed writer too."""
    service = SearchService(index_dir, reload_interval_s=None)
    try:
        with sqlite3.connect(index_dir / "catalogue.sqlite") as db:  # a killed writer's rows
            shard = db.execute("SELECT shard FROM images WHERE status = 'done'").fetchone()[0]
            db.execute("INSERT INTO images(path, status, shard) VALUES ('/elsewhere/x.png', 'done', ?)", (shard,))
        os.utime(index_dir / "index.json")  # a new identity: the reload gets as far as probing the lock
        assert returns_within(service.reload) is False
        with TestClient(create_api(service), raise_server_exceptions=False) as client:
            for path in ("/stats", "/health", f"/items/{int(service.current().index.ids[0])}"):
                response = returns_within(lambda path=path: client.get(path), 30)
                assert response.status_code == 200, (path, response.text)
    finally:
        service.close()


def test_a_writer_refuses_a_fifo_lock_at_once(index_dir, fifo_lock):
    def take() -> None:
        with IndexLayout(index_dir).write_lock("add images to"):
            pass

    with pytest.raises(IndexLockedError, match="not a regular file"):
        returns_within(take)
