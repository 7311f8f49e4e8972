"""A Python client of the HTTP API of `retrieval serve` (docs/SERVING.md, "Python client"): HTTP only, through httpx,
in the base install (no torch, no faiss, nothing of the server).

- ``client``: ``RetrievalClient``: searches by image, embedding or text, batches, items, health and stats.
- ``queries``: a caller's queries and options -> the API's JSON, checked where that is cheap.
- ``results``: the answers as typed records (``SearchResults`` of ``SearchHit``, ``Item``, ``Health``, ``Stats``).
- ``errors``: ``RetrievalError`` and its kinds: unreachable, timed out, the API's 4xx and 503 with the server's
  message, an answer too large or not the API's.
- ``bounded``: an answer read within the client's size limits and its timeout for the whole call.

    from retrieval.client import RetrievalClient

    with RetrievalClient("http://127.0.0.1:7860") as client:
        for hit in client.search(image="query.jpg", k=5):
            print(hit.path, hit.label, hit.score)
"""

from retrieval.client.client import DEFAULT_URL, RetrievalClient
from retrieval.client.errors import (
    AuthenticationError,
    BatchQueryError,
    InvalidRequestError,
    NotFoundError,
    ResponseTooLargeError,
    RetrievalAPIError,
    RetrievalConnectionError,
    RetrievalError,
    RetrievalTimeoutError,
    ServiceUnavailableError,
    UnexpectedResponseError,
)
from retrieval.client.results import (
    Health,
    Item,
    Limits,
    QueryFailure,
    QueryItem,
    RerankInfo,
    SearchHit,
    SearchResults,
    Stats,
)

__all__ = [
    "DEFAULT_URL", "AuthenticationError", "BatchQueryError", "Health", "InvalidRequestError", "Item", "Limits",
    "NotFoundError", "QueryFailure", "QueryItem", "RerankInfo", "ResponseTooLargeError", "RetrievalAPIError",
    "RetrievalClient", "RetrievalConnectionError", "RetrievalError", "RetrievalTimeoutError", "SearchHit",
    "SearchResults", "ServiceUnavailableError", "Stats", "UnexpectedResponseError",
]
