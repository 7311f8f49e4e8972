"""Admission: what the server lets in, budgeted by what work costs, and dropped when its client has gone.

Contract:

- ``BodyBudget``: the request bytes the API holds at once (bodies read, parsed, decoded). A request takes its
  declared length (or its cap) when its body's first bytes arrive (``HeldBytes``, ``serve.bodies.capped_body``:
  headers alone hold nothing); when the budget cannot be had within ``wait_s`` it is answered 503, so many waiting
  uploads never add up to gigabytes, and a body must arrive within ``read_timeout_s`` (408).
- ``WorkLane``: blocking work run in threads of the lane's own (at most ``concurrency`` at once), with at most
  ``max_waiting`` units of cost waiting (a single search costs 1, a batch its images and its texts' tokens in
  images' worth, a re-ranked request its queries times its method's work units); beyond that ``Busy`` (503). A
  lane with ``max_per_client`` also bounds what one client (its address) has running and waiting: beyond it, unless
  the client has nothing in the lane, ``Busy``. Lanes share no thread limiter with each other or with the rest of
  the app, so a lane full of batches never holds back single searches, and /health (answered on the event loop)
  never waits for a thread.
- ``ClientWatch``: a request's "client has gone" flag (a ``threading.Event``), set when the server sees the
  connection close. ``WorkLane.run`` drops work whose client has gone before it starts (also while it waits for
  its turn); the work itself checks ``gone`` between images and between re-ranked queries
  (``SearchService.search_batch``, ``retrieval.rerank.rerank_lists``).

- ``LengthRequired``: a chunked request body is refused (411) before uvicorn parses its chunks on the event loop.
  ``read_whole_body``: a middleware's bounded read of a body (the Gradio routes', ``serve.upload_cache``).

Everything here runs on the event loop except the work itself, and none of it grows with a client's bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from retrieval.serve.defaults import BODY_READ_TIMEOUT_S

T = TypeVar("T")
CLIENT_CLOSED = 499  # what the access log and metrics record for work dropped because its client went (nginx's)


class Busy(Exception):
    """The server cannot take this work now (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ClientGone(Exception):
    """The client closed the connection: its work is dropped (nobody is left to answer)."""


class BodyBudget:
    """At most ``total`` request bytes held at once; ``acquire(n)`` waits up to ``wait_s`` for room, else Busy. A body
    must arrive within ``read_timeout_s`` (``serve.bodies``: 408), so a slow sender holds its room for no longer."""

    def __init__(self, total: int, wait_s: float = 10.0, read_timeout_s: float = BODY_READ_TIMEOUT_S) -> None:
        self.total, self.wait_s, self.read_timeout_s = int(total), wait_s, read_timeout_s
        self.held = 0
        self._freed: asyncio.Condition | None = None  # made on the loop that first uses it

    def _condition(self) -> asyncio.Condition:
        if self._freed is None:
            self._freed = asyncio.Condition()
        return self._freed

    async def acquire(self, size: int) -> int:
        """Reserve ``size`` bytes (at most ``total``); returns what was reserved, to give back to ``release``."""
        size = min(int(size), self.total)
        freed = self._condition()
        async with freed:
            try:
                await asyncio.wait_for(freed.wait_for(lambda: self.held + size <= self.total), self.wait_s)
            except TimeoutError:
                raise Busy(f"server busy: {self.held} bytes of requests are being read or searched (the limit is "
                           f"{self.total}); retry shortly", retry_after_s=2) from None
            self.held += size
        return size

    async def release(self, size: int) -> None:
        """Give back what ``acquire`` reserved."""
        self.held -= size  # first: a release cancelled while it waits for the lock still gives the bytes back
        freed = self._condition()
        async with freed:
            freed.notify_all()


class HeldBytes:
    """One request's share of a ``BodyBudget``, taken as its bytes arrive and given back all at once."""

    def __init__(self, budget: BodyBudget) -> None:
        self.budget, self.bytes = budget, 0

    async def take(self, size: int) -> None:
        """Room for ``size`` more bytes (waits, then Busy)."""
        self.bytes += await self.budget.acquire(size)

    async def release(self) -> None:
        """Give back everything taken."""
        taken, self.bytes = self.bytes, 0
        if taken:
            await self.budget.release(taken)


class ClientWatch:
    """Sets ``gone`` when the client's connection closes. Start it once the request body has been read whole: from
    then on, the only message the server can receive for this request is ``http.disconnect``."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.gone = threading.Event()  # read by the worker thread between images
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
                return
            if message["type"] != "http.request":  # nothing else is expected: stop watching, drop nothing
                return

    def start(self) -> ClientWatch:
        """Begin watching (on the running loop)."""
        self._task = asyncio.get_running_loop().create_task(self._watch())
        return self

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The watching task: done once the client has gone (or watching stopped)."""
        return self._task

    def stop(self) -> None:
        """Stop watching (the answer is sent, or the work is over)."""
        if self._task is not None:
            self._task.cancel()


class WorkLane:
    """Blocking work in at most ``concurrency`` threads of its own; at most ``max_waiting`` cost units queued, and
    with ``max_per_client``, at most that many units of one client running and waiting (one request always)."""

    def __init__(self, name: str, concurrency: int, max_waiting: int, unit: str = "searches",
                 max_per_client: int | None = None) -> None:
        if concurrency < 1 or max_waiting < 0 or (max_per_client is not None and max_per_client < 1):
            raise ValueError(f"lane {name}: concurrency and max_per_client must be >= 1 and max_waiting >= 0")
        self.name, self.unit = name, unit
        self.concurrency, self.max_waiting, self.max_per_client = concurrency, max_waiting, max_per_client
        self.limiter = anyio.CapacityLimiter(concurrency)
        self.waiting = 0  # cost units waiting for a thread (only touched on the event loop)
        self.running = 0
        self.dropped = 0  # work dropped because its client had gone
        self.by_client: dict[str, int] = {}  # cost units running and waiting, per client address (event loop only)

    def admit(self, cost: int, client: str | None = None) -> None:
        """Busy when the lane's threads are all taken and ``cost`` more units would exceed its waiting limit, or when
        ``client`` already has work here and ``cost`` more would exceed its share."""
        if self.limiter.available_tokens == 0 and self.waiting + cost > self.max_waiting:
            raise Busy(f"server busy: {self.waiting} {self.unit} already waiting (the limit is {self.max_waiting}); "
                       "retry shortly")
        held = self.by_client.get(client or "", 0) if self.max_per_client is not None else 0
        if held and held + cost > self.max_per_client:  # type: ignore[operator]
            raise Busy(f"server busy: this client already has {held} {self.unit} running or waiting (the limit per "
                       f"client is {self.max_per_client}); wait for those answers, then retry", retry_after_s=2)

    async def run(self, fn: Callable[..., T], *args: Any, cost: int = 1, watch: ClientWatch | None = None,
                  client: str | None = None) -> T:
        """``fn(*args)`` in one of the lane's threads; Busy if the lane (or ``client``'s share of it) is full,
        ClientGone if the client went before the work started (it then never starts; work that checks
        ``watch.gone`` stops early itself)."""
        self.admit(cost, client)
        gone = watch.gone if watch is not None else None

        def start_then_run() -> T:
            if gone is not None and gone.is_set():
                raise ClientGone()
            return fn(*args)

        borrower = object()  # the turn is the request's, whichever task waited for it
        key = client or ""
        self.by_client[key] = self.by_client.get(key, 0) + cost
        try:
            self.waiting += cost
            try:
                await self._take_thread(borrower, watch)
            finally:
                self.waiting -= cost
            self.running += 1
            try:
                # the lane's limiter is held: the thread itself needs no other token
                return await anyio.to_thread.run_sync(start_then_run, limiter=_UNLIMITED.get())
            except ClientGone:
                self.dropped += 1
                raise
            finally:
                self.running -= 1
                self.limiter.release_on_behalf_of(borrower)
        finally:
            left = self.by_client.pop(key) - cost
            if left:
                self.by_client[key] = left

    async def _take_thread(self, borrower: object, watch: ClientWatch | None) -> None:
        """Wait for one of the lane's threads; ClientGone (holding none) if the client leaves meanwhile."""
        if watch is None or watch.task is None:
            await self.limiter.acquire_on_behalf_of(borrower)
            return
        turn = asyncio.ensure_future(self.limiter.acquire_on_behalf_of(borrower))
        try:
            await asyncio.wait({turn, watch.task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this request is cancelled itself (shutdown): its turn must not be taken later
            await self._give_up(turn, borrower)
            raise
        if turn.done() and not turn.cancelled() and turn.exception() is None:
            return
        if not watch.gone.is_set():  # the watcher ended for another reason: keep waiting for the turn
            await turn
            return
        await self._give_up(turn, borrower)
        self.dropped += 1
        raise ClientGone()

    async def _give_up(self, turn: asyncio.Future[None], borrower: object) -> None:
        """Stop waiting for ``turn``; a thread it got meanwhile is given back."""
        turn.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await turn
        if turn.done() and not turn.cancelled() and turn.exception() is None:  # the turn came as it was cancelled
            self.limiter.release_on_behalf_of(borrower)

    def stats(self) -> dict[str, int]:
        """What the lane is doing now (a racy read: for monitoring)."""
        return {"running": self.running, "waiting": self.waiting, "concurrency": self.concurrency,
                "max_waiting": self.max_waiting, "dropped_client_gone": self.dropped} | (
            {"max_per_client": self.max_per_client, "clients": len(self.by_client)}
            if self.max_per_client is not None else {})


class _UnlimitedLimiter:
    """A limiter with room for every thread a lane starts (the lane's own limiter bounds them), one per loop."""

    def __init__(self) -> None:
        self._limiters: dict[int, anyio.CapacityLimiter] = {}

    def get(self) -> anyio.CapacityLimiter:
        loop = id(asyncio.get_running_loop())
        if loop not in self._limiters:
            self._limiters[loop] = anyio.CapacityLimiter(10_000)
        return self._limiters[loop]


_UNLIMITED = _UnlimitedLimiter()


class LengthRequired:
    """ASGI middleware: a request body must come with a Content-Length; chunked ones get 411 before any is read.

    uvicorn's HTTP parser handles each chunk of a chunked body on the event loop: a body sent a byte per chunk
    costs microseconds per byte there, before any limit of the app can count it (one client held /health for
    seconds). Browsers, gradio_client and nginx (which buffers bodies) all send a Content-Length.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and any(name.lower() == b"transfer-encoding" for name, _ in scope["headers"]):
            detail = ("send the request body with a Content-Length header: chunked bodies are not accepted "
                      "(give the client the whole body, e.g. bytes rather than a generator)")
            # Connection: close, or uvicorn goes on parsing the chunks to reach the next request
            await JSONResponse({"detail": detail}, status_code=411, headers={"connection": "close"})(scope, receive,
                                                                                                    send)
            return
        await self.app(scope, receive, send)


async def read_whole_body(receive: Receive, limit: int, deadline_s: float) -> bytes | Response:
    """A request's body through a middleware: the bytes, or the answer to send instead (413 past ``limit``, 408 past
    ``deadline_s``, 499 when the client hangs up), read without any parsing."""
    chunks, size = [], 0
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return Response(status_code=CLIENT_CLOSED)
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return JSONResponse({"detail": f"the request body is over its limit of {limit} bytes"}, 413)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
    except TimeoutError:
        return JSONResponse({"detail": f"the request body took longer than {deadline_s:g} s to arrive; send it "
                             "at once"}, 408)


def replayed(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` (already read) once, then what the connection says next."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
