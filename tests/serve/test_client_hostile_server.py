"""``retrieval.client`` against a server that is not a well-behaved `retrieval serve` (a raw socket server on a
loopback port, answering each request with bytes of the test's choosing): an answer too large (declared, endless,
a gzip or brotli bomb) stops at the client's size limit, held to a few MiB; a slow drip of the head or the body, or
a stall mid-body, ends at the client's timeout for the whole call; deep JSON, a number too large for an id and fields
of the wrong type are the client's own error naming the field; a Retry-After that is not a finite number of seconds is
not passed on."""

from __future__ import annotations

import gzip
import json
import socket
import socketserver
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from retrieval.client import (
    ResponseTooLargeError,
    RetrievalAPIError,
    RetrievalClient,
    RetrievalTimeoutError,
    ServiceUnavailableError,
    UnexpectedResponseError,
)
from retrieval.client.errors import MAX_RETRY_AFTER_S

pytestmark = pytest.mark.timeout(120)

MIB = 2**20
HOLD_S = 10.0  # how long a server that stalls holds the connection open: longer than any client here waits
Answer = Callable[[socket.socket], None]


class QuietServer(socketserver.ThreadingTCPServer):
    daemon_threads, block_on_close, allow_reuse_address = True, False, True

    def handle_error(self, request: Any, client_address: Any) -> None:  # a client hanging up is what tests want
        pass


def read_request(conn: socket.socket) -> None:
    """Read one request's head and its Content-Length body (bounded)."""
    conn.settimeout(HOLD_S)
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 64 * 1024:
        more = conn.recv(65536)
        if not more:
            return
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < min(length, 64 * MIB):
        more = conn.recv(65536)
        if not more:
            return
        body += more


@contextmanager
def hostile_server(answer: Answer) -> Iterator[str]:
    """A loopback HTTP server whose every answer is what ``answer`` writes to the socket; yields its URL."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            read_request(self.request)
            answer(self.request)

    server = QuietServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def head(status: str = "200 OK", **headers: str | int) -> bytes:
    """An HTTP/1.1 answer's status line and headers (``Content_Type`` -> ``Content-Type``)."""
    lines = [f"HTTP/1.1 {status}"] + [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def json_answer(data: Any = None, *, raw: bytes | None = None, status: str = "200 OK", **headers: str) -> Answer:
    """An answer of JSON (``data``, or the bytes ``raw``) with its Content-Length."""
    body = raw if raw is not None else json.dumps(data).encode()

    def answer(conn: socket.socket) -> None:
        conn.sendall(head(status, Content_Type="application/json", Content_Length=len(body), **headers) + body)

    return answer


def hold(conn: socket.socket) -> None:
    """Keep the connection open until the client closes it (or ``HOLD_S`` passes)."""
    try:
        conn.recv(1)
    except OSError:
        pass


def within(seconds: float, call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s exception (or result) and the seconds it took; fails the test if it still runs after
    ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome["value"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the client was still waiting after {seconds} s"
    return outcome["value"], time.monotonic() - start


def traced_peak(call: Callable[[], Any]) -> tuple[Any, int]:
    """``within(30, call)``'s outcome and the most bytes Python held meanwhile above where it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        outcome, _ = within(30, call)
        return outcome, tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_declared_content_length_beyond_the_limit_is_refused_before_reading():
    def answer(conn: socket.socket) -> None:
        conn.sendall(head(Content_Type="application/json", Content_Length=8 * 2**30) + b"{")
        hold(conn)

    with hostile_server(answer) as url, RetrievalClient(url, timeout=30) as client:
        error, seconds = within(5, client.health)
    assert isinstance(error, ResponseTooLargeError), error
    assert error.declared == 8 * 2**30 and error.option == "max_response_bytes"
    assert "8589934592 bytes" in str(error) and "max_response_bytes=" in str(error) and seconds < 3


def test_an_image_beyond_max_image_bytes_is_refused_by_its_own_limit():
    def answer(conn: socket.socket) -> None:
        conn.sendall(head(Content_Type="image/png", Content_Length=2**30) + b"\x89PNG")
        hold(conn)

    with hostile_server(answer) as url, RetrievalClient(url, timeout=30, max_image_bytes=MIB) as client:
        error, _ = within(5, lambda: client.item_image(3))
    assert isinstance(error, ResponseTooLargeError), error
    assert error.option == "max_image_bytes" and "max_image_bytes=1048576" in str(error)


def test_an_endless_chunked_body_stops_at_the_limit():
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b" " * 64 * 1024)

    def answer(conn: socket.socket) -> None:
        conn.sendall(head(Content_Type="application/json", Transfer_Encoding="chunked"))
        for _ in range(1024):  # 64 MiB at most, never terminated
            conn.sendall(chunk)

    with hostile_server(answer) as url, RetrievalClient(url, timeout=30, max_response_bytes=MIB) as client:
        error, peak = traced_peak(client.health)
    assert isinstance(error, ResponseTooLargeError), error
    assert error.declared is None and "more than 1048576 bytes" in str(error)
    assert peak < 8 * MIB, f"held {peak / MIB:.1f} MiB for a 1 MiB limit"


def compressed_spaces(compressor: Any, megabytes: int) -> bytes:
    """``megabytes`` MiB of spaces through ``compressor`` (zlib's or brotli's), made a MiB at a time."""
    block, out = b" " * MIB, []
    for _ in range(megabytes):
        out.append(compressor.process(block) if hasattr(compressor, "process") else compressor.compress(block))
    out.append(compressor.finish() if hasattr(compressor, "finish") else compressor.flush())
    return b"".join(out)


def test_a_gzip_bomb_stops_at_the_limit_counted_decompressed():
    bomb = compressed_spaces(zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16), 64)  # 64 MiB in ~64 KiB
    assert len(bomb) < 256 * 1024
    answer = json_answer(raw=bomb, Content_Encoding="gzip")
    with hostile_server(answer) as url, RetrievalClient(url, timeout=30, max_response_bytes=MIB) as client:
        error, peak = traced_peak(client.health)
    assert isinstance(error, ResponseTooLargeError), error
    assert "more than 1048576 bytes" in str(error) and peak < 8 * MIB, f"held {peak / MIB:.1f} MiB"


def test_an_encoding_the_client_did_not_ask_for_is_named_not_decoded():
    brotli = pytest.importorskip("brotli")
    bomb = compressed_spaces(brotli.Compressor(quality=1), 16)
    with hostile_server(json_answer(raw=bomb, Content_Encoding="br")) as url, RetrievalClient(url) as client:
        error, peak = traced_peak(client.health)
    assert isinstance(error, UnexpectedResponseError), error
    assert "Content-Encoding 'br'" in str(error) and peak < 8 * MIB


def test_a_gzipped_answer_within_the_limit_is_read():
    body = gzip.compress(json.dumps({"status": "ok", "vectors": 7, "embedding_dim": 32}).encode())
    with hostile_server(json_answer(raw=body, Content_Encoding="gzip")) as url, RetrievalClient(url) as client:
        health = client.health()
    assert (health.status, health.vectors, health.embedding_dim) == ("ok", 7, 32)


def test_a_slow_drip_ends_at_the_timeout_for_the_whole_call():
    def answer(conn: socket.socket) -> None:  # each byte well within the timeout, the whole body far beyond it
        conn.sendall(head(Content_Type="application/json", Content_Length=100))
        for _ in range(100):
            time.sleep(0.4)
            conn.sendall(b" ")

    with hostile_server(answer) as url, RetrievalClient(url, timeout=1.0) as client:
        error, seconds = within(10, client.health)
    assert isinstance(error, RetrievalTimeoutError), error
    assert "within 1 s" in str(error) and seconds < 2.0


def test_a_status_line_and_headers_dripped_end_at_the_timeout_for_the_whole_call():
    def answer(conn: socket.socket) -> None:  # each byte of the head well within the timeout, the head far beyond it
        for byte in head(Content_Type="application/json", Content_Length=2) + b"{}":
            time.sleep(0.3)
            conn.sendall(bytes([byte]))

    with hostile_server(answer) as url, RetrievalClient(url, timeout=1.0) as client:
        threads = threading.active_count()
        error, seconds = within(10, client.health)
        assert isinstance(error, RetrievalTimeoutError), error
        assert seconds < 3.0, f"took {seconds:.1f} s for a 1 s timeout"
        assert threading.active_count() <= threads, "the call left a thread running"


def test_a_stall_mid_body_ends_at_the_timeout_not_a_read_timeout_later():
    def answer(conn: socket.socket) -> None:  # one byte just before the deadline, then nothing
        conn.sendall(head(Content_Type="application/json", Content_Length=100))
        time.sleep(1.5)
        conn.sendall(b" ")
        hold(conn)

    with hostile_server(answer) as url, RetrievalClient(url, timeout=2.0) as client:
        error, seconds = within(10, client.health)
    assert isinstance(error, RetrievalTimeoutError), error
    assert seconds < 3.0, f"took {seconds:.1f} s for a 2 s timeout"


HIT = {"id": 4, "path": "a/b.png", "name": "b.png", "label": "b", "score": 0.5, "image_url": "/items/4/image"}
ITEM = {key: HIT[key] for key in ("id", "path", "name", "label", "image_url")} | {"sha256": None, "size": 10}


def search_answer(**hit: Any) -> dict[str, Any]:
    return {"k": 1, "count": 1, "results": [HIT | hit], "query_item": None, "excluded_self": False, "notes": [],
            "timing": {"search_ms": 0.1}}


@pytest.mark.parametrize(("call", "answer", "message"), [
    ("health", json_answer(raw=b"[" * 100_000 + b"]" * 100_000), "nested deeper than Python reads"),
    ("item", json_answer(raw=json.dumps(ITEM).replace('"id": 4', '"id": 1e999').encode()),
     "'id' must be a non-negative integer, got inf"),
    ("item", json_answer(ITEM | {"size": 2**64}), "'size' must be a non-negative integer"),
    ("search", json_answer(search_answer(path=["a", "b.png"])), "'path' must be a string, got ['a', 'b.png']"),
    ("search", json_answer(search_answer(score="NaN")), "'score' must be a finite number, got 'NaN'"),
    ("search", json_answer(raw=json.dumps(search_answer(score=float("nan"))).encode()),
     "'score' must be a finite number, got nan"),
    ("health", json_answer({"status": "ok", "vectors": True, "embedding_dim": 32}),
     "'vectors' must be a non-negative integer, got True"),
], ids=["deep-json", "id-1e999", "size-2**64", "list-path", "nan-string-score", "nan-score", "bool-count"])
def test_an_answer_of_the_wrong_shape_is_named_by_the_clients_error(call, answer, message):
    calls = {"health": lambda c: c.health(), "item": lambda c: c.item(4),
             "search": lambda c: c.search(embedding=[1.0, 0.0], k=1)}
    with hostile_server(answer) as url, RetrievalClient(url, timeout=30) as client:
        error, _ = within(10, lambda: calls[call](client))
    assert isinstance(error, UnexpectedResponseError), repr(error)
    assert message in str(error) and "with a body this client cannot read (" in str(error)


@pytest.mark.parametrize(("header", "seconds"), [
    ("2", 2.0), ("inf", None), ("nan", None), ("-3", None), ("1e9", MAX_RETRY_AFTER_S), ("soon", None)])
def test_retry_after_is_passed_on_only_as_a_finite_capped_number_of_seconds(header, seconds):
    answer = json_answer({"detail": "busy"}, status="503 Service Unavailable", Retry_After=header)
    with hostile_server(answer) as url, RetrievalClient(url, timeout=30) as client:
        error, _ = within(10, client.health)
    assert isinstance(error, ServiceUnavailableError) and error.message == "busy"
    assert error.retry_after == seconds


def test_a_redirect_is_never_followed_with_the_clients_token():
    """A 302 to another server (which would receive the bearer token and choose the answer) is an error of the
    client's own; the other server is never asked."""
    asked = []

    def record(conn: socket.socket) -> None:
        asked.append(True)
        json_answer({"status": "ok", "vectors": 1, "embedding_dim": 2})(conn)

    with hostile_server(record) as elsewhere:
        moved = json_answer({}, status="302 Found", Location=f"{elsewhere}/health")
        with hostile_server(moved) as url, RetrievalClient(url, api_key="secret-token-of-16+") as client:
            with pytest.raises(RetrievalAPIError, match="HTTP 302"):
                client.health()
    assert asked == []
