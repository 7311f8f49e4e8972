"""``retrieval.client`` against a live `retrieval serve` (a subprocess on a loopback port, with an API token and a
text model, shared by the module): each search form finds what the server's own JSON answer says, with filters,
re-ranking and exclude_self; batches one answer per query; items and their files; health and stats; the server's
4xx message, 401, 404 and 503 with Retry-After as exceptions; a server that is not there named with the fix; mistakes
caught before any request; and the client loading nothing of the server or torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Event
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from serve_fixtures import QUERY_PNG, REPO, BackgroundServer, first_health, free_port

from retrieval.client import (
    AuthenticationError,
    BatchQueryError,
    InvalidRequestError,
    NotFoundError,
    QueryFailure,
    RetrievalClient,
    RetrievalConnectionError,
    RetrievalError,
    RetrievalTimeoutError,
    SearchResults,
    ServiceUnavailableError,
)
from retrieval.errors import ParameterError

pytestmark = pytest.mark.timeout(300)

TOKEN = "client-test-token-0123456789"  # the server's --token-file holds it
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def url(artifacts, tmp_path_factory):
    """`retrieval serve --no-ui` over the shared index with a small text tower and an API token, on a free port."""
    from text_towers import small_text_model

    root = tmp_path_factory.mktemp("client")
    model_hash = json.loads((artifacts.index_dir / "index.json").read_text())["model_hash"]
    tower = small_text_model(root / "text.onnx", model_hash, 32)
    token_file = root / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "retrieval", "serve", "--index", str(artifacts.index_dir), "--no-ui", "--port",
         str(port), "--reload-interval", "0", "--text-model", str(tower), "--token-file", str(token_file)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"http://127.0.0.1:{port}"
    try:
        assert first_health(address, process).status_code == 200
        yield address
    finally:
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=60)


@pytest.fixture(scope="module")
def remote(url):
    with RetrievalClient(url, api_key=TOKEN, timeout=60) as opened:
        yield opened


def server_json(url: str, path: str = "/search", **kwargs) -> dict:
    """The server's own JSON answer, by plain httpx."""
    response = httpx.post(url + path, headers=AUTH, timeout=60, **kwargs)
    assert response.status_code == 200, response.text
    return response.json()


def ids(answer: dict) -> list[int]:
    return [hit["id"] for hit in answer["results"]]


def a_vector(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(32).astype(np.float32)  # the fixture's model: 32 dimensions


def test_each_search_form_finds_what_the_server_answers(remote, url, artifacts):
    query = artifacts.query_paths[3]
    expected = server_json(url, params={"k": 5}, files={"image": ("q.png", query.read_bytes(), "image/png")})
    for results in (remote.search(image=query, k=5), remote.search(image=str(query), k=5),
                    remote.search(image=query.read_bytes(), k=5)):
        assert isinstance(results, SearchResults) and results.ids == ids(expected)
        assert [hit.score for hit in results] == pytest.approx([hit["score"] for hit in expected["results"]])
        assert results.query_item is not None and results.query_item.id == expected["query_item"]["id"]
    first = results[0]
    assert (first.path, first.name, first.label, first.image_url) == tuple(
        expected["results"][0][key] for key in ("path", "name", "label", "image_url"))
    assert first.rerank_score is None and results.rerank is None and results.raw["k"] == 5

    vector = a_vector()
    expected = server_json(url, json={"embedding": vector.tolist(), "k": 4})
    assert remote.search(embedding=vector, k=4).ids == ids(expected)
    assert remote.search(embedding=vector.tolist(), k=4).ids == ids(expected)

    expected = server_json(url, json={"text": "a red apple", "k": 4})
    by_text = remote.search(text="a red apple", k=4)
    assert by_text.ids == ids(expected) and by_text.query_item is None and "embed_ms" in by_text.timing


def test_filters_exclude_self_and_reranking_reach_the_server(remote, url, artifacts):
    label = artifacts.labels[4]
    where = f'label = "{label}"'
    filtered = remote.search(embedding=a_vector(1), k=3, where=where)
    assert filtered.ids == ids(server_json(url, json={"embedding": a_vector(1).tolist(), "k": 3, "where": where}))
    assert filtered.hits and {hit.label for hit in filtered} == {label}

    query = artifacts.query_paths[0]
    alone = remote.search(image=query, k=3, exclude_self=True)
    assert alone.excluded_self and alone.query_item is not None and alone.query_item.id not in alone.ids

    reranked = remote.search(image=query, k=4, rerank="qe")
    assert reranked.rerank is not None and reranked.rerank.method == "qe"
    assert all(hit.rerank_score is not None for hit in reranked)
    chosen = {"method": "kreciprocal", "candidates": 20, "k1": 5, "k2": 2}
    kreciprocal = remote.search(text="a smiling face", k=4, rerank=chosen)
    assert kreciprocal.rerank.params == {"candidates": 20, "k1": 5, "k2": 2, "lambda_value": 0.3}
    assert kreciprocal.ids == ids(server_json(url, json={"text": "a smiling face", "k": 4, "rerank": chosen}))


def test_a_batch_answers_each_query_in_order(remote, artifacts):
    paths = artifacts.query_paths[:2]
    answers = remote.search_batch([paths[0], paths[1].read_bytes(), {"embedding": a_vector(2)},
                                   {"text": "a dog"}, {"image": str(paths[1])}], k=3)
    assert [len(answer) for answer in answers] == [3, 3, 3, 3, 3]
    assert answers[0].ids == remote.search(image=paths[0], k=3).ids
    assert answers[1].ids == answers[4].ids == remote.search(image=paths[1], k=3).ids
    assert answers[2].ids == remote.search(embedding=a_vector(2), k=3).ids
    assert answers[3].ids == remote.search(text="a dog", k=3).ids
    assert answers[0].timing["batch_size"] == 3  # the three images embedded in one model call

    label = artifacts.labels[0]
    rows = remote.search_batch(list(np.stack([a_vector(3), a_vector(4)])), k=2, where=f'label = "{label}"')
    assert len(rows) == 2 and all({hit.label for hit in answer} == {label} for answer in rows)


def test_a_batch_query_the_server_cannot_read_is_named_or_kept_in_place(remote):
    queries = [QUERY_PNG, b"not an image at all", {"embedding": a_vector()}]
    with pytest.raises(BatchQueryError) as raised:
        remote.search_batch(queries, k=2)
    error = raised.value
    assert error.position == 1 and error.status == 400 and "queries[1]: " in str(error)
    assert isinstance(error.results[0], SearchResults) and isinstance(error.results[1], QueryFailure)
    kept = remote.search_batch(queries, k=2, raise_on_error=False)
    assert [type(entry) for entry in kept] == [SearchResults, QueryFailure, SearchResults]
    assert kept[1].error == error.results[1].error and kept[1].position == 1 and kept[1].status == 400


def test_items_and_their_files(remote, url, artifacts):
    hit = remote.search(image=artifacts.query_paths[2], k=1)[0]
    item = remote.item(hit.id)
    assert item.raw == httpx.get(f"{url}/items/{hit.id}", headers=AUTH, timeout=30).json()
    assert (item.id, item.path, item.label, item.image_url) == (hit.id, hit.path, hit.label, hit.image_url)
    assert remote.item_image(hit.id) == artifacts.query_paths[2].read_bytes() and item.size == len(
        remote.item_image(hit.id))
    with pytest.raises(NotFoundError, match="no indexed image with id '999999'") as raised:
        remote.item(999_999)
    assert raised.value.status == 404


def test_health_and_stats(remote, artifacts):
    health = remote.health()
    assert (health.status, health.vectors, health.embedding_dim) == ("ok", len(artifacts.query_paths), 32)
    stats = remote.stats()
    assert stats.text_search and stats.limits.max_batch_queries == 64 and stats.index["vectors"] == health.vectors


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"embedding": [1.0, 2.0, 3.0]}, "3"),  # the server names the dimension it needs
    ({"embedding": a_vector(), "k": 1001}, "k"),
    ({"text": "a red apple", "where": "label = "}, "where"),
    ({"text": "a red apple", "rerank": "no-such-method"}, "rerank"),
])
def test_the_servers_message_reaches_the_exception(remote, url, kwargs, message):
    with pytest.raises(InvalidRequestError) as raised:
        remote.search(**kwargs)
    body = {key: value.tolist() if isinstance(value, np.ndarray) else value for key, value in kwargs.items()}
    detail = httpx.post(f"{url}/search", json=body, headers=AUTH, timeout=30).json()["detail"]
    error = raised.value
    assert error.status == 422 and error.message == detail and message in detail
    assert str(error) == f"HTTP 422: {detail}" and error.request_id


def test_a_server_with_a_token_refuses_a_client_without_it(url):
    with RetrievalClient(url) as anonymous:
        assert anonymous.health().status == "ok"  # /health is open
        with pytest.raises(AuthenticationError, match="Authorization: Bearer") as raised:
            anonymous.search(text="a red apple")
    assert raised.value.status == 401


def test_a_server_that_is_not_there_is_named_with_the_fix():
    down = f"http://127.0.0.1:{free_port()}"
    with RetrievalClient(down, timeout=10) as client, pytest.raises(RetrievalConnectionError) as raised:
        client.health()
    assert down in str(raised.value) and "retrieval serve" in str(raised.value)
    assert isinstance(raised.value, ConnectionError)


class WaitingService:
    """Stands in for SearchService where a search must hold the server's one search slot until released."""

    max_upload_bytes, max_pixels = 1000, 1000

    def __init__(self) -> None:
        self.started, self.release = Event(), Event()

    def current(self) -> SimpleNamespace:
        return SimpleNamespace(dim=2)

    def text_search(self) -> bool:
        return False

    def search(self, query, k, *_, **__):
        from retrieval.serve.service.answers import SearchResponse

        self.started.set()
        self.release.wait(30)
        return SearchResponse([], k)


def test_a_busy_server_is_unavailable_with_its_retry_after():
    from retrieval.serve.api import create_api

    waiting = WaitingService()
    with BackgroundServer(create_api(waiting, concurrency=1, max_queue=0, observe=False)) as server, \
            RetrievalClient(server.url) as client, ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.search, embedding=[1.0, 0.0], k=2)
        assert waiting.started.wait(30)
        try:
            with pytest.raises(ServiceUnavailableError) as raised:
                client.search(embedding=[1.0, 0.0], k=2)
        finally:
            waiting.release.set()
        assert raised.value.status == 503 and raised.value.retry_after == 1.0 and "busy" in raised.value.message
        assert first.result().hits == []


def test_a_server_too_slow_for_the_timeout_is_named():
    from retrieval.serve.api import create_api

    waiting = WaitingService()
    with BackgroundServer(create_api(waiting, observe=False)) as server, \
            RetrievalClient(server.url, timeout=0.5) as client:
        try:
            with pytest.raises(RetrievalTimeoutError, match="did not answer within 0.5 s") as raised:
                client.search(embedding=[1.0, 0.0], k=2)
        finally:
            waiting.release.set()
    assert isinstance(raised.value, TimeoutError)


def test_a_server_without_a_text_model_says_so(service):
    from retrieval.serve.api import create_api

    with BackgroundServer(create_api(service, observe=False)) as server, RetrievalClient(server.url) as client:
        with pytest.raises(InvalidRequestError, match="text model") as raised:
            client.search(text="a red apple")
        assert raised.value.status == 422 and not client.stats().text_search


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda c: c.search(image="no/such/file.png"), FileNotFoundError, "no/such/file.png does not exist"),
    (lambda c: c.search(image=b""), ParameterError, "image is empty"),
    (lambda c: c.search(image=QUERY_PNG, text="a dog"), ParameterError, "exactly one of image, embedding and text"),
    (lambda c: c.search(), ParameterError, "got none"),
    (lambda c: c.search(embedding=[1.0, float("nan")]), ParameterError, "embedding holds NaN"),
    (lambda c: c.search(embedding=np.ones((2, 3))), ParameterError, "got shape (2, 3)"),
    (lambda c: c.search(text="  "), ParameterError, "text is empty"),
    (lambda c: c.search(text="a dog", k=0), ParameterError, "k must be a positive integer"),
    (lambda c: c.search(text="a dog", k=2.5), ParameterError, "k must be a positive integer"),
    (lambda c: c.search(text="a dog", rerank={"k": 3}), ParameterError, 'rerank needs "method"'),
    (lambda c: c.search_batch([]), ParameterError, "queries is empty"),
    (lambda c: c.search_batch(["a.png"]), ParameterError, 'queries[0] is a string'),
    (lambda c: c.search_batch([{"txt": "a dog"}]), ParameterError, "queries[0] has unknown keys txt"),
    (lambda c: c.search_batch([{"embedding": [np.inf]}]), ParameterError, "queries[0].embedding holds NaN"),
    (lambda c: c.item(-1), ParameterError, "item_id must be a catalogue id"),
])
def test_mistakes_are_named_before_any_request(call, error, message):
    with RetrievalClient(f"http://127.0.0.1:{free_port()}") as client:  # nobody there: nothing may be sent
        with pytest.raises(error) as raised:
            call(client)
    assert message in str(raised.value)


def test_the_client_closes_and_checks_its_url():
    with RetrievalClient("http://127.0.0.1:7860/") as client:
        assert client.url == "http://127.0.0.1:7860"
    assert client.closed
    with pytest.raises(RetrievalError, match="is closed"):
        client.health()
    with pytest.raises(ParameterError, match="http:// or https:// URL"):
        RetrievalClient("127.0.0.1:7860")


def test_the_records_read_every_field_the_api_documents():
    """Each record has a field for each of its body's documented fields (named as the API names them, but a search's
    ``results``, its ``hits``, and ``count``, their number), so a field the API adds is a change here too."""
    from retrieval.client import Health, Item, Limits, QueryFailure, QueryItem, RerankInfo, SearchHit, Stats
    from retrieval.serve.routes import schemas

    def fields(record) -> set[str]:
        return set(record.__dataclass_fields__) - {"raw"}

    pairs = [(SearchHit, schemas.Result), (QueryItem, schemas.QueryItemModel), (Item, schemas.ItemModel),
             (Health, schemas.HealthModel), (Limits, schemas.LimitsModel), (Stats, schemas.StatsModel)]
    for record, model in pairs:
        assert fields(record) == set(model.model_fields), record.__name__
    assert fields(SearchResults) == set(schemas.SearchResponseModel.model_fields) - {"results", "count"} | {"hits"}
    assert fields(RerankInfo) == set(schemas.RerankModel.model_fields) | {"defaults"}  # where the gallery set sizes
    assert fields(QueryFailure) == set(schemas.BatchQueryErrorModel.model_fields) | {"position"}


def test_the_client_loads_nothing_of_the_server_nor_torch():
    loaded = ("torch", "faiss", "onnxruntime", "fastapi", "gradio", "PIL", "retrieval.serve", "retrieval.index")
    code = f"import sys, retrieval.client; print([m for m in {loaded!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(REPO), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
