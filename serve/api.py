"""The HTTP API (FastAPI): POST /search, GET /items/{id}, /items/{id}/image, /stats, /health.

Request bodies are read through a byte cap, so an oversized upload is refused (413) without being
stored; searches run in worker threads behind a capacity limiter (at most ``concurrency`` at once,
up to ``max_queue`` waiting, beyond that 503 with Retry-After).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from serve.defaults import MAX_K
from serve.images import QueryError, decode_base64
from serve.service import SearchService

FORM_SLACK = 64 * 1024  # multipart boundaries and headers, JSON punctuation


def _too_large(limit: int) -> QueryError:
    return QueryError(
        f"request body is over the limit of {limit} bytes; send a smaller image "
        "(or start the server with a larger --max-upload-mb)",
        413,
    )


async def capped_body(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The request body, chunk by chunk; 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(limit)
        yield chunk


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    body = b"".join([chunk async for chunk in capped_body(request, limit)])
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise QueryError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise QueryError('the JSON body must be an object: {"image": BASE64} or {"embedding": [...]}')
    return payload


async def read_upload(request: Request, limit: int) -> bytes:
    parser = MultiPartParser(request.headers, capped_body(request, limit), max_files=1, max_fields=10)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise QueryError(f"malformed multipart upload: {exc.message}") from exc
    try:
        upload = form.get("image")
        if upload is None:
            raise QueryError("multipart upload has no field 'image'; send the file as image=@query.jpg")
        if not isinstance(upload, UploadFile):
            raise QueryError("the multipart field 'image' must be a file, not a text value")
        return await upload.read()
    finally:
        await form.close()


def create_api(service: SearchService, concurrency: int = 8, max_queue: int = 64) -> FastAPI:
    app = FastAPI(title="retrieval search", summary="Image retrieval over a faiss index", version="1")
    limiter = anyio.CapacityLimiter(concurrency)
    body_limit = service.max_upload_bytes * 4 // 3 + FORM_SLACK  # base64 inflates by 4/3

    @app.exception_handler(QueryError)
    async def query_error(_: Request, exc: QueryError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    async def in_worker(fn, *args):
        if limiter.available_tokens == 0 and limiter.statistics().tasks_waiting >= max_queue:
            return JSONResponse(
                {"detail": f"server busy: {max_queue} searches already waiting; retry shortly"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    @app.post(
        "/search",
        openapi_extra={
            "requestBody": {
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "properties": {"image": {"type": "string", "format": "binary"}},
                            "required": ["image"],
                        }
                    },
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {
                                "image": {
                                    "type": "string",
                                    "description": "base64 image file (or a data: URL)",
                                },
                                "embedding": {"type": "array", "items": {"type": "number"}},
                            },
                        }
                    },
                }
            }
        },
    )
    async def search(request: Request, k: int = Query(10, ge=1, le=MAX_K)) -> Any:
        """Top-k gallery images for an uploaded image, a base64 image, or an embedding."""
        content_type = request.headers.get("content-type", "").lower()
        if content_type.startswith("multipart/form-data"):
            query: Any = await read_upload(request, body_limit)
        elif content_type.startswith("application/json"):
            payload = await read_json(request, body_limit)
            if "embedding" in payload:
                query = payload["embedding"]  # checked by the service (422 for a wrong shape)
                if isinstance(query, str):
                    raise QueryError("'embedding' must be a list of numbers, not a string", 422)
            elif "image" in payload:
                query = decode_base64(payload["image"], service.max_upload_bytes)
            else:
                raise QueryError(
                    'the JSON body needs "image" (base64 image file) or "embedding" (list of numbers)'
                )
        else:
            raise QueryError(
                "send multipart/form-data with a file field 'image', or application/json with "
                '"image" (base64) or "embedding"',
                415,
            )
        response = await in_worker(service.search, query, k)
        return response if isinstance(response, JSONResponse) else response.to_dict()

    def item_or_404(item_id: str) -> dict[str, Any]:
        # ASCII digits only, and within SQLite's integer range: anything else is simply not an id (404)
        is_id = item_id.isascii() and item_id.isdigit() and len(item_id) <= 18
        row = service.item(int(item_id)) if is_id else None
        if row is None:
            raise QueryError(f"no indexed image with id {item_id!r}", 404)
        return row

    @app.get("/items/{item_id}")
    def item(item_id: str) -> dict[str, Any]:
        """The catalogue row of an indexed image."""
        return item_or_404(item_id) | {"image_url": f"/items/{item_id}/image"}

    @app.get("/items/{item_id}/image")
    def item_image(item_id: str) -> FileResponse:
        """The image file itself; only files of indexed catalogue rows are ever served."""
        row = item_or_404(item_id)
        path = service.image_path(row["id"])
        if path is None:
            raise QueryError(f"image {item_id} is catalogued but its file is gone or not an image file", 404)
        return FileResponse(path)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Index statistics (size, type, parameters, recall vs exact search, latency) and service counters."""
        index = await anyio.to_thread.run_sync(service.index_stats)
        return {
            "service": service.describe(),
            "batcher": service.batcher.stats(),
            "index": index,
            "limits": {
                "max_upload_bytes": service.max_upload_bytes,
                "max_pixels": service.max_pixels,
                "max_k": MAX_K,
                "concurrency": concurrency,
                "max_queue": max_queue,
            },
        }

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "vectors": len(service), "embedding_dim": service.dim}

    return app
