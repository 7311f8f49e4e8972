"""What the API's routes share: ``ApiContext`` on ``app.state.api``, handed to a route by the ``Api`` dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from retrieval.serve.admission import BodyBudget, WorkLane
from retrieval.serve.bodies import FORM_SLACK
from retrieval.serve.defaults import (
    BATCH_CONCURRENCY,
    BATCH_QUEUE_IMAGES,
    BODY_BUDGET_BYTES,
    BODY_READ_TIMEOUT_S,
    MAX_BATCH_QUERIES,
    RERANK_CLIENT_UNITS,
    RERANK_CONCURRENCY,
    RERANK_QUEUE_UNITS,
)
from retrieval.serve.service import SearchService
from retrieval.serve.service.checks import batch_upload_bytes

PARSE_CONCURRENCY = 2  # JSON bodies parsed at once (each within the body budget)
SUMMARY_QUEUE = 8  # GET /stats waiting for the one thread that computes the index's summary


class ApiLimits:
    """What the API lets in at once (docs/SECURITY.md "Availability"): the lanes and the body budget."""

    def __init__(self, service: SearchService, concurrency: int, max_queue: int,
                 batch_concurrency: int = BATCH_CONCURRENCY, batch_queue_images: int = BATCH_QUEUE_IMAGES,
                 body_budget_bytes: int = BODY_BUDGET_BYTES, body_timeout_s: float = BODY_READ_TIMEOUT_S) -> None:
        self.body_limit = service.max_upload_bytes * 4 // 3 + FORM_SLACK  # base64 inflates by 4/3
        self.batch_body_limit = batch_upload_bytes(service.max_upload_bytes) * 4 // 3 + FORM_SLACK
        self.bodies = BodyBudget(max(body_budget_bytes, self.batch_body_limit), read_timeout_s=body_timeout_s)
        self.searches = WorkLane("searches", concurrency, max_queue)
        self.batches = WorkLane("batches", batch_concurrency, max(batch_queue_images, MAX_BATCH_QUERIES), "images")
        self.reranks = WorkLane("reranks", RERANK_CONCURRENCY, RERANK_QUEUE_UNITS, "work units",
                                max_per_client=RERANK_CLIENT_UNITS)  # re-ranked requests that cost more than a search
        self.parsing = WorkLane("parsing", PARSE_CONCURRENCY, max_queue, "bodies")
        self.summaries = WorkLane("summaries", 1, SUMMARY_QUEUE, "requests")  # /stats: computed once per state

    def stats(self) -> dict[str, Any]:
        """The lanes and the body budget now (GET /stats)."""
        return {"searches": self.searches.stats(), "batches": self.batches.stats(), "reranks": self.reranks.stats(),
                "body_bytes_held": self.bodies.held, "body_bytes_budget": self.bodies.total}


@dataclass(frozen=True)
class ApiContext:
    """One app's shared state: the service it answers from, what it lets in at once, and its settings."""

    service: SearchService
    limits: ApiLimits  # its searches lane holds the concurrency and queue GET /stats reports


def attach(app: Any, context: ApiContext) -> None:
    """Keep ``context`` on ``app.state`` for the routes (``limits`` too: what tests and operators look at)."""
    app.state.api = context
    app.state.limits = context.limits


async def api_context(request: Request) -> ApiContext:
    """The context of the app that received ``request`` (async: answered on the event loop, never waiting for a
    worker thread, so a full thread pool cannot delay a lane's refusal)."""
    return request.app.state.api


Api = Annotated[ApiContext, Depends(api_context)]
