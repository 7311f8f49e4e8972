"""``RetrievalClient``: the HTTP API of `retrieval serve` from Python (docs/SERVING.md, "Python client"), one httpx
connection pool per client, closed by ``close`` or the ``with`` block."""

from __future__ import annotations

import operator
import ssl
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

import httpx

from retrieval.client.errors import (
    BatchQueryError,
    RetrievalConnectionError,
    RetrievalError,
    RetrievalTimeoutError,
    UnexpectedResponseError,
    api_error,
    retry_after_seconds,
)
from retrieval.client.queries import ImageInput, Query, batch_entry, options, query_entry
from retrieval.client.results import Health, Item, QueryFailure, SearchResults, Stats
from retrieval.errors import ParameterError

DEFAULT_URL = "http://127.0.0.1:7860"  # where `retrieval serve` listens unless told otherwise
# generous: a batch of up to 64 images may wait for its turn in the server's batches lane, then embeds them all
DEFAULT_TIMEOUT_S = 120.0
MAX_MESSAGE_CHARS = 2000  # of a non-JSON error body (a proxy's HTML page) kept as the message


class RetrievalClient:
    """A client of one search server: ``search`` (by image, embedding or text), ``search_batch``, ``item``,
    ``item_image``, ``health`` and ``stats``; answers as typed records, errors as ``RetrievalError``s."""

    def __init__(self, url: str = DEFAULT_URL, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None, headers: Mapping[str, str] | None = None,
                 verify: bool | ssl.SSLContext = True) -> None:
        """``url``: the server's (with its path prefix behind a proxy); ``timeout``: seconds per request (None: no
        limit); ``api_key``: the token of a server started with --token-file or RETRIEVAL_API_TOKEN, sent as
        ``Authorization: Bearer``; ``headers``: sent with every request; ``verify``: TLS certificate checking."""
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ParameterError("url", f"must be the server's http:// or https:// URL, e.g. {DEFAULT_URL}; got "
                                 f"{url!r}")
        if timeout is not None and not timeout > 0:
            raise ParameterError("timeout", f"must be a positive number of seconds or None, got {timeout!r}")
        sent = dict(headers or {})
        if api_key is not None:
            if not isinstance(api_key, str) or not api_key.strip() or any(c.isspace() for c in api_key.strip()):
                raise ParameterError("api_key", "must be the server's API token: one word, not empty")
            sent["Authorization"] = f"Bearer {api_key.strip()}"
        self.url, self.timeout = url.rstrip("/"), timeout
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
        return self._read(SearchResults.from_json, self._request("POST", "/search", json=body, params=params))

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
        answer = self._request("POST", "/search/batch", json=body)
        results = self._read(batch_results, answer)
        failed = next((entry for entry in results if isinstance(entry, QueryFailure)), None)
        if failed is not None and raise_on_error:
            raise BatchQueryError(failed.position, failed.status, failed.error, results)
        return results

    # --- items and status -------------------------------------------------------------------------------------
    def item(self, item_id: int) -> Item:
        """The catalogue entry of an indexed image (a hit's ``id``); ``NotFoundError`` if there is none."""
        return self._read(Item.from_json, self._request("GET", f"/items/{checked_id(item_id)}"))

    def item_image(self, item_id: int) -> bytes:
        """The file of an indexed image, as the server sends it (its own format)."""
        return self._request("GET", f"/items/{checked_id(item_id)}/image").content

    def health(self) -> Health:
        """Whether the server searches now (GET /health, open without a token); ``ServiceUnavailableError`` while
        a served Milvus collection cannot be reached."""
        return self._read(Health.from_json, self._request("GET", "/health"))

    def stats(self) -> Stats:
        """The served index and model, its statistics, the server's counters and limits (GET /stats)."""
        return self._read(Stats.from_json, self._request("GET", "/stats"))

    # --- HTTP -------------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The server's answer to one request; an error status, no answer or no server raise."""
        if self._http.is_closed:
            raise RetrievalError(f"{self!r} is closed; make a new client")
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise RetrievalTimeoutError(self.url, self.timeout) from None
        except httpx.ConnectError as exc:
            raise RetrievalConnectionError(self.url, str(exc) or "connection refused") from None
        except httpx.TransportError as exc:  # dropped mid-answer, a protocol error
            raise RetrievalConnectionError(self.url, f"{type(exc).__name__}: {exc}") from None
        if response.is_success:
            return response
        body = error_body(response)
        detail = body.get("detail") if isinstance(body, dict) else None
        message = detail if isinstance(detail, str) else (response.text[:MAX_MESSAGE_CHARS].strip()
                                                           or response.reason_phrase)
        raise api_error(response.status_code, message, retry_after_seconds(response.headers.get("retry-after")),
                        response.headers.get("x-request-id"), body)

    def _read(self, parse: Any, response: httpx.Response) -> Any:
        """``parse`` of a successful answer's JSON; ``UnexpectedResponseError`` naming the route when the body is
        not what the API documents."""
        try:
            return parse(response.json())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UnexpectedResponseError(
                f"{response.request.method} {response.request.url} answered {response.status_code} with a body this "
                f"client cannot read ({type(exc).__name__}: {exc}): is {self.url} a `retrieval serve` server of "
                "this version?") from None


def batch_results(data: dict[str, Any]) -> list[SearchResults | QueryFailure]:
    """A POST /search/batch answer: each entry a ``SearchResults`` or, for a query not answered, a ``QueryFailure``."""
    return [QueryFailure.from_json(position, entry) if "error" in entry else SearchResults.from_json(entry)
            for position, entry in enumerate(data["results"])]


def error_body(response: httpx.Response) -> Any:
    """An error answer's JSON (the API's ``{"detail": ...}``), or None when it is not JSON (a proxy's page)."""
    try:
        return response.json()
    except ValueError:
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
