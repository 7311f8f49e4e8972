"""GET /stats and /health: what the server searches now, each answer from one state of the index."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from retrieval.index.search import MAX_K
from retrieval.serve.defaults import MAX_BATCH_QUERIES
from retrieval.serve.routes.context import Api
from retrieval.serve.routes.schemas import HealthModel, StatsModel, error_responses
from retrieval.serve.service import SearchService
from retrieval.serve.service.checks import batch_upload_bytes

router = APIRouter()


def state_summary(service: SearchService) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The served index and model, the index's statistics and the model's batcher counters, all of one state
    (held throughout: a reload meanwhile changes none of them)."""
    with service.acquire() as state:
        described, index = service.public_stats(state)
        return described, index, state.batcher.stats()


@router.get("/stats", response_model=StatsModel, responses=error_responses(401, 403, 503))
async def stats(api: Api) -> dict[str, Any]:
    """Index statistics (size, type, parameters, recall vs exact search, latency) and service counters."""
    service = api.service
    described, index, batcher = await api.limits.summaries.run(state_summary, service)
    return {
        "service": described,
        "batcher": batcher,
        "index": index,
        "admission": api.limits.stats(),
        "limits": {
            "max_upload_bytes": service.max_upload_bytes,
            "max_pixels": service.max_pixels,
            "max_k": MAX_K,
            "max_batch_queries": MAX_BATCH_QUERIES,
            "max_batch_upload_bytes": batch_upload_bytes(service.max_upload_bytes),
            "concurrency": api.limits.searches.concurrency,
            "max_queue": api.limits.searches.max_waiting,
        },
    }


@router.get("/health", response_model=HealthModel, responses=error_responses(403, 503))
async def health(api: Api) -> dict[str, Any]:
    """Whether searches work now (503 while a served Milvus collection cannot be reached or loaded), the number of
    vectors the server searches (it follows the index's writers) and their dimension."""
    if api.service.current().index.remote:  # asked over the network: never on the event loop
        return {"status": "ok", **await run_in_threadpool(api.service.health)}
    return {"status": "ok", **api.service.health()}
