"""JSON search bodies -> queries: what POST /search and /search/batch read from a JSON body, checked (422 naming
the problem); CPU work that the routes run in the parsing lane, off the event loop."""

from __future__ import annotations

import json
from typing import Any

from retrieval.index.search import check_k
from retrieval.rerank import API_KEY, RerankConfig, rerank_from_json
from retrieval.serve.bodies import check_keys, parse_json_object
from retrieval.serve.defaults import MAX_BATCH_QUERIES
from retrieval.serve.images import QueryError, decode_base64
from retrieval.serve.service import SearchService
from retrieval.serve.service.checks import check_batch_size
from retrieval.serve.service.text import text_query

MAX_SEARCH_DEPTH = 4  # {"embedding": [...]} is 2 deep: room to name a nested list in an embedding
MAX_BATCH_DEPTH = 6  # {"queries": [{"embedding": [...]}]} is 4 deep
QUERY_KEYS = ("image", "embedding", "text")  # one query: exactly one of these
JSON_KEYS = (*QUERY_KEYS, "k", "where", API_KEY)  # the keys a JSON search body may have
BATCH_KEYS = ("queries", "k", "where", "exclude_self", API_KEY)  # the keys a JSON batch body may have


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


def checked_rerank(value: Any) -> RerankConfig:
    """A ``rerank`` (a method name, or an object of its parameters) checked, or a 422 naming the key at fault and
    the choices (``retrieval.rerank.rerank_from_json``)."""
    try:
        return rerank_from_json(value)
    except ValueError as exc:
        raise QueryError(str(exc), 422) from exc


def body_rerank(payload: dict[str, Any]) -> RerankConfig | None:
    """A JSON body's ``rerank``, checked; None where absent."""
    return checked_rerank(payload[API_KEY]) if API_KEY in payload else None


def query_entry(entry: dict[str, Any], subject: str = "the JSON body") -> tuple[str, Any]:
    """One JSON query: ``("image", base64 text)``, ``("embedding", the list, checked by the service)`` or
    ``("text", a TextQuery)``."""
    given = [key for key in QUERY_KEYS if key in entry]
    if len(given) > 1:
        raise QueryError(f'{subject}: send either "image", "embedding" or "text" in one search, not both '
                         f'"{given[0]}" and "{given[1]}"', 422)
    if "embedding" in entry:
        return "embedding", entry["embedding"]  # checked by the service (422 for anything but d finite numbers)
    if "image" in entry:
        if not isinstance(entry["image"], str):
            raise QueryError(f"{subject}: 'image' must be a string: the image file in base64 (or a data: URL)", 422)
        return "image", entry["image"]
    if "text" in entry:
        return "text", text_query(entry["text"], subject)
    raise QueryError(f'{subject} needs "image" (base64 image file), "embedding" (list of numbers) or "text" (what '
                     "you are looking for, in words)", 422)


def json_query(payload: dict[str, Any], service: SearchService
               ) -> tuple[Any, int | None, str | None, RerankConfig | None]:
    """The query (image bytes, embedding list or ``TextQuery``), the body's ``k``, ``where`` and ``rerank`` (None if
    absent) of a JSON body."""
    check_keys(payload, JSON_KEYS)
    kind, value = query_entry(payload)
    k, where = body_k_and_where(payload)
    rerank = body_rerank(payload)
    return (decode_base64(value, service.max_upload_bytes) if kind == "image" else value), k, where, rerank


def batch_json(
    payload: dict[str, Any], service: SearchService
) -> tuple[list[Any], int | None, str | None, bool | None, RerankConfig | None]:
    """The queries, ``k``, ``where``, ``exclude_self`` and ``rerank`` (None if absent) of a JSON batch body.

    A query is image bytes, an embedding list, a ``TextQuery``, or the ``QueryError`` of an image that is not valid
    base64 (or too large): that query alone is answered by its error. Anything else malformed (a text query's text
    too) refuses the batch (422).
    """
    check_keys(payload, BATCH_KEYS)
    queries = payload.get("queries")
    if not isinstance(queries, list):
        raise QueryError('the JSON body needs "queries": a list of {"image": BASE64}, {"embedding": [...]} or '
                         '{"text": "..."}', 422)
    check_batch_size(len(queries))  # before decoding any of them
    rerank = body_rerank(payload)  # a bad one refuses the batch before any image is decoded
    parsed: list[Any] = []
    for position, entry in enumerate(queries):
        subject = f"queries[{position}]"
        if not isinstance(entry, dict):
            raise QueryError(f'{subject} must be an object: {{"image": BASE64}}, {{"embedding": [...]}} or '
                             '{"text": "..."}', 422)
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
    return parsed, k, where, exclude_self, rerank


def agreed(name: str, body: Any, query: Any, in_query: bool) -> Any:
    """A parameter the JSON body and the query string may both give: the body's, if given, must equal the query's."""
    if body is None:
        return query
    if in_query and body != query:
        raise QueryError(f'"{name}" differs between the JSON body and the query: {json.dumps(body)[:60]} in the JSON '
                         f"body but {json.dumps(query)[:60]} in the query; send one", 422)
    return body


def agreed_rerank(body: RerankConfig | None, query: str | None) -> RerankConfig | None:
    """The re-ranking of a search: the JSON body's and the query string's (a method name), which must be the same
    where both are given; None for none."""
    from_query = None if query is None else checked_rerank(query)
    if body is not None and from_query is not None and body != from_query:
        raise QueryError(f'"{API_KEY}" differs between the JSON body and the query: {body.method} in the JSON body but '
                         f"{from_query.method} in the query (with its default parameters); send one", 422)
    chosen = body if body is not None else from_query
    return chosen if chosen is not None and chosen.active else None


def search_value_bound(dim: int) -> int:
    """The JSON values one search body may hold: an embedding of ``dim`` numbers, each perhaps a (refused) list,
    and the keys around it."""
    return 2 * dim + 64


def parse_search_body(body: bytes, service: SearchService
                      ) -> tuple[Any, int | None, str | None, RerankConfig | None]:
    """A JSON search body -> ``json_query``'s query, ``k``, ``where`` and ``rerank``; CPU work (run off the event
    loop)."""
    payload = parse_json_object(body, search_value_bound(service.current().dim), MAX_SEARCH_DEPTH,
                                '{"image": BASE64}, {"embedding": [...]} or {"text": "..."}')
    return json_query(payload, service)


def parse_batch_body(body: bytes, service: SearchService
                     ) -> tuple[list[Any], int | None, str | None, bool | None, RerankConfig | None]:
    """A JSON batch body -> ``batch_json``'s queries, ``k``, ``where``, ``exclude_self``, ``rerank``; CPU work (off
    the loop)."""
    payload = parse_json_object(body, MAX_BATCH_QUERIES * search_value_bound(service.current().dim), MAX_BATCH_DEPTH,
                                '{"queries": [{"image": BASE64} | {"embedding": [...]} | {"text": "..."}, ...]}')
    return batch_json(payload, service)
