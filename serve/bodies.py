"""Reading request bodies of untrusted size and shape: bytes through a cap, JSON checked before it is parsed.

Contract: ``read_body`` and ``read_uploads`` run on the event loop and only move bytes (through ``limit``: 413 as
soon as a body is over it; 408 past the budget's deadline; a client hanging up is ``ClientGone``, a 499).
``parse_json_object`` is CPU work that grows with the body, so callers run it in a thread: it first measures the
body's skeleton (strings removed: how many values, how deeply nested) against the caller's bounds, refusing a body
of a million empty arrays before ``json.loads`` allocates them, then parses it. Numbers are refused past
``MAX_NUMBER_CHARS`` characters (Python's integer parser would raise on 4,300 digits).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from retrieval.serve.admission import ClientGone, HeldBytes
from retrieval.serve.defaults import BODY_READ_TIMEOUT_S
from retrieval.serve.images import QueryError

FORM_SLACK = 64 * 1024  # multipart boundaries and headers, JSON punctuation
BRACKETS = bytes(range(256)).translate(None, b"[]{}")  # every byte but the brackets: deleted to measure depth
MAX_NUMBER_CHARS = 1000  # a float64 needs at most 309 digits; Python refuses integers past 4,300 digits


def too_large(limit: int) -> QueryError:
    """The 413 of a body over ``limit`` bytes."""
    return QueryError(
        f"request body is over the limit of {limit} bytes; send a smaller image "
        "(or start the server with a larger --max-upload-mb)",
        413,
    )


def declared_length(request: Request) -> int | None:
    """The body's Content-Length when it is one plain number, else None (chunked, or malformed)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isascii() and declared.isdigit() else None


async def capped_body(request: Request, limit: int, held: HeldBytes | None = None) -> AsyncIterator[bytes]:
    """The request body, chunk by chunk; 413 as soon as it exceeds ``limit`` bytes. With ``held``, the body takes its
    room in the body budget (its declared length, else ``limit``) when its first bytes arrive: a connection that
    sends headers and nothing else holds none, and a body that has started is never starved half-way."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise too_large(limit)
    received = 0
    try:
        async for chunk in request.stream():
            if held is not None and not held.bytes and chunk:
                await held.take(limit if declared is None else declared)
            received += len(chunk)
            if received > limit:
                raise too_large(limit)
            yield chunk
    except ClientDisconnect:
        raise ClientGone() from None


async def read_body(request: Request, limit: int, held: HeldBytes | None = None) -> bytearray:
    """The whole body of at most ``limit`` bytes, grown chunk by chunk (no copy of the whole on the event loop);
    parse it off the loop."""
    body = bytearray()
    async with body_deadline(held):
        async for chunk in capped_body(request, limit, held):
            body += chunk
    return body


@contextlib.asynccontextmanager
async def body_deadline(held: HeldBytes | None) -> AsyncIterator[None]:
    """408 when the body takes longer than its budget's ``read_timeout_s`` to arrive (a slow sender holds its share
    of the budget meanwhile)."""
    seconds = held.budget.read_timeout_s if held is not None else BODY_READ_TIMEOUT_S
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise QueryError(f"the request body took longer than {seconds:g} s to arrive; send it at once", 408) from None


PRINTABLE_ASCII = bytes(range(0x20, 0x7F)).replace(b"\\", b"")  # what a string may hold to be taken as it is
LONG_STRING = 4096  # strings at least this long are lifted out of the text before it is parsed


class JsonText:
    """A JSON text with its strings located by ``memchr`` (``bytes.find``, no regex): ``structure`` is the text with
    every string emptied (to count values and nesting), ``compact`` the text with each long string replaced by a
    placeholder, so that ``json.loads`` (which holds the GIL throughout) parses kilobytes, not megabytes; ``long``
    maps each placeholder to its string. At most ``max_quotes`` quotes are looked at (more: ``too_many``)."""

    def __init__(self, body: bytes | bytearray, max_quotes: int) -> None:
        self.structure: bytes | bytearray
        self.compact: bytes | bytearray
        self.too_many = body.count(b'"') > max_quotes
        self.long: dict[str, str] = {}
        if self.too_many:
            self.structure = self.compact = b""
            return
        tag = secrets.token_hex(8)  # no client can guess it, so no string of theirs is taken for a placeholder
        structure, compact, copied, cursor = [], [], 0, 0
        while (start := body.find(b'"', cursor)) >= 0:
            end = _closing_quote(body, start)
            if end < 0:  # unterminated: json.loads names the problem
                break
            structure.append(body[copied:start] + b'""')
            raw = body[start + 1 : end] if end - start > LONG_STRING else b""
            if raw and not raw.translate(None, PRINTABLE_ASCII):  # no escapes, no control characters: as parsed
                placeholder = f"{tag}:{len(self.long)}"
                self.long[placeholder] = raw.decode("ascii")
                compact.append(body[copied:start] + b'"' + placeholder.encode() + b'"')
            else:
                compact.append(body[copied : end + 1])
            copied = cursor = end + 1
        if not copied:  # no string: nothing to take out (and no copy of a body of brackets)
            self.structure = self.compact = body
            return
        structure.append(body[copied:])
        compact.append(body[copied:])
        self.structure, self.compact = b"".join(structure), b"".join(compact)

    def restore(self, value: Any) -> Any:
        """``value`` (parsed from ``compact``) with each placeholder replaced by its string."""
        if isinstance(value, str):
            return self.long.get(value, value)
        if isinstance(value, list):
            return [self.restore(item) for item in value]
        if isinstance(value, dict):
            return {self.long.get(key, key): self.restore(item) for key, item in value.items()}
        return value


def _closing_quote(body: bytes | bytearray, start: int) -> int:
    """The position of the quote that ends the string opened at ``start`` (one not escaped), or -1."""
    end = start
    while (end := body.find(b'"', end + 1)) >= 0:
        if _backslashes_before(body, start + 1, end) % 2 == 0:
            return end
    return -1


def _backslashes_before(body: bytes | bytearray, low: int, end: int) -> int:
    """How many backslashes stand right before ``end`` (not before ``low``): measured by ``rstrip`` in C over a
    window that doubles, so a run of a million costs a few copies, not a million steps of Python."""
    window = 64
    while True:
        first = max(low, end - window)
        chunk = body[first:end]
        run = len(chunk) - len(chunk.rstrip(b"\\"))
        if run < len(chunk) or first == low:
            return run
        window *= 2


def json_values(structure: bytes) -> int:
    """How many values a JSON text with its strings emptied holds at most: its commas and openings, plus one."""
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1


def json_depth(structure: bytes | bytearray, max_brackets: int) -> int:
    """The deepest nesting among the first ``max_brackets`` brackets of a JSON text with its strings emptied (a
    lower bound past them; memory: four bytes per bracket looked at)."""
    brackets = np.frombuffer(structure.translate(None, BRACKETS)[:max_brackets], dtype=np.uint8)
    if not len(brackets):
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps, dtype=np.int32).max())


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise QueryError(f"the JSON body has a number of {len(text)} digits; numbers are limited to "
                         f"{MAX_NUMBER_CHARS} characters", 422)
    return int(text)


def _bounded_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise QueryError(f"the JSON body has a number of {len(text)} characters; numbers are limited to "
                         f"{MAX_NUMBER_CHARS}", 422)
    return float(text)


def parse_json_object(body: bytes | bytearray, max_values: int, max_depth: int, shape: str) -> dict[str, Any]:
    """The JSON object of ``body``, refused before parsing when it holds more than ``max_values`` values or nests
    deeper than ``max_depth``; ``shape`` says what the object should look like. CPU work: call it off the loop.
    A ``bytearray`` body is emptied once its strings are taken out of it (the memory goes back at once)."""
    if b"\x00" in body[:4]:  # UTF-16 or UTF-32, which json.loads would read: the string scan below reads UTF-8
        raise QueryError("the JSON body must be UTF-8 (this one looks like UTF-16 or UTF-32)")
    text = JsonText(body, 4 * max_values + 64)  # a value is at most a key and a string: four quotes
    if isinstance(body, bytearray) and text.compact is not body:
        body.clear()  # the caller's copy of the text: its bytes now live in text.long, not twice
    values = max_values + 1 if text.too_many else json_values(text.structure)
    depth = json_depth(text.structure, 2 * max_values + 2)
    if depth > max_depth:
        raise QueryError(f"the JSON body is nested too deeply ({depth} levels or more; this request has at most "
                         f"{max_depth}); send a flat object: {shape}")
    if values > max_values:
        raise QueryError(f"the JSON body holds more values than this request can use ({max_values}); send {shape}",
                         422)
    try:
        payload = text.restore(json.loads(text.compact, parse_int=_bounded_int, parse_float=_bounded_float))
        del text  # the long strings are now held by the payload alone: each caller may drop them as it goes
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QueryError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # past the brackets json_depth looked at: kept as the last guard
        raise QueryError("the JSON body is nested too deeply; send a flat object") from exc
    if not isinstance(payload, dict):
        raise QueryError(f"the JSON body must be an object: {shape}", 422)
    return payload


def _names(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(key[:40]) for key in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_keys(payload: dict[str, Any], allowed: tuple[str, ...], subject: str = "the JSON body") -> None:
    """422 naming the keys of ``payload`` that are not ``allowed``."""
    unknown = sorted(key for key in payload if key not in allowed)
    if unknown:
        raise QueryError(f"unknown key(s) in {subject}: {_names(unknown)}; allowed keys: {', '.join(allowed)}", 422)


async def read_uploads(request: Request, limit: int, max_files: int = 1,
                       held: HeldBytes | None = None) -> list[bytes]:
    """The files of the multipart field ``image`` (1 to ``max_files``), from a body of at most ``limit`` bytes."""
    parser = MultiPartParser(request.headers, capped_body(request, limit, held), max_files=max_files, max_fields=10)
    try:
        async with body_deadline(held):
            form = await parser.parse()
    except MultiPartException as exc:
        if exc.message.startswith("Too many files"):  # starlette's words: more file parts than max_files
            raise QueryError(f"too many image files: at most {max_files} in one request", 422) from exc
        raise QueryError(f"malformed multipart upload: {exc.message}") from exc
    try:
        unknown = sorted(key for key in form if key != "image")
        if unknown:
            raise QueryError(
                f"unknown multipart field(s): {_names(unknown)}; the only field is 'image' (the file)", 422
            )
        uploads = form.getlist("image")
        if not uploads:
            raise QueryError("multipart upload has no field 'image'; send the file as image=@query.jpg")
        if not all(isinstance(upload, UploadFile) for upload in uploads):
            raise QueryError("the multipart field 'image' must be a file, not a text value")
        return [await upload.read() for upload in uploads]  # type: ignore[union-attr]
    finally:
        await form.close()
