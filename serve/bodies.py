"""Reading request bodies of untrusted size and shape: bytes through a cap, JSON checked before it is parsed.

Contract: ``read_body`` and ``read_uploads`` run on the event loop and only move bytes (through ``limit``: 413 as
soon as a body is over it). ``parse_json_object`` is CPU work that grows with the body, so callers run it in a
thread: it first measures the body's skeleton (strings removed: how many values, how deeply nested) against the
caller's bounds, refusing a body of a million empty arrays before ``json.loads`` allocates them, then parses it.
Numbers are refused past ``MAX_NUMBER_CHARS`` characters (Python's integer parser would raise on 4,300 digits).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from retrieval.serve.images import QueryError

FORM_SLACK = 64 * 1024  # multipart boundaries and headers, JSON punctuation
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # one JSON string, escapes included (no backtracking)
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


async def capped_body(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body, chunk by chunk; 413 as soon as it exceeds ``limit`` bytes."""
    declared = declared_length(request)
    if declared is not None and declared > limit:
        raise too_large(limit)
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise too_large(limit)
        yield chunk


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of at most ``limit`` bytes (only bytes moved: parse it off the event loop)."""
    return b"".join([chunk async for chunk in capped_body(request, limit)])


def json_values(skeleton: bytes) -> int:
    """How many values a JSON text without its strings holds at most: its commas and openings, plus one."""
    return skeleton.count(b",") + skeleton.count(b"[") + skeleton.count(b"{") + 1


def json_depth(skeleton: bytes, max_brackets: int) -> int:
    """The deepest nesting of brackets among the first ``max_brackets`` of a JSON text without its strings (memory:
    four bytes per bracket looked at)."""
    brackets = np.frombuffer(skeleton.translate(None, BRACKETS)[:max_brackets], dtype=np.uint8)
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


def parse_json_object(body: bytes, max_values: int, max_depth: int, shape: str) -> dict[str, Any]:
    """The JSON object of ``body``, refused before parsing when it holds more than ``max_values`` values or nests
    deeper than ``max_depth``; ``shape`` says what the object should look like. CPU work: call it off the loop."""
    skeleton = JSON_STRING.sub(b'""', body)  # linear, in C; strings cannot hide brackets or commas then
    values, depth = json_values(skeleton), json_depth(skeleton, 2 * max_values + 2)
    del skeleton
    if depth > max_depth:
        raise QueryError(f"the JSON body is nested too deeply ({depth} levels or more; this request has at most "
                         f"{max_depth}); send a flat object: {shape}")
    if values > max_values:
        raise QueryError(f"the JSON body holds about {values} values, more than this request can use "
                         f"({max_values}); send {shape}", 413)
    try:
        payload = json.loads(body, parse_int=_bounded_int, parse_float=_bounded_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QueryError(f"the body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # a skeleton the counts missed (it cannot be: kept as the last guard)
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


async def read_uploads(request: Request, limit: int, max_files: int = 1) -> list[bytes]:
    """The files of the multipart field ``image`` (1 to ``max_files``), from a body of at most ``limit`` bytes."""
    parser = MultiPartParser(request.headers, capped_body(request, limit), max_files=max_files, max_fields=10)
    try:
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
