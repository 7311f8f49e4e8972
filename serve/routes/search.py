"""POST /search and POST /search/batch: a query's body read within the caps and the body budget, parsed in the
parsing lane, answered in the searches, batches or reranks lane (a batch is charged its images and its texts' tokens
in images' worth, a re-ranked request that costs more than a search its queries times its method's work units, per
client too), dropped if the client goes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from retrieval.rerank import RerankConfig, RerankTooLarge, check_memory, work_units
from retrieval.serve.admission import BodyBudget, ClientWatch, HeldBytes, WorkLane
from retrieval.serve.bodies import read_body, read_uploads
from retrieval.serve.defaults import MAX_BATCH_QUERIES, RERANK_CHEAP_UNITS
from retrieval.serve.images import QueryError
from retrieval.serve.routes.context import Api, ApiLimits
from retrieval.serve.routes.queries import agreed, agreed_rerank, parse_batch_body, parse_search_body
from retrieval.serve.routes.responses import json_response
from retrieval.serve.routes.schemas import (
    DEFAULT_K,
    EXCLUDE_SELF_HELP,
    BatchSearchResponseModel,
    KParameter,
    RerankParameter,
    SearchResponseModel,
    WhereParameter,
    error_responses,
)
from retrieval.serve.service import SearchService
from retrieval.serve.service.answers import SearchResponse
from retrieval.serve.service.text import TextQuery, batch_text_work

SEARCH_PATH = "/search"
BATCH_PATH = "/search/batch"

router = APIRouter()


@contextlib.asynccontextmanager
async def body_held(bodies: BodyBudget) -> AsyncIterator[HeldBytes]:
    """This request's share of the body budget (taken by ``capped_body`` when its first bytes arrive), held until
    it is answered: the bodies read, parsed or waiting for a turn hold at most the budget together."""
    held = HeldBytes(bodies)
    try:
        yield held
    finally:
        await held.release()


async def answered(lane: WorkLane, request: Request, work: Any, *args: Any, cost: int = 1) -> Response:
    """``work(*args)`` (returning a Response, rendered in its thread) in ``lane``, dropped if the client goes."""
    watch = ClientWatch(request.receive).start()
    client = request.client.host if request.client is not None else None
    try:
        return await lane.run(work, *args, watch.gone, cost=cost, watch=watch, client=client)
    finally:
        watch.stop()


def reranked_lane(limits: ApiLimits, service: SearchService, rerank: RerankConfig | None,
                  queries: int) -> tuple[WorkLane, int] | None:
    """The reranks lane and the request's cost (its queries times its method's work units) for a re-ranking that
    costs more than a search; None for one as cheap as a search. A re-ranking over its memory bound is a 422 here,
    before the request waits for a turn."""
    if rerank is None:
        return None
    dim = service.current().dim
    try:
        check_memory(rerank, dim)
    except RerankTooLarge as exc:
        raise QueryError(str(exc), 422) from exc
    cost = queries * work_units(rerank, dim)
    return (limits.reranks, cost) if cost > RERANK_CHEAP_UNITS else None


def search_answer(service: SearchService, query: Any, k: int, exclude_self: bool, where: str | None,
                  rerank: RerankConfig | None, gone: threading.Event) -> Response:
    """One search's JSON answer, rendered in the worker thread that searched."""
    return json_response(service.search(query, k, (), exclude_self, where, rerank=rerank,
                                        cancelled=gone.is_set).to_dict())


def batch_answer(service: SearchService, queries: list[Any], k: int, exclude_self: bool, where: str | None,
                 rerank: RerankConfig | None, gone: threading.Event) -> Response:
    """A batch's JSON answer (an error entry in place of a query whose image could not be read), rendered in the
    worker thread that searched; the batch stops between images once the client has gone."""
    answers = service.search_batch(queries, k, exclude_self, where, cancelled=gone.is_set, rerank=rerank)
    queries.clear()  # the image bytes: not held while the answer is rendered
    return json_response({"count": len(answers), "results": [
        answer.to_dict() if isinstance(answer, SearchResponse) else {"error": str(answer), "status": answer.status}
        for answer in answers]})


# the request bodies name the index's dimension: retrieval.serve.routes.openapi adds them per app
@router.post(
    SEARCH_PATH,
    response_model=SearchResponseModel,
    responses=error_responses(400, 401, 403, 408, 413, 415, 422, 503),
)
async def search(
    request: Request,
    api: Api,
    k: KParameter = DEFAULT_K,
    exclude_self: Annotated[bool, Query(description=EXCLUDE_SELF_HELP)] = False,
    where: WhereParameter = None,
    rerank: RerankParameter = None,
) -> Any:
    """Top-k gallery images for an uploaded image, a base64 image, an embedding, or a text (what you are looking
    for, in words, where the server has a text model) (re-ranked with ``rerank``)."""
    content_type = request.headers.get("content-type", "").lower()
    if not content_type.startswith(("multipart/form-data", "application/json")):
        raise QueryError(
            "send multipart/form-data with a file field 'image', or application/json with "
            '"image" (base64), "embedding" or "text"',
            415,
        )
    limits, service = api.limits, api.service
    chosen = agreed_rerank(None, rerank)  # a bad method in the query is refused before reading a byte
    limits.searches.admit(1)  # refuse at once when the lane is full: before reading a byte
    async with body_held(limits.bodies) as held:
        if content_type.startswith("multipart/form-data"):
            query: Any = (await read_uploads(request, limits.body_limit, held=held))[0]
        else:
            body = await read_body(request, limits.body_limit, held)
            query, body_k, body_where, body_rerank = await limits.parsing.run(parse_search_body, body, service)
            del body
            where = agreed("where", body_where, where, where is not None)
            k = agreed("k", body_k, k, "k" in request.query_params)
            chosen = agreed_rerank(body_rerank, rerank)
        lane, cost = reranked_lane(limits, service, chosen, 1) or (limits.searches, 1)
        if isinstance(query, TextQuery):  # a long text costs several images: it waits in the batches lane
            work = await limits.parsing.run(batch_text_work, service.current().text.embedder, [query])
            if work > 1 and lane is limits.searches:
                lane, cost = limits.batches, work
        return await answered(lane, request, search_answer, service, query, k, exclude_self, where, chosen,
                              cost=cost)


@router.post(
    BATCH_PATH,
    response_model=BatchSearchResponseModel,
    responses=error_responses(400, 401, 403, 408, 413, 415, 422, 503),
)
async def search_batch(
    request: Request,
    api: Api,
    k: KParameter = DEFAULT_K,
    exclude_self: Annotated[bool, Query(description=f"{EXCLUDE_SELF_HELP}; for every image query of the batch "
                                        '(also accepted as JSON "exclude_self")')] = False,
    where: WhereParameter = None,
    rerank: RerankParameter = None,
) -> Any:
    """Top-k for each of up to MAX_BATCH_QUERIES images, embeddings or texts: the images are embedded in one model
    call, the texts in one call of the text model, and all queries searched at once. An image that cannot be read
    gets an error entry in its place."""
    content_type = request.headers.get("content-type", "").lower()
    if not content_type.startswith(("multipart/form-data", "application/json")):
        raise QueryError(
            "send multipart/form-data with the file field 'image' once per image, or application/json with "
            '{"queries": [{"image": BASE64} | {"embedding": [...]} | {"text": "..."}, ...]}',
            415,
        )
    limits, service = api.limits, api.service
    chosen = agreed_rerank(None, rerank)
    limits.batches.admit(1)
    async with body_held(limits.bodies) as held:
        if content_type.startswith("multipart/form-data"):
            queries: list[Any] = await read_uploads(request, limits.batch_body_limit, MAX_BATCH_QUERIES, held)
        else:
            body = await read_body(request, limits.batch_body_limit, held)
            queries, body_k, body_where, body_exclude, body_rerank = await limits.parsing.run(
                parse_batch_body, body, service)
            del body
            chosen = agreed_rerank(body_rerank, rerank)
            where = agreed("where", body_where, where, where is not None)
            k = agreed("k", body_k, k, "k" in request.query_params)
            exclude_self = agreed("exclude_self", body_exclude, exclude_self,
                                  "exclude_self" in request.query_params)
        # images, and texts by their tokens (in images' worth: a long text costs several images)
        embedded = sum(isinstance(query, (bytes, bytearray)) for query in queries)
        if any(isinstance(query, TextQuery) for query in queries):
            texts = await limits.parsing.run(batch_text_work, service.current().text.embedder, queries)
            embedded += texts
            if embedded > limits.batches.max_waiting:  # one batch never holds the lane longer than its queue does
                raise QueryError(f"this batch is too costly: its texts cost as much as {texts} images (its images "
                                 f"{embedded - texts}), and a batch may cost at most {limits.batches.max_waiting}; "
                                 "send fewer texts a batch, or shorter ones", 422)
        # a batch of embeddings alone is as cheap as a few searches: it does not wait behind image batches; a
        # costly re-ranking of embeddings waits behind neither, nor holds up either; a batch of images (or texts)
        # stays in the batches lane (its decoding bounded there), re-ranked in the same turn
        costly = reranked_lane(limits, service, chosen, len(queries))  # a 422 over the memory bound, first
        if embedded:
            lane, cost = limits.batches, embedded
        else:
            lane, cost = costly or (limits.searches, 1)
        return await answered(lane, request, batch_answer, service, queries, k, exclude_self, where, chosen,
                              cost=cost)
