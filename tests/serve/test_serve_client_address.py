"""The access log's ``client``: the real peer unless the operator names a proxy (``retrieval serve
--forwarded-allow-ips``), and never more than an IP address, whatever a client forges in X-Forwarded-For."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_fixtures import BackgroundServer, access_records, serve_with_json_logs

from retrieval.serve.observability import ACCESS_LOGGER, INVALID_CLIENT, JsonFormatter
from retrieval.serve.server import ServerConfig, build_app

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def proxied(artifacts) -> Iterator[BackgroundServer]:
    """The API behind uvicorn's own defaults: X-Forwarded-For believed from 127.0.0.1, i.e. from any local client
    (what `--forwarded-allow-ips 127.0.0.1` asks for, and what every server did before the option)."""
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False, reload_interval_s=None))
    with BackgroundServer(app) as running:
        yield running
    service.close()


def logged(records: list[logging.LogRecord], request_id: str) -> list[logging.LogRecord]:
    deadline = time.monotonic() + 5
    while not any(r.access["request_id"] == request_id for r in records) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [r for r in records if r.access["request_id"] == request_id]


FORGED = [
    ("12 KB", b"1" * 12_000),
    ("60 KB", b"7" * 60_000),
    ("C1 controls", b"6.6.6.6\x85\x9b31m"),
    ("an IPv6 zone with a control character", b"fe80::1%\x85x"),
    ("markup", b"<script>alert(1)</script>"),
]


@pytest.mark.parametrize(("case", "forged"), FORGED, ids=[case for case, _ in FORGED])
def test_a_forged_client_address_is_logged_as_invalid_never_as_sent(proxied, case, forged):
    request_id = f"forged-{case.replace(' ', '-')[:40]}"
    with access_records() as records:
        try:
            response = httpx.get(f"{proxied.url}/health", timeout=10,
                                 headers=[(b"X-Request-ID", request_id.encode()), (b"X-Forwarded-For", forged)])
            status = response.status_code
        except httpx.HTTPError:  # the HTTP parser may refuse a header that large: then nothing is logged at all
            status = None
        seen = logged(records, request_id) if status == 200 else list(records)
    text = "\n".join(JsonFormatter().format(r) + r.getMessage() for r in seen)
    assert forged.decode("latin-1") not in text and "\x85" not in text and "<script>" not in text
    if status == 200:
        (record,) = seen
        assert record.access["client"] == INVALID_CLIENT and f"client={INVALID_CLIENT}" in record.getMessage()
    else:
        assert status is None or status >= 400, status


def test_a_forwarded_ip_address_from_a_trusted_proxy_is_logged(proxied):
    with access_records() as records:
        response = httpx.get(f"{proxied.url}/health", headers={"X-Request-ID": "forwarded-ok-1",
                                                               "X-Forwarded-For": "6.6.6.6"}, timeout=10)
        (record,) = logged(records, "forwarded-ok-1")
    assert response.status_code == 200 and record.access["client"] == "6.6.6.6"


# --- `retrieval serve`: the headers count only with --forwarded-allow-ips ------------------------------------------
def serve_and_call(index_dir: Path, options: list[str], calls: list[dict[str, str]]) -> list[dict]:
    """Start `retrieval serve --log-format json` with ``options``, GET /health with each header set, stop it; the
    access log's JSON lines."""
    def call(url: str) -> None:
        for headers in calls:
            assert httpx.get(f"{url}/health", headers=headers, timeout=10).status_code == 200

    _, lines = serve_with_json_logs(index_dir, options, call)
    return [line for line in lines if line["logger"] == ACCESS_LOGGER and line["request_id"] != "probe"]


def test_retrieval_serve_ignores_x_forwarded_for_unless_told_of_a_proxy(artifacts):
    """Without the option a local client cannot choose the address logged for it; with it (nginx on this
    machine) the address nginx passes on is logged."""
    call = [{"X-Request-ID": "xff-direct", "X-Forwarded-For": "6.6.6.6"}]
    (direct,) = serve_and_call(artifacts.index_dir, [], call)
    assert direct["request_id"] == "xff-direct" and direct["client"] == "127.0.0.1", direct
    call = [{"X-Request-ID": "xff-proxied", "X-Forwarded-For": "6.6.6.6"}]
    (proxied,) = serve_and_call(artifacts.index_dir, ["--forwarded-allow-ips", "127.0.0.1"], call)
    assert proxied["request_id"] == "xff-proxied" and proxied["client"] == "6.6.6.6", proxied


def test_metrics_are_answered_on_the_event_loop(artifacts):
    """GET /metrics is a coroutine: a thread pool taken by slow requests never keeps a scrape waiting."""
    app, service = build_app(ServerConfig(index_dir=artifacts.index_dir, ui=False, reload_interval_s=None))
    try:
        (route,) = [r for r in app.routes if getattr(r, "path", None) == "/metrics"]
        assert inspect.iscoroutinefunction(route.endpoint)
    finally:
        service.close()
