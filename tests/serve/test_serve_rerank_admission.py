"""Where re-ranked work runs and what it may hold: a re-ranking that costs more than a search runs in the reranks lane
(never in a search's thread), charged its queries times its method's work units, at most a share of the lane per
client; it stops between queries once its client has gone; one over its memory bound is a 422 before it waits."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from serve_fixtures import BackgroundServer

from retrieval.rerank import RerankConfig, shortlists, work_units
from retrieval.serve.api import create_api
from retrieval.serve.service import SearchService

pytestmark = pytest.mark.timeout(120)
COSTLY = {"method": "kreciprocal", "candidates": 1000, "k1": 100, "k2": 100}


@pytest.fixture(scope="module")
def unwatched_service(artifacts):
    """A service that never checks its folder for a writer's changes: nothing reloads under these tests."""
    opened = SearchService(artifacts.index_dir, reload_interval_s=None)
    yield opened
    opened.close()


def vectors(service: SearchService, count: int) -> list[list[float]]:
    rows = np.random.default_rng(5).normal(size=(count, service.current().dim))
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).tolist()


def costly_batch(service: SearchService, count: int = 8) -> dict:
    return {"queries": [{"embedding": v} for v in vectors(service, count)], "rerank": COSTLY}


@pytest.fixture
def held_reranking(monkeypatch):
    """Each costly re-ranked query (COSTLY's shortlist) waits for ``release`` (set within 30 s); ``started`` is set
    by the first, ``calls`` counts them. Cheaper re-rankings run as they are."""
    release, started, calls = threading.Event(), threading.Event(), []
    real = shortlists.rerank_candidates

    def held(query, candidates, config):
        if config.candidates == COSTLY["candidates"]:
            calls.append(1)
            started.set()
            release.wait(30)
        return real(query, candidates, config)

    monkeypatch.setattr(shortlists, "rerank_candidates", held)
    yield release, started, calls
    release.set()


def post_in_thread(url: str, body: dict, timeout: float = 60) -> tuple[threading.Thread, list]:
    answers: list = []

    def send() -> None:
        try:
            answers.append(httpx.post(url, json=body, timeout=timeout).status_code)
        except httpx.TimeoutException:
            answers.append("hung up")

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, answers


def test_a_costly_re_ranked_batch_never_holds_a_search_thread(unwatched_service, held_reranking):
    """One search thread, taken by a re-ranked batch of embeddings: a plain search waited until the batch ended."""
    release, started, _ = held_reranking
    app = create_api(unwatched_service, concurrency=1)
    with BackgroundServer(app) as running:
        holder, answers = post_in_thread(f"{running.url}/search/batch?k=3", costly_batch(unwatched_service))
        assert started.wait(20)
        lanes = app.state.limits
        assert lanes.reranks.running == 1 and lanes.searches.running == 0
        plain = httpx.post(f"{running.url}/search?k=3", json={"embedding": vectors(unwatched_service, 1)[0]},
                           timeout=10)
        assert plain.status_code == 200 and plain.json()["count"] == 3
        release.set()
        holder.join(30)
    assert answers == [200]


def test_a_request_is_charged_its_queries_times_its_methods_units(unwatched_service, held_reranking):
    release, started, _ = held_reranking
    app = create_api(unwatched_service)
    lane = app.state.limits.reranks
    dim = unwatched_service.current().dim
    per_query = work_units(RerankConfig(**COSTLY), dim)
    with BackgroundServer(app) as running:
        holder, _ = post_in_thread(f"{running.url}/search/batch?k=3", costly_batch(unwatched_service, 8))
        assert started.wait(20)
        assert lane.by_client == {"127.0.0.1": 8 * per_query}
        # a default shortlist costs as a search does: it stays in the searches lane, beside the held batch
        cheap = httpx.post(f"{running.url}/search?k=3&rerank=kreciprocal",
                           json={"embedding": vectors(unwatched_service, 1)[0]}, timeout=10)
        release.set()
        holder.join(30)
    assert cheap.status_code == 200 and cheap.json()["rerank"]["method"] == "kreciprocal"


def test_one_client_may_hold_only_its_share_of_the_reranks_lane(unwatched_service, held_reranking):
    release, started, _ = held_reranking
    app = create_api(unwatched_service)
    lane = app.state.limits.reranks
    per_query = work_units(RerankConfig(**COSTLY), unwatched_service.current().dim)
    lane.max_per_client = 10 * per_query  # a share of ten costly queries
    with BackgroundServer(app) as running:
        url = f"{running.url}/search/batch?k=3"
        first, first_answer = post_in_thread(url, costly_batch(unwatched_service, 16))  # over the share: alone
        assert started.wait(20)
        refused = httpx.post(url, json=costly_batch(unwatched_service, 1), timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        assert "the limit per client is" in refused.json()["detail"], refused.text
        plain = httpx.post(f"{running.url}/search?k=3", json={"embedding": vectors(unwatched_service, 1)[0]},
                           timeout=10)
        assert plain.status_code == 200
        release.set()
        first.join(30)
        assert first_answer == [200] and lane.by_client == {}
        assert httpx.post(url, json=costly_batch(unwatched_service, 1), timeout=30).status_code == 200


def test_a_re_ranked_batch_stops_between_queries_once_its_client_has_gone(unwatched_service, monkeypatch):
    """8 queries of ~0.4 s each, the client gone after 1 s: before, all 8 were re-ranked for nobody."""
    calls = []
    real = shortlists.rerank_candidates

    def slow(query, candidates, config):
        calls.append(1)
        time.sleep(0.4)
        return real(query, candidates, config)

    monkeypatch.setattr(shortlists, "rerank_candidates", slow)
    app = create_api(unwatched_service)
    with BackgroundServer(app) as running:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{running.url}/search/batch?k=3", json=costly_batch(unwatched_service, 8), timeout=1)
        deadline = time.monotonic() + 10
        while app.state.limits.reranks.running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert app.state.limits.reranks.running == 0
    assert len(calls) < 5, len(calls)
    assert app.state.limits.reranks.dropped == 1


def test_a_re_ranking_over_its_memory_bound_is_a_422_before_it_waits(unwatched_service, monkeypatch):
    monkeypatch.setattr(shortlists, "MAX_QUERY_BYTES", 2**20)
    app = create_api(unwatched_service)
    with BackgroundServer(app) as running:
        for route, body in [("/search", {"embedding": vectors(unwatched_service, 1)[0], "rerank": COSTLY}),
                            ("/search/batch", costly_batch(unwatched_service, 2))]:
            answer = httpx.post(f"{running.url}{route}?k=3", json=body, timeout=10)
            assert answer.status_code == 422, answer.text
            assert "per query (the limit is 1 MiB); ask for at most" in answer.json()["detail"]
    assert app.state.limits.reranks.by_client == {} and app.state.limits.reranks.dropped == 0


def test_an_image_batch_re_ranked_at_cost_stays_in_the_batches_lane(unwatched_service, held_reranking):
    """Its images are decoded and embedded in the batches lane, which bounds how many decode at once; moving it to
    the reranks lane would have let two image batches decode side by side."""
    import base64
    import io

    from PIL import Image

    release, started, _ = held_reranking
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), (200, 30, 90)).save(buffer, format="PNG")
    body = {"queries": [{"image": base64.b64encode(buffer.getvalue()).decode()}] * 2, "rerank": COSTLY}
    app = create_api(unwatched_service)
    lanes = app.state.limits
    with BackgroundServer(app) as running:
        holder, answers = post_in_thread(f"{running.url}/search/batch?k=3", body)
        assert started.wait(20)
        assert lanes.batches.running == 1 and lanes.reranks.running == 0
        release.set()
        holder.join(30)
    assert answers == [200]
