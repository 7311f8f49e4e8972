"""The HTTP API (FastAPI): POST /search, POST /search/batch, GET /items/{id}, /items/{id}/image, /stats, /health,
/metrics.

Request bodies are read through a byte cap, so an oversized upload is refused (413) without being
stored; searches run in worker threads behind a capacity limiter (at most ``concurrency`` at once,
up to ``max_queue`` waiting, beyond that 503 with Retry-After). Every error is ``{"detail": "message"}``,
and the OpenAPI document (``/openapi.json``, ``/docs``, ``/redoc``, assets served from here) declares each
status a route answers with.

POST /search/batch takes 1 to ``MAX_BATCH_QUERIES`` queries (the multipart field ``image`` repeated, or JSON
``{"queries": [...]}``) and answers ``{"count": n, "results": [...]}``, one entry per query in order; its rules live
in ``SearchService.search_batch``: a malformed request (or embedding, k, where) refuses the whole batch, a query
whose image cannot be read gets ``{"error", "status"}`` in its place. Its body cap is the per-image limit for every
query, capped (``batch_upload_bytes``).

A query may be words too (JSON ``{"text": "a red apple"}``, in a batch as in one search) where the server has a text
model (``--text-model``, or the one the index records): embedded by it, then searched as an embedding is; the
OpenAPI document offers "text" only while it has one.

The routes live in ``retrieval.serve.routes``, one router per resource (search, items, status); they share one
``ApiContext`` (the service, the lanes and body budget, the settings) through the ``Api`` dependency.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from retrieval.serve.defaults import (
    API_DOCS_PATH,
    BATCH_CONCURRENCY,
    BATCH_QUEUE_IMAGES,
    BODY_BUDGET_BYTES,
    BODY_READ_TIMEOUT_S,
)
from retrieval.serve.observability import install_observability
from retrieval.serve.routes import items, search, status
from retrieval.serve.routes.context import ApiContext, ApiLimits, attach
from retrieval.serve.routes.openapi import install_openapi
from retrieval.serve.routes.responses import install_error_handlers
from retrieval.serve.routes.schemas import error_responses
from retrieval.serve.service import SearchService

DOCS_ASSETS = "/docs-assets"  # Swagger UI and ReDoc files, served from the fastapi-offline package
ROUTERS = (search.router, items.router, status.router)  # in this order in the OpenAPI document


def create_api(service: SearchService, concurrency: int = 8, max_queue: int = 64, observe: bool = True,
               batch_concurrency: int = BATCH_CONCURRENCY, batch_queue_images: int = BATCH_QUEUE_IMAGES,
               body_budget_bytes: int = BODY_BUDGET_BYTES, body_timeout_s: float = BODY_READ_TIMEOUT_S) -> FastAPI:
    """The JSON API over ``service``: single searches in ``concurrency`` threads of their own (``max_queue``
    waiting), batches in ``batch_concurrency`` others (``batch_queue_images`` images waiting), request bodies
    within ``body_budget_bytes`` together, each arriving within ``body_timeout_s``; /health and /metrics answer on
    the event loop."""
    app = FastAPIOffline(
        title="retrieval search",
        summary="Image retrieval over a faiss index",
        version="1",
        static_url=DOCS_ASSETS,
        docs_url=API_DOCS_PATH,
    )
    limits = ApiLimits(service, concurrency, max_queue, batch_concurrency, batch_queue_images, body_budget_bytes,
                       body_timeout_s)
    attach(app, ApiContext(service, limits))
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    # whether text queries are offered: asked of the state served when the document is asked for
    install_openapi(app, service.current().dim, lambda: service.text_search())
    if observe:  # GET /metrics, request metrics and the access log (serve/observability.py)
        install_observability(app, service, error_responses(401, 403))
    return app
