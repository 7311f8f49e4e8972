"""``RetrievalClient``: the HTTP API of `retrieval serve` from Python (docs/SERVING.md, "Python client"), one httpx
connection pool per client, closed by ``close`` or the ``with`` block."""

from __future__ import annotations

import json
import operator
import ssl
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

import httpx

from retrieval.client.bounded import ACCEPT_ENCODING, BodyTooLarge, Cut, Deadline, UnreadableBody, read_body
from retrieval.client.errors import (
    BatchQueryError,
    ResponseTooLargeError,
    RetrievalConnectionError,
    RetrievalError,
    RetrievalTimeoutError,
    UnexpectedResponseError,
    api_error,
    retry_after_seconds,
)
from retrieval.client.queries import ImageInput, Query, batch_entry, options, query_entry
from retrieval.client.results import Health, Item, QueryFailure, SearchResults, Stats, read
from retrieval.errors import ParameterError

DEFAULT_URL = "http://127.0.0.1:7860"  # where `retrieval serve` listens unless told otherwise
# generous: a batch of up to 64 images may wait for its turn in the server's batches lane, then embeds them all
DEFAULT_TIMEOUT_S = 120.0
MAX_MESSAGE_CHARS = 2000  # of a non-JSON error body (a proxy's HTML page) kept as the message
# the API's largest answer, 64 queries of 1000 hits, is about 11 MB with 20-character paths; far more would let a
# list of empty objects (24x its bytes once parsed) take gigabytes
DEFAULT_MAX_RESPONSE_BYTES = 32 * 2**20
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20  # an image file, GET /items/{id}/image


class RetrievalClient:
    """A client of one search server: ``search`` (by image, embedding or text), ``search_batch``, ``item``,
    ``item_image``, ``health`` and ``stats``; answers as typed records, errors as ``RetrievalError``s."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, headers: Mapping[str, str] | None = None,
                 verify: bool | ssl.SSLContext = True, max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
                 max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> None:
        """``url``: the server's (with its path prefix behind a proxy); ``timeout``: seconds per call, its whole
        answer read (None: no limit); ``api_key``: the token of a server started with --token-file or
        RETRIEVAL_API_TOKEN, sent as ``Authorization: Bearer``; ``headers``: sent with every request; ``verify``: TLS
        certificate checking; ``max_response_bytes``, ``max_image_bytes``: the largest answer (decompressed) and
        image file taken, a larger one is a ``ResponseTooLargeError``."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ParameterError("url", f"must be the server's http:// or https:// URL, e.g. {DEFAULT_URL}; got "
                                 f"{url!r}")
        if timeout is not None and not timeout > 0:
            raise ParameterError("timeout", f"must be a positive number of seconds or None, got {timeout!r}")
        for name, value in (("max_response_bytes", max_response_bytes), ("max_image_bytes", max_image_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParameterError(name, f"must be a positive number of bytes, got {value!r}")
        sent = httpx.Headers({"Accept-Encoding": ACCEPT_ENCODING})
        sent.update(headers or {})  # the caller's replace ours, whatever their case
        if api_key is not None:
            if not isinstance(api_key, str) or not api_key.strip() or any(c.isspace() for c in api_key.strip()):
                raise ParameterError("api_key", "must be the server's API token: one word, not empty")
            sent["Authorization"] = f"Bearer {api_key.strip()}"
        self.url, self.timeout = url.rstrip("/"), timeout
        self.max_response_bytes, self.max_image_bytes = max_response_bytes, max_image_bytes
        self._http = httpx.Client(base_url=self.url, timeout=timeout, headers=sent, verify=verify)

    def __repr__(self) -> str:
        return f"RetrievalClient({self.url!r})"

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (the client cannot be used afterwards)."""
        self._http.close()

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._http.is_closed

    # --- searches ---------------------------------------------------------------------------------------------
    def search(self, *, image: ImageInput | None = None, embedding: Any = None, text: str | None = None,
               k: int = 10, where: str | None = None, exclude_self: bool = False,
               rerank: str | Mapping[str, Any] | None = None) -> SearchResults:
        """The ``k`` gallery images nearest one query: exactly one of ``image`` (a file's path or its bytes),
        ``embedding`` (a vector of the index's dimension) and ``text`` (words; the server needs a text model).

        ``where`` filters the catalogue first (``'label = "cat" and price < 20'``, docs/INDEX.md "Filters");
        ``exclude_self`` leaves out the gallery image with the query image's exact bytes; ``rerank`` re-ranks the top
        candidates: a method name (qe, dba, kreciprocal) or a mapping of ``method`` and its parameters.
        """
        body = query_entry(image, embedding, text) | options(k, where, rerank)
        params = {"exclude_self": "true"} if exclude_self else None  # a query-string option of POST /search only
        return self._read(SearchResults.from_json, *self._request("POST", "/search", json=body, params=params))

    @overload
    def search_batch(self, queries: Iterable[Query], *, k: int = ..., where: str | None = ...,
                     exclude_self: bool = ..., rerank: str | Mapping[str, Any] | None = ...,
                     raise_on_error: Literal[True] = ...) -> list[SearchResults]: ...

    @overload
    def search_batch(self, queries: Iterable[Query], *, k: int = ..., where: str | None = ...,
                     exclude_self: bool = ..., rerank: str | Mapping[str, Any] | None = ...,
                     raise_on_error: Literal[False]) -> list[SearchResults | QueryFailure]: ...

    def search_batch(self, queries: Iterable[Query], *, k: int = 10, where: str | None = None,
                     exclude_self: bool = False, rerank: str | Mapping[str, Any] | None = None,
                     raise_on_error: bool = True) -> list[SearchResults] | list[SearchResults | QueryFailure]:
        """One ``SearchResults`` per query, in order, from one request (POST /search/batch: the images embedded in
        one model call). A query is ``{"image": path or bytes}``, ``{"embedding": vector}`` or ``{"text": words}``,
        or for short a ``Path``, bytes or a vector (the rows of a 2-D array: pass ``list(matrix)``); the server
        takes 1 to ``stats().limits.max_batch_queries`` (64). The options apply to every query.

        A query whose image the server cannot read raises ``BatchQueryError`` (its ``results`` hold the others'
        answers), or with ``raise_on_error=False`` is a ``QueryFailure`` in its place.
        """
        if isinstance(queries, (str, bytes, Mapping)):
            raise ParameterError("queries", "must be a list of queries, e.g. [{\"image\": \"a.jpg\"}, {\"text\": "
                                 "\"a red apple\"}]; for one query use search()")
        entries = [batch_entry(query, position) for position, query in enumerate(queries)]
        if not entries:
            raise ParameterError("queries", "is empty; give at least one query")
        body = {"queries": entries, **options(k, where, rerank)} | ({"exclude_self": True} if exclude_self else {})
        results = self._read(batch_results, *self._request("POST", "/search/batch", json=body))
        failed = next((entry for entry in results if isinstance(entry, QueryFailure)), None)
        if failed is not None and raise_on_error:
            raise BatchQueryError(failed.position, failed.status, failed.error, results)
        return results

    # --- items and status -------------------------------------------------------------------------------------
    def item(self, item_id: int) -> Item:
        """The catalogue entry of an indexed image (a hit's ``id``); ``NotFoundError`` if there is none."""
        return self._read(Item.from_json, *self._request("GET", f"/items/{checked_id(item_id)}"))

    def item_image(self, item_id: int) -> bytes:
        """The file of an indexed image, as the server sends it (its own format), of at most ``max_image_bytes``."""
        return self._request("GET", f"/items/{checked_id(item_id)}/image", image=True)[1]

    def health(self) -> Health:
        """Whether the server searches now (GET /health, open without a token); ``ServiceUnavailableError`` while
        a served Milvus collection cannot be reached."""
        return self._read(Health.from_json, *self._request("GET", "/health"))

    def stats(self) -> Stats:
        """The served index and model, its statistics, the server's counters and limits (GET /stats)."""
        return self._read(Stats.from_json, *self._request("GET", "/stats"))

    # --- HTTP -------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, image: bool = False,
                 **kwargs: Any) -> tuple[httpx.Response, bytes]:
        """The server's answer to one request and its body, whole within ``timeout`` and at most
        ``max_response_bytes`` (``max_image_bytes`` for an ``image`` file); an error status, no answer or no server
        raise."""
        if self._http.is_closed:
            raise RetrievalError(f"{self!r} is closed; make a new client")
        deadline = Deadline(self.timeout)
        option = "max_response_bytes"
        try:
            with Cut(deadline) as cut:  # connect, request, head and body: the whole call within the deadline
                request = self._http.build_request(method, path, timeout=deadline.timeout(),
                                                   extensions={"trace": cut.trace}, **kwargs)
                response = self._http.send(request, stream=True)
                try:
                    cut.watch(response.extensions.get("network_stream"))  # a pooled connection's
                    option = "max_image_bytes" if image and response.is_success else option
                    body = read_body(response, getattr(self, option), deadline)
                finally:
                    response.close()
        except BodyTooLarge as exc:
            raise ResponseTooLargeError(f"{method} {request.url}", exc.limit, option, exc.declared) from None
        except UnreadableBody as exc:
            raise UnexpectedResponseError(f"{method} {request.url} answered {response.status_code} with a body this "
                                          f"client cannot read: {exc}") from None
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException) or deadline.passed:  # or the cut at the deadline dropped it
                raise RetrievalTimeoutError(self.url, self.timeout) from None
            if isinstance(exc, httpx.ConnectError):
                raise RetrievalConnectionError(self.url, str(exc) or "connection refused") from None
            # dropped mid-answer, a protocol error
            raise RetrievalConnectionError(self.url, f"{type(exc).__name__}: {exc}") from None
        if response.is_success:
            return response, body
        data = error_body(body)
        detail = data.get("detail") if isinstance(data, dict) else None
        message = detail if isinstance(detail, str) else (
            body[:MAX_MESSAGE_CHARS].decode("utf-8", "replace").strip() or response.reason_phrase)
        raise api_error(response.status_code, message, retry_after_seconds(response.headers.get("retry-after")),
                        response.headers.get("x-request-id"), data)

    def _read(self, parse: Any, response: httpx.Response, body: bytes) -> Any:
        """``parse`` of a successful answer's JSON; ``UnexpectedResponseError`` naming the route and the problem
        when the body is not what the API documents."""
        try:
            return parse(json.loads(body))
        except RecursionError:
            problem = "its JSON is nested deeper than Python reads"
        except ValueError as exc:  # not JSON, or a field missing or of another type (results.read)
            problem = str(exc)
        raise UnexpectedResponseError(
            f"{response.request.method} {response.request.url} answered {response.status_code} with a body this "
            f"client cannot read ({problem}): is {self.url} a `retrieval serve` server of this version?")


def batch_results(data: dict[str, Any]) -> list[SearchResults | QueryFailure]:
    """A POST /search/batch answer: each entry a ``SearchResults`` or, for a query not answered, a ``QueryFailure``."""
    return [QueryFailure.from_json(position, entry) if isinstance(entry, dict) and "error" in entry
            else SearchResults.from_json(entry) for position, entry in enumerate(read(data, "results", "list"))]


def error_body(body: bytes) -> Any:
    """An error answer's JSON (the API's ``{"detail": ...}``), or None when it is not JSON (a proxy's page)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def checked_id(item_id: Any) -> int:
    """A catalogue id: a non-negative integer (a NumPy one too)."""
    try:
        value = None if isinstance(item_id, bool) else operator.index(item_id)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ParameterError("item_id", f"must be a catalogue id (a hit's id, an integer), got {item_id!r}")
    return value
