"""A served state answers from itself: while `retrieval index add` runs, or after a writer was killed mid-run (its
catalogue rows changed, index.faiss and index.json not replaced), filtered searches, /stats and item lookups use
the ids and rows of the state being served; what still cannot be answered is a 503 that says why, logged once."""

from __future__ import annotations

import logging
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sample_images import encode_png

from retrieval.index.filters import parse_filter
from retrieval.index.search import Index
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService
from retrieval.serve.service.state import ServedIndex

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def index_dir(artifacts, tmp_path) -> Path:
    """A private copy of the shared index, for the writers (and the tests) to change."""
    copy = tmp_path / "index"
    shutil.copytree(artifacts.index_dir, copy)
    return copy


@pytest.fixture
def served(index_dir):
    """A service over the copy that never reloads by itself, and an API client that shows a 500 as a 500."""
    service = SearchService(index_dir, reload_interval_s=None)
    with TestClient(create_api(service), raise_server_exceptions=False) as client:
        yield service, client
    service.close()


def killed_writer_rows(index_dir: Path, count: int = 3) -> list[int]:
    """What `index add` killed -9 after recording its shard leaves: new catalogue rows marked indexed (their
    vectors in a shard), index.faiss and index.json not replaced. Returns the new ids."""
    with sqlite3.connect(index_dir / "catalogue.sqlite") as db:
        shard, first = db.execute("SELECT shard, MAX(id) + 1 FROM images WHERE status = 'done'").fetchone()
        ids = list(range(first, first + count))
        db.executemany("INSERT INTO images(id, path, label, status, shard, sha256) VALUES (?, ?, ?, 'done', ?, ?)",
                       [(i, f"/elsewhere/new-{i}.png", "new", shard, f"{i:064x}") for i in ids])
    return ids


def embedding_of(service: SearchService) -> list[float]:
    return np.random.default_rng(3).standard_normal(service.current().dim).astype(np.float32).tolist()


def test_a_filtered_search_answers_from_the_served_ids_after_a_killed_writer(served, index_dir):
    """The filter is built from the served ids alone: rows a writer marked indexed since are not among them."""
    service, client = served
    held = set(service.current().index.ids.tolist())
    new = killed_writer_rows(index_dir)
    for where in ("id >= 0", 'label = "new"', f"id = {new[0]}"):
        response = client.post("/search", json={"embedding": embedding_of(service), "k": 5, "where": where})
        assert response.status_code == 200, response.text
        assert {r["id"] for r in response.json()["results"]} <= held
    assert client.post("/search", json={"embedding": embedding_of(service), "where": 'label = "new"'}
                       ).json()["count"] == 0


def test_stats_and_items_answer_from_the_served_state_after_a_killed_writer(served, index_dir):
    """/stats counts the served vectors (no re-open of the folder, which is inconsistent now); an item the
    writer added is not served, an item the state holds is."""
    service, client = served
    vectors = len(service)
    new = killed_writer_rows(index_dir)
    response = client.get("/stats")
    assert response.status_code == 200, response.text
    stats = response.json()["index"]
    assert stats["vectors"] == vectors and stats["queries"] > 0 and 0 <= stats["recall_1_at_1"] <= 1
    assert client.get(f"/items/{new[0]}").status_code == 404
    assert client.get(f"/items/{int(service.current().index.ids[0])}").status_code == 200


def test_a_state_held_across_a_real_writer_answers_filtered_searches(artifacts, index_dir, tmp_path):
    """A request holding the state from before `retrieval index add` filters over that state's rows: the new
    image (indexed by the writer meanwhile) is not among its results, and nothing fails."""
    service = SearchService(index_dir, reload_interval_s=None)
    folder = tmp_path / "new" / "fresh"
    folder.mkdir(parents=True)
    pixels = np.random.default_rng(24).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    (folder / "noise.png").write_bytes(encode_png(Image.fromarray(pixels)))
    try:
        with service.live.acquire() as old:
            command = [sys.executable, "-m", "retrieval", "index", "add", str(index_dir), "--images",
                       str(folder.parent), "--workers", "0"]
            result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
            assert result.returncode == 0, result.stderr[-2000:]
            vector = np.asarray(embedding_of(service), np.float32)[None]
            found = old.search(vector, 5, where=parse_filter("id >= 0"))[0]
            assert len(found) == 5 and {r.id for r in found} <= set(old.index.ids.tolist())
            assert old.index_stats()["vectors"] == len(old)
        assert service.reload() is True and len(service) == len(old) + 1
    finally:
        service.close()


def test_what_a_state_cannot_answer_is_a_503_logged_once(served, index_dir, caplog):
    """A served image whose vector the catalogue no longer records (removed and planned again by a writer that
    was killed) leaves /stats unanswerable from this state: a 503 that says why, one warning per state."""
    service, client = served
    gone = int(service.current().index.ids[0])
    with sqlite3.connect(index_dir / "catalogue.sqlite") as db:
        db.execute("UPDATE images SET status = 'pending', shard = NULL WHERE id = ?", (gone,))
    with caplog.at_level(logging.WARNING):
        first, second = client.get("/stats"), client.get("/stats")
    for response in (first, second):
        assert response.status_code == 503, response.text
        detail = response.json()["detail"]
        assert "repair" in detail and str(index_dir) not in detail
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "cannot answer" in r.getMessage()]
    assert len(warnings) == 1
    response = client.post("/search", json={"embedding": embedding_of(service), "k": 3, "where": "id >= 0"})
    assert response.status_code == 200, response.text  # searches still answer from the state's own ids


def test_a_plain_index_filters_only_the_ids_its_faiss_part_holds(index_dir):
    """The CLI's Index (opened once, not live) leaves out rows a writer indexed after it was opened."""
    with Index.open(index_dir) as index:
        new = killed_writer_rows(index_dir)
        vector = np.random.default_rng(0).standard_normal(index.dim).astype(np.float32)
        assert not set(index.matching_ids("id >= 0").tolist()) & set(new)
        assert len(index.search(vector, 4, where="id >= 0")[0]) == 4


def test_stats_answer_from_one_state_when_a_reload_swaps_it_mid_request(served, artifacts, monkeypatch):
    """A reload between two reads of one /stats request (the index's summary, then the model's counters) leaves
    the answer one state's: the counters are those of the model of the state the summary describes."""
    service, client = served
    first = service.current()
    service.search(artifacts.query_paths[0].read_bytes(), 1)  # the first state's model has answered a query
    fresh = service._open_state(None)  # a state with a model (and micro-batcher) of its own: no calls yet
    summarise = ServedIndex.index_stats

    def summarise_then_reload(state: ServedIndex) -> dict:
        summary = summarise(state)
        if state is first and service.live.current is first:
            service.live._swap(fresh)  # what a reload does, between this read and the request's next one
        return summary

    monkeypatch.setattr(ServedIndex, "index_stats", summarise_then_reload)
    response = client.get("/stats")
    assert response.status_code == 200, response.text
    assert service.live.current is fresh  # the reload did happen mid-request
    assert first.model.batcher.stats()["model_calls"] >= 1 and fresh.model.batcher.stats()["model_calls"] == 0
    assert response.json()["batcher"] == first.model.batcher.stats()
