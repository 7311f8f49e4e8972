"""How the API answers: JSON rendered in the worker thread that computed it, files streamed in chunks, and every
error as ``{"detail": "message"}`` (the handlers ``install_error_handlers`` adds)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import IO, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from retrieval.index.milvus.milvus_client import MilvusUnavailable
from retrieval.serve.admission import CLIENT_CLOSED, Busy, ClientGone
from retrieval.serve.images import QueryError

FILE_CHUNK = 64 * 1024


def json_response(content: Any, status_code: int = 200) -> Response:
    """``content`` as a JSON response, rendered where this is called (a worker thread: a large answer is
    megabytes of text, never rendered on the event loop)."""
    return Response(json.dumps(content, separators=(",", ":"), default=_plain_number).encode(),
                    status_code=status_code, media_type="application/json")


def _plain_number(value: Any) -> Any:
    if hasattr(value, "item"):  # a NumPy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def busy_response(exc: Busy) -> JSONResponse:
    """The 503 of work the server cannot take now."""
    return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after_s)})


def file_chunks(handle: IO[bytes]) -> Iterator[bytes]:
    """An open file's bytes in ``FILE_CHUNK`` pieces, closed once read (or once the response is dropped)."""
    with handle:
        while chunk := handle.read(FILE_CHUNK):
            yield chunk


def validation_message(exc: RequestValidationError) -> str:
    """FastAPI's list of validation errors as one sentence per problem."""
    problems = []
    for error in exc.errors()[:5]:
        where = " ".join(str(part) for part in error.get("loc", ()))
        given = f" (got {json.dumps(error['input'], default=str)[:40]})" if "input" in error else ""
        problems.append(f"{where}: {error.get('msg', 'invalid')}{given}")
    return "; ".join(problems)


def install_error_handlers(app: FastAPI) -> None:
    """Answer the API's exceptions as their statuses: a ``QueryError`` with its own, validation 422, ``Busy`` and an
    unreachable Milvus 503 with Retry-After, a client gone before its answer 499 (for the access log and the
    metrics: nobody reads it)."""

    @app.exception_handler(QueryError)
    async def query_error(_: Request, exc: QueryError) -> JSONResponse:
        headers = None if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse({"detail": str(exc)}, status_code=exc.status, headers=headers)

    @app.exception_handler(MilvusUnavailable)
    async def milvus_unavailable(_: Request, exc: MilvusUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": str(exc.retry_after_s)})

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_message(exc)}, status_code=422)

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return busy_response(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: for the access log and the metrics
