"""The API's documented shapes: response models, the error statuses each route declares, the request bodies and
query parameters of the searches (what ``/openapi.json`` says; the routes and ``openapi`` use them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path as PathParameter
from fastapi import Query
from pydantic import BaseModel, Field

from retrieval.data.formats import IMAGE_MEDIA_TYPES
from retrieval.index.display_columns import MAX_DISPLAY_CHARS
from retrieval.index.filters import MAX_FILTER_CHARS
from retrieval.index.search import MAX_K
from retrieval.options import declared_options, hint_members
from retrieval.rerank import API_KEY, RerankConfig, method_names
from retrieval.serve.defaults import MAX_BATCH_QUERIES
from retrieval.text.tokens import MAX_TEXT_CHARS

DEFAULT_K = 10
EXCLUDE_SELF_HELP = ("leave out the gallery item whose file has exactly the query's bytes (query_item), as the app "
                     "does for a query picked from the gallery; image queries only")
WHERE_HELP = ('a filter on the catalogue\'s columns (id, path, label and a manifest\'s own columns such as split), '
              'e.g. label = "cat" and price < 20: = != < <= > >=, in (...), not in (...), and, or, not, '
              'parentheses, quoted strings and numbers; only matching images are searched, and none matching gives '
              'no results')
FLOAT64_MAX = 1.7976931348623157e308
COLUMNS_HELP = ("the index's display columns of the image's row (`retrieval index columns`), e.g. {\"title\": "
                "\"Red kettle\", \"price\": \"19.99\"}: the manifest's values, text on one line and cut to "
                f"{MAX_DISPLAY_CHARS} characters, null where the row has none; absent where the index shows no columns")
ItemId = Annotated[str, PathParameter(description="catalogue id of an indexed image (search results give it)",
                                      examples=["1"])]
# the query-string parameters of POST /search and /search/batch (k's range is checked by check_k, documented here)
KParameter = Annotated[int, Query(description="number of results (also accepted as JSON \"k\")",
                                  json_schema_extra={"minimum": 1, "maximum": MAX_K})]
WhereParameter = Annotated[str | None, Query(description=f"{WHERE_HELP} (also accepted as JSON \"where\")",
                                             json_schema_extra={"minLength": 1, "maxLength": MAX_FILTER_CHARS})]
RERANK_HELP = ("re-rank each query's top candidates: qe (alpha-weighted query expansion) or dba (database-side "
               "augmentation of the shortlist), Radenović et al. TPAMI 2018; kreciprocal (k-reciprocal encoding), "
               "Zhong et al. CVPR 2017; none (the default) keeps faiss' order. Filters and exclude_self apply first")
RerankParameter = Annotated[str | None, Query(
    description=f'{RERANK_HELP}. A method name with its default parameters (also accepted as JSON "{API_KEY}", '
    "which may set them)", json_schema_extra={"enum": method_names()})]
IMAGE_TYPES = ", ".join(dict.fromkeys(IMAGE_MEDIA_TYPES.values()))  # the media types an image upload may have


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
    422: "Well-formed but invalid: k out of range, unknown JSON keys or form fields, two queries together (image, "
    "embedding, text), an embedding of the wrong length, with non-numbers, non-finite numbers or all zeros, a text "
    f"that is not a string, empty or over {MAX_TEXT_CHARS} characters, a text query to a server without a text "
    "model, a malformed where, "
    "a JSON body of more values than the request can use or numbers of over 1,000 characters, "
    f"a batch of no queries or more than {MAX_BATCH_QUERIES}, an unknown rerank method or a parameter out of its "
    "range, or re-ranking on an index that keeps no vectors",
    503: "Too many searches (or image batches) already waiting, too many request bytes held at once, or the Milvus "
    "server of a served collection cannot be reached; retry after the Retry-After seconds",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for these error statuses, all with the ``{"detail": str}`` body."""
    return {status: {"model": ErrorDetail, "description": ERROR_STATUSES[status]} for status in statuses}


class Result(BaseModel):
    id: int = Field(description="catalogue id (GET /items/{id})")
    path: str = Field(description="the image's path relative to the gallery root")
    name: str = Field(description="the image's file name (no folders); the app shows `path`, as filters compare it")
    label: str | None = Field(description="its label (class folder or manifest label), if any")
    score: float = Field(ge=-1, le=1, description="cosine similarity to the query")
    rerank_score: float | None = Field(None, description="with rerank: the score the re-ranking ordered it by "
                                       "(higher first; qe and dba: a cosine, kreciprocal: 1 - Zhong et al.'s d*); "
                                       "absent beyond the re-ranked candidates and without rerank")
    image_url: str = Field(description="where to fetch the image file")
    columns: dict[str, str | float | int | None] | None = Field(None, description=COLUMNS_HELP)
    source: Literal["vector", "keyword", "both"] | None = Field(
        None, description="a text query's hit: found by the text model (vector), by the words of the index's text "
        "columns (keyword: `retrieval index text --text-columns`), or both; the order fuses the two (docs/TEXT.md, "
        "\"Keywords\"). A keyword hit's score is its cosine where the server has a text model, else its keyword "
        "relevance in [0, 1]. Absent for image and embedding queries")


class QueryItemModel(BaseModel):
    """The gallery item whose file has exactly the query's bytes."""

    id: int
    path: str = Field(description="relative to the gallery root")
    name: str = Field(description="the image's file name (no folders); the app shows `path`, as filters compare it")
    label: str | None
    image_url: str
    columns: dict[str, str | float | int | None] | None = Field(None, description=COLUMNS_HELP)


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
        "frames, or that the filter matches no image of the index (with how paths and labels compare); empty when "
        "there is nothing to note"
    )
    timing: dict[str, float] = Field(description="milliseconds per stage (decode, preprocess, embed, search, total) "
                                     "and the model batch size")
    rerank: RerankModel | None = Field(None, description="present when a re-ranking ordered the results")
    no_match: bool | None = Field(
        None, description="a text query's: true when nothing in the gallery matches it well (its best vector score "
        "is under the index's calibrated floor and no result matched by keyword): the results are the nearest, not "
        "matches; absent for an image query, and where the index has no floor for its text model (/stats says why)")


class RerankModel(BaseModel):
    """The re-ranking that ordered the results."""

    method: str = Field(description="qe, dba or kreciprocal")
    title: str
    paper: str = Field(description="the paper whose formula it computes")
    params: dict[str, float] = Field(description="its parameters, with candidates (the shortlist re-ranked)")


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
    name: str = Field(description="the image's file name (no folders); the app shows `path`, as filters compare it")
    label: str | None
    sha256: str | None = Field(description="sha256 of the file's bytes, hex")
    size: int | None = Field(description="file size in bytes")
    image_url: str
    columns: dict[str, str | float | int | None] | None = Field(None, description=COLUMNS_HELP)


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
    service: dict[str, Any] = Field(description="the index and model being served (names, not server paths), and "
                                    "whether it searches by text (text_search, text_model)")
    batcher: dict[str, Any] = Field(description="model calls and how many requests shared them")
    index: dict[str, Any] = Field(description="size, type, parameters, recall vs exact search, latency")
    admission: dict[str, Any] = Field(description="searches and batches running and waiting, request bytes held")
    limits: LimitsModel


TEXT_PROPERTY = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_TEXT_CHARS,
    "pattern": r"\S",  # not blank: the surrounding whitespace is stripped
    "description": 'what you are looking for, in words (e.g. "a red apple"), embedded by the server\'s text model '
    f"into the index's space; at most {MAX_TEXT_CHARS} characters",
}


def query_properties(dim: int, text: bool = False) -> dict[str, Any]:
    """The JSON schema properties of one query, "image" or "embedding", and "text" on a server with a text model
    (``text``) (POST /search and each batch query)."""
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
    } | ({"text": TEXT_PROPERTY} if text else {})


def one_query(text: bool = False) -> list[dict[str, Any]]:
    """The ``oneOf`` of a query: exactly one of its kinds."""
    return [{"required": ["image"]}, {"required": ["embedding"]}] + ([{"required": ["text"]}] if text else [])


def query_kinds(text: bool = False) -> str:
    """The kinds of query a body may hold, for its description."""
    return '"image", "embedding" and "text"' if text else '"image" and "embedding"'
K_PROPERTY = {"type": "integer", "minimum": 1, "maximum": MAX_K, "description": "number of results"}
WHERE_PROPERTY = {"type": "string", "minLength": 1, "maxLength": MAX_FILTER_CHARS, "description": WHERE_HELP}


def rerank_property() -> dict[str, Any]:
    """The JSON schema of ``rerank``: a method name, or an object of ``RerankConfig``'s fields (its keys), each with
    the type and range declared there."""
    properties: dict[str, Any] = {}
    for declared in declared_options(RerankConfig):
        spec = declared.spec
        if spec.choices is not None:
            schema: dict[str, Any] = {"type": "string", "enum": spec.allowed()}
        else:
            members = hint_members(declared.hint)
            schema = {"type": "integer" if int in members else "number", "minimum": spec.low, "maximum": spec.high}
            if type(None) in members:  # unset (null): the server sets it, as the description says
                schema = {"anyOf": [schema, {"type": "null"}]}
        default = f" (default: {spec.default_text})" if spec.default_text else ""
        properties[declared.name] = schema | {"description": spec.help.rstrip(".") + default,
                                              "default": declared.default}
    return {
        "description": f"{RERANK_HELP}: a method name, or an object that also sets its parameters",
        "oneOf": [
            {"type": "string", "enum": method_names()},
            {"type": "object", "properties": properties, "required": ["method"], "additionalProperties": False},
        ],
    }


def multipart_body(files: dict[str, Any]) -> dict[str, Any]:
    """The multipart/form-data part of a request body whose only field is ``image``, described by ``files``."""
    return {
        "schema": {"type": "object", "properties": {"image": files}, "required": ["image"],
                   "additionalProperties": False},
        "encoding": {"image": {"contentType": IMAGE_TYPES}},
    }


def search_request_body(dim: int, text: bool = False) -> dict[str, Any]:
    """The OpenAPI request body of POST /search: an image file upload, or a JSON object (with a "text" query on a
    server with a text model: ``text``)."""
    return {
        "required": True,
        "content": {
            "multipart/form-data": multipart_body({"type": "string", "format": "binary",
                                                   "description": "the image file"}),
            "application/json": {
                "schema": {
                    "type": "object",
                    "description": f'exactly one of {query_kinds(text)}; "k" and "rerank" here and in the query '
                    "must agree",
                    "properties": query_properties(dim, text) | {"k": K_PROPERTY, "where": WHERE_PROPERTY,
                                                                 API_KEY: rerank_property()},
                    "additionalProperties": False,
                    "oneOf": one_query(text),
                }
            },
        },
    }


def batch_request_body(dim: int, text: bool = False) -> dict[str, Any]:
    """The OpenAPI request body of POST /search/batch: several image files, or a JSON list of queries (texts too on a
    server with a text model: ``text``)."""
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
                    "description": '"k", "where", "exclude_self" and "rerank" apply to every query; here and in '
                    "the query they must agree",
                    "properties": {
                        "queries": {
                            "type": "array",
                            "minItems": 1,
                            "maxItems": MAX_BATCH_QUERIES,
                            "description": f"1 to {MAX_BATCH_QUERIES} queries, each exactly one of "
                            f"{query_kinds(text)}",
                            "items": {"type": "object", "properties": query_properties(dim, text),
                                      "additionalProperties": False, "oneOf": one_query(text)},
                        },
                        "k": K_PROPERTY,
                        "where": WHERE_PROPERTY,
                        "exclude_self": {"type": "boolean", "description": EXCLUDE_SELF_HELP},
                        API_KEY: rerank_property(),
                    },
                    "required": ["queries"],
                    "additionalProperties": False,
                }
            },
        },
    }
