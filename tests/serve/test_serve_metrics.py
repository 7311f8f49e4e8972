"""Observability: ``GET /metrics`` (Prometheus) and the access log, against real servers over HTTP.

Counters grow by exactly the requests made, under the route's template; the micro-batcher's histogram counts the
image searches; the index gauges follow a writer's change; ``/metrics`` needs the token like the rest of the API;
one access-log line per request, with the request id the response echoes; ``retrieval serve --log-format json``
writes one JSON object per line and no uvicorn access line.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_fixtures import QUERY_PNG, BackgroundServer, access_records, serve_with_json_logs

from retrieval.index import remove_images
from retrieval.serve.observability import ACCESS_LOGGER, JsonFormatter
from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)

TOKEN = "t0ken-for-the-metrics-0123456789"
EMBEDDING = {"embedding": [1.0] + [0.0] * 31}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def server(artifacts) -> Iterator[tuple[BackgroundServer, object]]:
    """The API alone on loopback (the UI adds nothing to what is measured here)."""
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False, reload_interval_s=None))
    with BackgroundServer(app) as running:
        yield running, service
    service.close()


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    """Every sample of ``/metrics``, parsed by prometheus_client's own parser: (name, sorted labels) -> value."""
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def requests_of(samples: Samples, method: str, route: str, status: int) -> float:
    return value(samples, "retrieval_http_requests_total", method=method, route=route, status=str(status))


def settled(url: str, done: Callable[[Samples], bool], headers: dict[str, str] | None = None) -> Samples:
    """A scrape once ``done`` holds: a request is recorded just after its answer is sent, so the client may ask
    before the server has counted the previous one."""
    deadline = time.monotonic() + 5
    while True:
        samples = scrape(url, headers)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


# --- metrics ---------------------------------------------------------------------------------------------------
def test_counters_grow_by_exactly_the_requests_made_under_the_route_template(server, artifacts):
    running, _ = server
    url = running.url
    before = scrape(url)
    with httpx.Client(base_url=url, timeout=30) as http:
        for item_id in ("1", "2", "3"):
            assert http.get(f"/items/{item_id}").status_code == 200
        assert http.get("/items/999999999").status_code == 404
        assert http.get("/items/not-an-id").status_code == 404
        for _ in range(2):
            assert http.post("/search?k=3", json=EMBEDDING).status_code == 200
        assert http.post("/search?k=3", content=b"x", headers={"content-type": "text/plain"}).status_code == 415
        assert http.post("/search?k=0", json=EMBEDDING).status_code == 422
        assert http.get("/health").status_code == 200
        assert http.get("/no/such/route").status_code == 404
    expected = {("GET", "/items/{item_id}", 200): 3, ("GET", "/items/{item_id}", 404): 2, ("POST", "/search", 200): 2,
                ("POST", "/search", 415): 1, ("POST", "/search", 422): 1, ("GET", "/health", 200): 1,
                ("GET", "unmatched", 404): 1}

    def grown(samples: Samples) -> bool:
        return all(requests_of(samples, *key) - requests_of(before, *key) >= n for key, n in expected.items())

    after = settled(url, grown)
    for key, count in expected.items():
        assert requests_of(after, *key) - requests_of(before, *key) == count, key
    latency = "retrieval_http_request_duration_seconds_count"
    assert value(after, latency, method="GET", route="/items/{item_id}") - value(
        before, latency, method="GET", route="/items/{item_id}") == 5
    routes = {dict(labels).get("route") for (name, labels) in after if name.startswith("retrieval_http_")}
    assert "/items/{item_id}" in routes and not any(r.startswith("/items/") and "{" not in r for r in routes)
    assert "/no/such/route" not in routes  # an unknown path is no new series either
    # the scrapes are counted too (each after it was answered)
    assert requests_of(after, "GET", "/metrics", 200) > requests_of(before, "GET", "/metrics", 200)


def test_the_app_static_files_and_odd_methods_are_one_series_each(artifacts):
    """With the Gradio app mounted at /: its pages and events are ``ui``, the docs' files one template, and a
    made-up method ``OTHER`` (a client cannot add label values at will)."""
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, report=artifacts.report,
                                          reload_interval_s=None))
    try:
        with BackgroundServer(app) as running, httpx.Client(base_url=running.url, timeout=30) as http:
            for path in ("/", "/config", "/docs-assets/swagger-ui.css", "/docs-assets/redoc.standalone.js"):
                assert http.get(path).status_code == 200, path
            brewed = http.request("BREW", "/health").status_code  # 404: Gradio's mount takes what /health does not
            assert brewed >= 400
            samples = settled(running.url, lambda s: requests_of(s, "OTHER", "/health", brewed) >= 1)
        assert requests_of(samples, "GET", "ui", 200) == 2
        assert requests_of(samples, "GET", "/docs-assets/{path}", 200) == 2
        assert requests_of(samples, "OTHER", "/health", brewed) == 1
        methods = {dict(labels).get("method") for (name, labels) in samples if name.startswith("retrieval_http_")}
        assert methods == {"GET", "OTHER"}
    finally:
        service.close()


def test_the_batch_size_histogram_counts_the_image_searches(server, artifacts):
    running, _ = server
    before = scrape(running.url)
    images = [path.read_bytes() for path in artifacts.query_paths[:4]]
    with httpx.Client(base_url=running.url, timeout=60) as http:
        for data in images:  # one after the other: each is a model call of one row
            assert http.post("/search?k=2", files={"image": ("q.png", data)}).status_code == 200
        assert http.post("/search?k=2", json=EMBEDDING).status_code == 200  # no model call for an embedding
    after = settled(running.url, lambda s: requests_of(s, "POST", "/search", 200) >=
                    requests_of(before, "POST", "/search", 200) + 5)
    for name in ("retrieval_batcher_batch_size_count", "retrieval_batcher_batch_size_sum"):
        assert value(after, name) - value(before, name) == len(images), name
    ones = value(after, "retrieval_batcher_batch_size_bucket", le="1.0")
    assert ones - value(before, "retrieval_batcher_batch_size_bucket", le="1.0") == len(images)
    assert value(after, "retrieval_batcher_batch_size_bucket", le="+Inf") == value(
        after, "retrieval_batcher_batch_size_count")
    assert value(after, "retrieval_batcher_queue_length") == 0  # nothing waits once the searches are answered


def test_the_index_gauges_equal_the_vectors_served(server):
    running, service = server
    samples = scrape(running.url)
    vectors = httpx.get(f"{running.url}/health", timeout=10).json()["vectors"]
    assert value(samples, "retrieval_index_vectors") == vectors == len(service) > 0
    assert value(samples, "retrieval_index_generation") == 1
    assert value(samples, "retrieval_index_reloads_total") == 0


def test_a_writers_change_is_counted_as_a_reload(artifacts, tmp_path):
    index_dir = tmp_path / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    app, service = build_app(ServerConfig(index_dir=index_dir, ui=False, reload_interval_s=None))
    try:
        with BackgroundServer(app) as running:
            vectors = value(scrape(running.url), "retrieval_index_vectors")
            first = httpx.post(f"{running.url}/search?k=1", json=EMBEDDING, timeout=30).json()["results"][0]["id"]
            remove_images(index_dir, ids=[first])
            assert service.reload()  # what the watcher does each second (off here: the test decides when)
            samples = scrape(running.url)
            assert value(samples, "retrieval_index_vectors") == vectors - 1 == len(service)
            assert value(samples, "retrieval_index_generation") == 2
            assert value(samples, "retrieval_index_reloads_total") == 1
    finally:
        service.close()


def test_two_apps_in_one_process_keep_their_own_registries(artifacts, server):
    running, _ = server
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False, reload_interval_s=None))
    try:
        with BackgroundServer(app) as other:
            before = scrape(running.url)
            assert httpx.get(f"{other.url}/health", timeout=10).status_code == 200
            fresh = settled(other.url, lambda s: requests_of(s, "GET", "/health", 200) >= 1)
            assert requests_of(fresh, "GET", "/health", 200) == 1
            assert requests_of(scrape(running.url), "GET", "/health", 200) == requests_of(before, "GET", "/health", 200)
    finally:
        service.close()


def test_metrics_need_the_token_off_loopback_and_refusals_are_counted(artifacts):
    """Configured for a network interface with a token (served on loopback here): /metrics is refused without the
    token like every API route, /health is not; the 401 is counted, since the metrics stand in front of the
    token check."""
    config = ServerConfig(index_dir=artifacts.index_dir, host="0.0.0.0", api_token=TOKEN, ui=False,
                          reload_interval_s=None)
    app, service = build_app(config)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with BackgroundServer(app) as running:
            for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, {"Authorization": TOKEN}):
                refused = httpx.get(f"{running.url}/metrics", headers=headers, timeout=10)
                assert refused.status_code == 401 and "retrieval_" not in refused.text
                assert refused.headers["www-authenticate"] == "Bearer"
            assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200
            samples = settled(running.url, lambda s: requests_of(s, "GET", "/metrics", 401) >= 3, headers=auth)
            assert requests_of(samples, "GET", "/metrics", 401) == 3
            assert requests_of(samples, "GET", "/health", 200) == 1
    finally:
        service.close()


def test_metrics_are_documented_as_text_in_the_openapi_document(server):
    running, _ = server
    metrics = httpx.get(f"{running.url}/openapi.json", timeout=10).json()["paths"]["/metrics"]["get"]
    assert set(metrics["responses"]) == {"200", "401", "403"}
    assert set(metrics["responses"]["200"]["content"]) == {"text/plain"}


# --- the access log --------------------------------------------------------------------------------------------
def settled_records(records: list[logging.LogRecord], count: int) -> list[logging.LogRecord]:
    deadline = time.monotonic() + 5
    while len(records) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # and no more come
    return list(records)


def test_one_access_line_per_request_with_the_echoed_request_id(server):
    running, _ = server
    secret_body = {"embedding": [0.123456789] + [0.0] * 31}
    with access_records() as records, httpx.Client(base_url=running.url, timeout=30) as http:
        responses = [
            http.get("/health", headers={"X-Request-ID": "client-id_1.2"}),
            http.get("/items/1"),
            http.get("/items/424242"),
            http.post("/search?k=2", json=secret_body, headers={"Authorization": "Bearer not-logged-0123456789"}),
            http.post("/search?k=2", files={"image": ("q.png", QUERY_PNG)}),
        ]
        seen = settled_records(records, len(responses))
    ids = [response.headers["x-request-id"] for response in responses]
    assert ids[0] == "client-id_1.2" and len(set(ids)) == len(ids)
    # one line each (the logger is the process's: a line of another test's server may come in the same window)
    lines = Counter(record.access["request_id"] for record in seen)
    assert all(lines[request_id] == 1 for request_id in ids), lines
    seen = [record for record in seen if record.access["request_id"] in ids]
    by_id = {record.access["request_id"]: record for record in seen}
    for response, request_id in zip(responses, ids, strict=True):
        fields = by_id[request_id].access
        assert fields["status"] == response.status_code and fields["client"] == "127.0.0.1"
        assert fields["method"] == response.request.method and fields["duration_ms"] >= 0
        assert by_id[request_id].levelno == logging.INFO and request_id in by_id[request_id].getMessage()
    assert [by_id[i].access["route"] for i in ids] == ["/health", "/items/{item_id}", "/items/{item_id}", "/search",
                                                      "/search"]
    text = "\n".join(JsonFormatter().format(record) + record.getMessage() for record in seen)
    for never in ("0.123456789", "not-logged", "Bearer", "424242", "k=2", "PNG"):
        assert never not in text, never  # no body, token, raw path, query string or image bytes
    assert json.loads(JsonFormatter().format(by_id[ids[1]]))["route"] == "/items/{item_id}"


HOSTILE_IDS = [
    ("too long", "a" * 65),
    ("spaces", "two words"),
    ("non-ASCII", "caf\u00e9".encode()),
    ("quotes and markup", '"><script>'),
    ("two ids", None),
]


@pytest.mark.parametrize(("case", "given"), HOSTILE_IDS, ids=[case for case, _ in HOSTILE_IDS])
def test_a_hostile_request_id_is_replaced_not_logged(server, case, given):
    running, _ = server
    headers = [("X-Request-ID", "ok-1"), ("X-Request-ID", "ok-2")] if given is None else [("X-Request-ID", given)]
    with access_records() as records:
        response = httpx.get(f"{running.url}/health", headers=headers, timeout=10)
        seen = settled_records(records, 1)
    assert response.status_code == 200
    echoed = response.headers["x-request-id"]
    (record,) = [r for r in seen if r.access["request_id"] == echoed]  # another server's line may share the logger
    assert len(echoed) == 32 and echoed.isalnum()
    logged = "".join(JsonFormatter().format(r) + r.getMessage() for r in seen)
    shown = given.decode("latin-1") if isinstance(given, bytes) else given or "ok-1"
    assert shown not in logged


def test_a_newline_in_the_request_id_never_reaches_the_log(server):
    """A raw request whose id hides a second log line: refused by the HTTP parser, or answered with a new id."""
    running, _ = server
    with access_records() as records, socket.create_connection((running.host, running.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Request-ID: a\nforged line\r\n"
                     b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        seen = settled_records(records, 1) if answer.startswith(b"HTTP/1.1 200") else list(records)
    assert not any("forged" in record.getMessage() or "forged" in JsonFormatter().format(record) for record in seen)
    if answer.startswith(b"HTTP/1.1 200"):
        assert len(seen) == 1 and seen[0].access["request_id"] != "a"


# --- `retrieval serve --log-format json` -------------------------------------------------------------------------
def test_retrieval_serve_writes_one_json_line_per_request_and_no_uvicorn_access_line(artifacts):
    def call(url: str) -> list[str]:
        return [httpx.get(f"{url}/items/1", timeout=10).headers["x-request-id"],
                httpx.post(f"{url}/search?k=2", json=EMBEDDING, timeout=30).headers["x-request-id"],
                httpx.get(f"{url}/metrics", headers={"X-Request-ID": "scrape-7"}, timeout=10).headers["x-request-id"]]

    ids, lines = serve_with_json_logs(artifacts.index_dir, [], call)  # every line is one JSON object
    access = [line for line in lines if line["logger"] == ACCESS_LOGGER]
    answered = [line["request_id"] for line in access if line["request_id"] != "probe"]
    assert answered == ids and ids[2] == "scrape-7", lines
    assert {key for key in access[-1]} >= {"time", "level", "request_id", "method", "route", "status", "duration_ms",
                                           "client"}
    assert [line["route"] for line in access[-3:]] == ["/items/{item_id}", "/search", "/metrics"]
    assert not any(line["logger"] == "uvicorn.access" for line in lines)
