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
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import IO, Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParameter
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, Field

from retrieval.index.filters import MAX_FILTER_CHARS
from retrieval.index.search import MAX_K, check_k
from retrieval.serve.admission import CLIENT_CLOSED, BodyBudget, Busy, ClientGone, ClientWatch, HeldBytes, WorkLane
from retrieval.serve.bodies import (
    FORM_SLACK,
    check_keys,
    parse_json_object,
    read_body,
    read_uploads,
)
from retrieval.serve.defaults import (
    API_DOCS_PATH,
    BATCH_CONCURRENCY,
    BATCH_QUEUE_IMAGES,
    BODY_BUDGET_BYTES,
    BODY_READ_TIMEOUT_S,
    MAX_BATCH_QUERIES,
)
from retrieval.serve.images import QueryError, decode_base64
from retrieval.serve.observability import install_observability
from retrieval.serve.service import (
    IMAGE_MEDIA_TYPES,
    SearchResponse,
    SearchService,
    batch_upload_bytes,
    check_batch_size,
)

DEFAULT_K = 10
MAX_SEARCH_DEPTH = 4  # {"embedding": [...]} is 2 deep: room to name a nested list in an embedding
MAX_BATCH_DEPTH = 6  # {"queries": [{"embedding": [...]}]} is 4 deep
PARSE_CONCURRENCY = 2  # JSON bodies parsed at once (each within the body budget)
SUMMARY_QUEUE = 8  # GET /stats waiting for the one thread that computes the index's summary
QUERY_KEYS = ("image", "embedding")  # one query: exactly one of these
JSON_KEYS = (*QUERY_KEYS, "k", "where")  # the keys a JSON search body may have
BATCH_KEYS = ("queries", "k", "where", "exclude_self")  # the keys a JSON batch body may have
EXCLUDE_SELF_HELP = ("leave out the gallery item whose file has exactly the query's bytes (query_item), as the app "
                     "does for a query picked from the gallery; image queries only")
WHERE_HELP = ('a filter on the catalogue\'s columns (id, path, label and a manifest\'s own columns such as split), '
              'e.g. label = "cat" and price < 20: = != < <= > >=, in (...), not in (...), and, or, not, '
              'parentheses, quoted strings and numbers; only matching images are searched, and none matching gives '
              'no results')
FLOAT64_MAX = 1.7976931348623157e308
ItemId = Annotated[str, PathParameter(description="catalogue id of an indexed image (search results give it)",
                                      examples=["1"])]
FILE_CHUNK = 64 * 1024
# the query-string parameters of POST /search and /search/batch (k's range is checked by check_k, documented here)
KParameter = Annotated[int, Query(description="number of results (also accepted as JSON \"k\")",
                                  json_schema_extra={"minimum": 1, "maximum": MAX_K})]
WhereParameter = Annotated[str | None, Query(description=f"{WHERE_HELP} (also accepted as JSON \"where\")",
                                             json_schema_extra={"minLength": 1, "maxLength": MAX_FILTER_CHARS})]
IMAGE_TYPES = ", ".join(dict.fromkeys(IMAGE_MEDIA_TYPES.values()))  # the media types an image upload may have
DOCS_ASSETS = "/docs-assets"  # Swagger UI and ReDoc files, served from the fastapi-offline package


# --- the documented shapes -------------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    """Every error response: what is wrong and how to fix it."""

    detail: str = Field(description="what is wrong with the request and what to do instead")


ERROR_STATUSES = {
    400: "Malformed request: invalid JSON or multipart, invalid base64, or a file that is not a readable image "
    "(or a possible decompression bomb)",
    401: "This server requires an API token (it was started with --token-file or RETRIEVAL_API_TOKEN) and the "
    "request has none or a wrong one: send `Authorization: Bearer <token>`",
    403: "Cross-origin request refused: the Origin header names neither this server nor a --cors-origin",
    404: "No indexed image with this id, or its file is gone or was replaced (then it is not served)",
    408: "The request body took too long to arrive",
    413: "The request body or the image is over the upload limit (for a batch: the per-image limit for each of "
    f"{MAX_BATCH_QUERIES} images, capped; see /stats limits)",
    415: "Neither multipart/form-data nor application/json",
    422: "Well-formed but invalid: k out of range, unknown JSON keys or form fields, image and embedding together, "
    "an embedding of the wrong length, with non-numbers, non-finite numbers or all zeros, a malformed where, "
    "a JSON body of more values than the request can use or numbers of over 1,000 characters, "
    f"a batch of no queries or more than {MAX_BATCH_QUERIES}",
    503: "Too many searches (or image batches) already waiting, or too many request bytes held at once; retry after "
    "the Retry-After seconds",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses, all with the ``{"detail": str}`` body."""
    return {status: {"model": ErrorDetail, "description": ERROR_STATUSES[status]} for status in statuses}


class Result(BaseModel):
    id: int = Field(description="catalogue id (GET /items/{id})")
    path: str = Field(description="the image's path relative to the gallery root")
    name: str = Field(description="the image's file name, as the app captions it (no folders)")
    label: str | None = Field(description="its label (class folder or manifest label), if any")
    score: float = Field(ge=-1, le=1, description="cosine similarity to the query")
    image_url: str = Field(description="where to fetch the image file")


class QueryItemModel(BaseModel):
    """The gallery item whose file has exactly the query's bytes."""

    id: int
    path: str = Field(description="relative to the gallery root")
    name: str = Field(description="the image's file name, as the app captions it (no folders)")
    label: str | None
    image_url: str


class SearchResponseModel(BaseModel):
    k: int = Field(description="the k asked for (fewer results when the gallery is smaller)")
    count: int = Field(description="number of results")
    results: list[Result] = Field(description="best first")
    query_item: QueryItemModel | None = Field(
        description="for an image query: the gallery item with identical file bytes (sha256), else null"
    )
    excluded_self: bool = Field(description="true when query_item was left out of the results (exclude_self)")
    notes: list[str] = Field(
        description="notes on how the query was read, e.g. that an animated image was searched by one of its "
        "frames; empty when there is nothing to note"
    )
    timing: dict[str, float] = Field(description="milliseconds per stage (decode, preprocess, embed, search, total) "
                                     "and the model batch size")


class BatchQueryErrorModel(BaseModel):
    """A query of a batch that could not be answered (its image could not be read); the others are answered."""

    error: str = Field(description="what is wrong with this query")
    status: int = Field(ge=400, le=499, description="the HTTP status POST /search would answer it with")


class BatchSearchResponseModel(BaseModel):
    count: int = Field(description="number of queries (and of entries in results)")
    results: list[SearchResponseModel | BatchQueryErrorModel] = Field(
        description="one entry per query, in the order sent: a search response, or an error for a query whose "
        "image could not be read"
    )


class ItemModel(BaseModel):
    id: int
    path: str = Field(description="relative to the gallery root")
    name: str = Field(description="the image's file name, as the app captions it (no folders)")
    label: str | None
    sha256: str | None = Field(description="sha256 of the file's bytes, hex")
    size: int | None = Field(description="file size in bytes")
    image_url: str


class HealthModel(BaseModel):
    status: Literal["ok"]
    vectors: int
    embedding_dim: int


class LimitsModel(BaseModel):
    max_upload_bytes: int
    max_pixels: int
    max_k: int
    max_batch_queries: int = Field(description="queries in one POST /search/batch")
    max_batch_upload_bytes: int = Field(description="image bytes in one POST /search/batch, all images together")
    concurrency: int
    max_queue: int


class StatsModel(BaseModel):
    service: dict[str, Any] = Field(description="the index and model being served (names, not server paths)")
    batcher: dict[str, Any] = Field(description="model calls and how many requests shared them")
    index: dict[str, Any] = Field(description="size, type, parameters, recall vs exact search, latency")
    admission: dict[str, Any] = Field(description="searches and batches running and waiting, request bytes held")
    limits: LimitsModel


def query_properties(dim: int) -> dict[str, Any]:
    """The JSON schema properties of one query, "image" or "embedding" (POST /search and each batch query)."""
    return {
        "image": {
            "type": "string",
            "minLength": 1,
            "description": f"an image file ({IMAGE_TYPES}) in base64, or as a data: URL",
        },
        "embedding": {
            "type": "array",
            "description": f"a query embedding: {dim} finite numbers, not all zero (any magnitude: "
            "only its direction counts)",
            "items": {"type": "number", "minimum": -FLOAT64_MAX, "maximum": FLOAT64_MAX},
            "minItems": dim,
            "maxItems": dim,
            "contains": {"not": {"const": 0}},
        },
    }


ONE_QUERY = [{"required": ["image"]}, {"required": ["embedding"]}]
K_PROPERTY = {"type": "integer", "minimum": 1, "maximum": MAX_K, "description": "number of results"}
WHERE_PROPERTY = {"type": "string", "minLength": 1, "maxLength": MAX_FILTER_CHARS, "description": WHERE_HELP}


def multipart_body(files: dict[str, Any]) -> dict[str, Any]:
    """The multipart/form-data part of a request body whose only field is ``image``, described by ``files``."""
    return {
        "schema": {"type": "object", "properties": {"image": files}, "required": ["image"],
                   "additionalProperties": False},
        "encoding": {"image": {"contentType": IMAGE_TYPES}},
    }


def search_request_body(dim: int) -> dict[str, Any]:
    """The OpenAPI request body of POST /search: an image file upload, or a JSON object."""
    return {
        "required": True,
        "content": {
            "multipart/form-data": multipart_body({"type": "string", "format": "binary",
                                                   "description": "the image file"}),
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": 'exactly one of "image" and "embedding"; "k" here and in the query must agree',
                    "properties": query_properties(dim) | {"k": K_PROPERTY, "where": WHERE_PROPERTY},
                    "additionalProperties": False,
                    "oneOf": ONE_QUERY,
                }
            },
        },
    }


def batch_request_body(dim: int) -> dict[str, Any]:
    """The OpenAPI request body of POST /search/batch: several image files, or a JSON list of queries."""
    return {
        "required": True,
        "content": {
            "multipart/form-data": multipart_body({
                "type": "array", "minItems": 1, "maxItems": MAX_BATCH_QUERIES,
                "items": {"type": "string", "format": "binary"},
                "description": f"the image files: the field 'image' repeated, 1 to {MAX_BATCH_QUERIES} times",
            }),
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": '"k", "where" and "exclude_self" apply to every query; here and in the query '
                    "they must agree",
                    "properties": {
                        "queries": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": MAX_BATCH_QUERIES,
                            "description": f"1 to {MAX_BATCH_QUERIES} queries, each exactly one of \"image\" and "
                            '"embedding"',
                            "items": {"type": "object", "properties": query_properties(dim),
                                      "additionalProperties": False, "oneOf": ONE_QUERY},
                        },
                        "k": K_PROPERTY,
                        "where": WHERE_PROPERTY,
                        "exclude_self": {"type": "boolean", "description": EXCLUDE_SELF_HELP},
                    },
                    "required": ["queries"],
                    "additionalProperties": False,
                }
            },
        },
    }


# --- reading bodies ---------------------------------------------------------------------------------------
def body_k_and_where(payload: dict[str, Any]) -> tuple[int | None, str | None]:
    """A JSON body's ``k`` (checked by ``check_k``) and ``where`` (a string), None where absent."""
    k = payload.get("k")
    if isinstance(k, float) and k.is_integer():  # JSON has one number type: 5.0 is the integer 5
        k = int(k)
    if "k" in payload:
        try:
            k = check_k(k, name='"k"')
        except ValueError as exc:
            raise QueryError(str(exc), 422) from exc
    where = payload.get("where")
    if where is not None and not isinstance(where, str):
        raise QueryError('"where" must be a string expression, e.g. "label = \'cat\'"', 422)
    return k, where


def query_entry(entry: dict[str, Any], subject: str = "the JSON body") -> tuple[str, Any]:
    """One JSON query: ``("image", base64 text)`` or ``("embedding", the list, checked by the service)``."""
    if "image" in entry and "embedding" in entry:
        raise QueryError(f'{subject}: send either "image" or "embedding" in one search, not both', 422)
    if "embedding" in entry:
        return "embedding", entry["embedding"]  # checked by the service (422 for anything but d finite numbers)
    if "image" in entry:
        if not isinstance(entry["image"], str):
            raise QueryError(f"{subject}: 'image' must be a string: the image file in base64 (or a data: URL)", 422)
        return "image", entry["image"]
    raise QueryError(f'{subject} needs "image" (base64 image file) or "embedding" (list of numbers)', 422)


def json_query(payload: dict[str, Any], service: SearchService) -> tuple[Any, int | None, str | None]:
    """The query (image bytes or embedding list), the body's ``k`` and ``where`` (None if absent) of a JSON body."""
    check_keys(payload, JSON_KEYS)
    kind, value = query_entry(payload)
    k, where = body_k_and_where(payload)
    return (decode_base64(value, service.max_upload_bytes) if kind == "image" else value), k, where


def batch_json(
    payload: dict[str, Any], service: SearchService
) -> tuple[list[Any], int | None, str | None, bool | None]:
    """The queries, ``k``, ``where`` and ``exclude_self`` (None if absent) of a JSON batch body.

    A query is image bytes, an embedding list, or the ``QueryError`` of an image that is not valid base64 (or too
    large): that query alone is answered by its error. Anything else malformed refuses the batch (422).
    """
    check_keys(payload, BATCH_KEYS)
    queries = payload.get("queries")
    if not isinstance(queries, list):
        raise QueryError('the JSON body needs "queries": a list of {"image": BASE64} or {"embedding": [...]}', 422)
    check_batch_size(len(queries))  # before decoding any of them
    parsed: list[Any] = []
    for position, entry in enumerate(queries):
        subject = f"queries[{position}]"
        if not isinstance(entry, dict):
            raise QueryError(f'{subject} must be an object: {{"image": BASE64}} or {{"embedding": [...]}}', 422)
        check_keys(entry, QUERY_KEYS, subject)
        kind, value = query_entry(entry, subject)
        entry.clear()  # its base64 text is decoded below: held once, not twice, while the batch waits
        if kind == "image" and not value:  # the schema's minLength: the request is malformed, not one query
            raise QueryError(f"{subject}: 'image' is empty; send the image file in base64", 422)
        if kind == "image":
            try:
                value = decode_base64(value, service.max_upload_bytes)
            except QueryError as exc:  # this query's own problem: answered in its place
                value = exc
        parsed.append(value)
    k, where = body_k_and_where(payload)
    exclude_self = payload.get("exclude_self")
    if exclude_self is not None and not isinstance(exclude_self, bool):
        raise QueryError('"exclude_self" must be true or false', 422)
    return parsed, k, where, exclude_self


def agreed(name: str, body: Any, query: Any, in_query: bool) -> Any:
    """A parameter the JSON body and the query string may both give: the body's, if given, must equal the query's."""
    if body is None:
        return query
    if in_query and body != query:
        raise QueryError(f'"{name}" differs between the JSON body and the query: {json.dumps(body)[:60]} in the JSON '
                         f"body but {json.dumps(query)[:60]} in the query; send one", 422)
    return body


def file_chunks(handle: IO[bytes]) -> Iterator[bytes]:
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


# --- the app ----------------------------------------------------------------------------------------------
def search_value_bound(dim: int) -> int:
    """The JSON values one search body may hold: an embedding of ``dim`` numbers, each perhaps a (refused) list,
    and the keys around it."""
    return 2 * dim + 64


def parse_search_body(body: bytes, service: SearchService) -> tuple[Any, int | None, str | None]:
    """A JSON search body -> ``json_query``'s query, ``k`` and ``where``; CPU work (run off the event loop)."""
    payload = parse_json_object(body, search_value_bound(service.dim), MAX_SEARCH_DEPTH,
                                '{"image": BASE64} or {"embedding": [...]}')
    return json_query(payload, service)


def parse_batch_body(body: bytes, service: SearchService) -> tuple[list[Any], int | None, str | None, bool | None]:
    """A JSON batch body -> ``batch_json``'s queries, ``k``, ``where``, ``exclude_self``; CPU work (off the loop)."""
    payload = parse_json_object(body, MAX_BATCH_QUERIES * search_value_bound(service.dim), MAX_BATCH_DEPTH,
                                '{"queries": [{"image": BASE64} | {"embedding": [...]}, ...]}')
    return batch_json(payload, service)


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
        self.parsing = WorkLane("parsing", PARSE_CONCURRENCY, max_queue, "bodies")
        self.summaries = WorkLane("summaries", 1, SUMMARY_QUEUE, "requests")  # /stats: computed once per state

    def stats(self) -> dict[str, Any]:
        """The lanes and the body budget now (GET /stats)."""
        return {"searches": self.searches.stats(), "batches": self.batches.stats(),
                "body_bytes_held": self.bodies.held, "body_bytes_budget": self.bodies.total}


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
    app.state.limits = limits

    @app.exception_handler(QueryError)
    async def query_error(_: Request, exc: QueryError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_message(exc)}, status_code=422)

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        return busy_response(exc)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=CLIENT_CLOSED)  # nobody reads it: for the access log and the metrics

    @contextlib.asynccontextmanager
    async def body_held() -> AsyncIterator[HeldBytes]:
        """This request's share of the body budget (taken by ``capped_body`` when its first bytes arrive), held until
        it is answered: the bodies read, parsed or waiting for a turn hold at most the budget together."""
        held = HeldBytes(limits.bodies)
        try:
            yield held
        finally:
            await held.release()

    async def answered(lane: WorkLane, request: Request, work: Any, *args: Any, cost: int = 1) -> Response:
        """``work(*args)`` (returning a Response, rendered in its thread) in ``lane``, dropped if the client goes."""
        watch = ClientWatch(request.receive).start()
        try:
            return await lane.run(work, *args, watch.gone, cost=cost, watch=watch)
        finally:
            watch.stop()

    def search_answer(query: Any, k: int, exclude_self: bool, where: str | None, _: threading.Event) -> Response:
        return json_response(service.search(query, k, (), exclude_self, where).to_dict())

    def batch_answer(queries: list[Any], k: int, exclude_self: bool, where: str | None,
                     gone: threading.Event) -> Response:
        answers = service.search_batch(queries, k, exclude_self, where, cancelled=gone.is_set)
        queries.clear()  # the image bytes: not held while the answer is rendered
        return json_response({"count": len(answers), "results": [
            answer.to_dict() if isinstance(answer, SearchResponse) else {"error": str(answer), "status": answer.status}
            for answer in answers]})

    @app.post(
        "/search",
        response_model=SearchResponseModel,
        responses=error_responses(400, 401, 403, 408, 413, 415, 422, 503),
        openapi_extra={"requestBody": search_request_body(service.dim)},
    )
    async def search(
        request: Request,
        k: KParameter = DEFAULT_K,
        exclude_self: Annotated[bool, Query(description=EXCLUDE_SELF_HELP)] = False,
        where: WhereParameter = None,
    ) -> Any:
        """Top-k gallery images for an uploaded image, a base64 image, or an embedding."""
        content_type = request.headers.get("content-type", "").lower()
        if not content_type.startswith(("multipart/form-data", "application/json")):
            raise QueryError(
                "send multipart/form-data with a file field 'image', or application/json with "
                '"image" (base64) or "embedding"',
                415,
            )
        limits.searches.admit(1)  # refuse at once when the lane is full: before reading a byte
        async with body_held() as held:
            if content_type.startswith("multipart/form-data"):
                query: Any = (await read_uploads(request, limits.body_limit, held=held))[0]
            else:
                body = await read_body(request, limits.body_limit, held)
                query, body_k, body_where = await limits.parsing.run(parse_search_body, body, service)
                del body
                where = agreed("where", body_where, where, where is not None)
                k = agreed("k", body_k, k, "k" in request.query_params)
            return await answered(limits.searches, request, search_answer, query, k, exclude_self, where)

    @app.post(
        "/search/batch",
        response_model=BatchSearchResponseModel,
        responses=error_responses(400, 401, 403, 408, 413, 415, 422, 503),
        openapi_extra={"requestBody": batch_request_body(service.dim)},
    )
    async def search_batch(
        request: Request,
        k: KParameter = DEFAULT_K,
        exclude_self: Annotated[bool, Query(description=f"{EXCLUDE_SELF_HELP}; for every image query of the batch "
                                            '(also accepted as JSON "exclude_self")')] = False,
        where: WhereParameter = None,
    ) -> Any:
        """Top-k for each of up to MAX_BATCH_QUERIES images or embeddings: the images are embedded in one model
        call and all queries searched at once. An image that cannot be read gets an error entry in its place."""
        content_type = request.headers.get("content-type", "").lower()
        if not content_type.startswith(("multipart/form-data", "application/json")):
            raise QueryError(
                "send multipart/form-data with the file field 'image' once per image, or application/json with "
                '{"queries": [{"image": BASE64} | {"embedding": [...]}, ...]}',
                415,
            )
        limits.batches.admit(1)
        async with body_held() as held:
            if content_type.startswith("multipart/form-data"):
                queries: list[Any] = await read_uploads(request, limits.batch_body_limit, MAX_BATCH_QUERIES, held)
            else:
                body = await read_body(request, limits.batch_body_limit, held)
                queries, body_k, body_where, body_exclude = await limits.parsing.run(parse_batch_body, body, service)
                del body
                where = agreed("where", body_where, where, where is not None)
                k = agreed("k", body_k, k, "k" in request.query_params)
                exclude_self = agreed("exclude_self", body_exclude, exclude_self,
                                      "exclude_self" in request.query_params)
            images = sum(isinstance(query, (bytes, bytearray)) for query in queries)
            # a batch of embeddings alone is as cheap as a few searches: it does not wait behind image batches
            lane = limits.batches if images else limits.searches
            return await answered(lane, request, batch_answer, queries, k, exclude_self, where,
                                  cost=max(images, 1))

    def item_or_404(item_id: str) -> dict[str, Any]:
        # ASCII digits only, and within SQLite's integer range: anything else is simply not an id (404)
        is_id = item_id.isascii() and item_id.isdigit() and len(item_id) <= 18
        row = service.item(int(item_id)) if is_id else None
        if row is None:
            raise QueryError(f"no indexed image with id {item_id[:40]!r}", 404)
        return row

    @app.get("/items/{item_id}", response_model=ItemModel, responses=error_responses(401, 403, 404))
    def item(item_id: ItemId) -> dict[str, Any]:
        """The catalogue entry of an indexed image."""
        return item_or_404(item_id)

    image_content = {media: {"schema": {"type": "string", "format": "binary"}} for media in IMAGE_MEDIA_TYPES.values()}

    @app.get(
        "/items/{item_id}/image",
        response_class=Response,
        responses={200: {"description": "the image file", "content": image_content}} | error_responses(401, 403, 404),
    )
    def item_image(item_id: ItemId) -> Response:
        """The image file itself; only regular files of indexed catalogue rows are ever served."""
        row = item_or_404(item_id)
        handle, size, media_type = service.open_image_file(row["id"])
        return StreamingResponse(
            file_chunks(handle), media_type=media_type, headers={"content-length": str(size)}
        )

    @app.get("/stats", response_model=StatsModel, responses=error_responses(401, 403, 503))
    async def stats() -> dict[str, Any]:
        """Index statistics (size, type, parameters, recall vs exact search, latency) and service counters."""
        described, index = await limits.summaries.run(service.public_stats)
        return {
            "service": described,
            "batcher": service.batcher.stats(),
            "index": index,
            "admission": limits.stats(),
            "limits": {
                "max_upload_bytes": service.max_upload_bytes,
                "max_pixels": service.max_pixels,
                "max_k": MAX_K,
                "max_batch_queries": MAX_BATCH_QUERIES,
                "max_batch_upload_bytes": batch_upload_bytes(service.max_upload_bytes),
                "concurrency": concurrency,
                "max_queue": max_queue,
            },
        }

    @app.get("/health", response_model=HealthModel, responses=error_responses(403))
    async def health() -> dict[str, Any]:
        """Liveness: the number of vectors the server searches now (it follows the index's writers) and their
        dimension."""
        return {"status": "ok", **service.health()}

    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, less the list-shaped 422 it adds to every route with parameters: an item id is
        any string (a bad one is 404), and validation errors are sent as ``{"detail": str}`` (declared)."""
        if app.openapi_schema is None:
            document = fastapi_openapi()  # cached in app.openapi_schema; edited in place once
            for route in ("/items/{item_id}", "/items/{item_id}/image"):
                document["paths"][route]["get"]["responses"].pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            if "HTTPValidationError" not in json.dumps(document["paths"]):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
        return app.openapi_schema

    app.openapi = openapi
    if observe:  # GET /metrics, request metrics and the access log (serve/observability.py)
        install_observability(app, service, error_responses(401, 403))
    return app
