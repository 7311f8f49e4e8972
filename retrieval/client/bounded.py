"""An answer read within a size and a time: the body streamed into a buffer capped at a number of decoded bytes (a
gzip body is counted after decompression, a step at a time), and the whole call, its body included, within one
deadline (httpx's timeouts bound each read, not the sum of them)."""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import httpx

# the Content-Encodings undone here (zlib's wbits), the ones the client asks for; others are refused
ZLIB_WBITS = {"gzip": zlib.MAX_WBITS | 16, "x-gzip": zlib.MAX_WBITS | 16, "deflate": zlib.MAX_WBITS}
ACCEPT_ENCODING = "gzip, deflate"
DECODE_STEP = 256 * 2**10  # the most one decompression step may produce (a 64 KiB gzip read can hold 64 MiB)
# httpcore's trace events whose return value is a new connection's network stream
NEW_STREAM_EVENTS = frozenset({"connection.connect_tcp.complete", "connection.start_tls.complete"})


class BodyTooLarge(Exception):
    """The answer holds more than ``limit`` bytes (``declared`` when its Content-Length said so)."""

    def __init__(self, limit: int, declared: int | None) -> None:
        self.limit, self.declared = limit, declared
        super().__init__(limit, declared)


class UnreadableBody(Exception):
    """The body is in an encoding this client does not decode, or not in the one it declares."""


class Deadline:
    """A point in time one call must finish by (None: no limit)."""

    def __init__(self, seconds: float | None) -> None:
        self.end = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left, never below zero; None without a limit."""
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    @property
    def passed(self) -> bool:
        """Whether the deadline has passed."""
        return self.end is not None and time.monotonic() >= self.end

    def timeout(self) -> httpx.Timeout:
        """httpx's timeouts for the rest of the call: no single connect, write or read may outlast the deadline."""
        return httpx.Timeout(self.remaining())


class Cut:
    """Shuts the call's socket down when its deadline passes, so that a read blocked on a server that stalls or drips
    returns then (httpx's read timeout, set when the request left, bounds each read, not the sum): a new
    connection's socket from when it is made (httpcore's ``trace`` extension: pass ``trace`` as it), a pooled one's
    from ``watch`` of the answer, once its head is in. A context manager: the timer runs only within the block."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline, self.lock = deadline, threading.Lock()
        self.sock: socket.socket | None = None
        self.finished = False
        self.timer: threading.Timer | None = None

    def __enter__(self) -> Cut:
        remaining = self.deadline.remaining()
        if remaining is not None:
            self.timer = threading.Timer(remaining, self.cut)
            self.timer.daemon = True
            self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:  # never a socket already back in the pool
            self.finished = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer.join()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's ``trace`` callback: watch each stream a new connection makes (TLS wraps, and detaches, the
        TCP socket)."""
        if event in NEW_STREAM_EVENTS:
            self.watch(info.get("return_value"))

    def watch(self, stream: Any) -> None:
        """Cut ``stream``'s socket (an httpcore network stream, or None) at the deadline, now if it has passed."""
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self.lock:
            self.sock = sock
        if self.deadline.passed:
            self.cut()

    def cut(self) -> None:
        """Shut the watched socket down, unless the call has finished."""
        with self.lock:
            if not self.finished and self.sock is not None:
                try:
                    socket.socket.shutdown(self.sock, socket.SHUT_RDWR)  # the plain socket's, under a TLS one too
                except OSError:
                    pass


def decoded(chunks: Iterable[bytes], encoding: str) -> Iterator[bytes]:
    """The body's bytes with its Content-Encoding undone, in pieces of at most ``DECODE_STEP`` bytes each;
    ``UnreadableBody`` names an encoding this client does not decode or a body that is not in it."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        yield from chunks
        return
    if encoding not in ZLIB_WBITS:
        raise UnreadableBody(f"its Content-Encoding {encoding[:40]!r} is not one this client asked for "
                         f"({ACCEPT_ENCODING})")
    inflate = zlib.decompressobj(ZLIB_WBITS[encoding])
    try:
        for chunk in chunks:
            data = chunk
            while data and not inflate.eof:
                yield inflate.decompress(data, DECODE_STEP)
                data = inflate.unconsumed_tail
        yield inflate.flush()  # at most what one step left inside zlib
        if not inflate.eof:
            raise zlib.error("it ends before its compressed stream does")
    except zlib.error as exc:
        raise UnreadableBody(f"its {encoding} body is corrupt ({exc})") from None


def read_body(response: httpx.Response, limit: int, deadline: Deadline) -> bytes:
    """The answer's decoded body, at most ``limit`` bytes (``BodyTooLarge`` beyond, before reading any when its
    Content-Length says so), read by the deadline (``httpx.ReadTimeout`` after it; a ``Cut`` around the call ends a
    read blocked past it)."""
    declared = response.headers.get("content-length", "").strip()
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(limit, int(declared))
    body, late = bytearray(), "the call's deadline passed while its answer was read"
    try:
        for piece in decoded(response.iter_raw(), response.headers.get("content-encoding", "")):
            if deadline.passed:
                raise httpx.ReadTimeout(late)
            body += piece
            if len(body) > limit:
                raise BodyTooLarge(limit, None)
    except httpx.TransportError:
        if deadline.passed:  # the cut at the deadline dropped the connection
            raise httpx.ReadTimeout(late) from None
        raise
    if deadline.passed:  # the cut ended a body that runs to the connection's end
        raise httpx.ReadTimeout(late)
    return bytes(body)
