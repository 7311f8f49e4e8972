"""What can go wrong talking to a search server, as exceptions: the server unreachable or too slow, an answer that is
not the API's, and the API's own errors with their status and the server's message (``{"detail": ...}``)."""

from __future__ import annotations

import math
from typing import Any

MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is read as this: the server's are seconds (1 or 2)
SERVE_HINT = ("is `retrieval serve --index INDEX` running there? It listens on http://127.0.0.1:7860 unless started "
              "with --host/--port; pass the URL it prints")


class RetrievalError(Exception):
    """Every error of ``retrieval.client``."""


class RetrievalConnectionError(RetrievalError, ConnectionError):
    """The server could not be reached (refused, unknown host, connection dropped)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url, self.reason = url, reason
        super().__init__(f"cannot reach the search server at {url} ({reason}): {SERVE_HINT}")


class RetrievalTimeoutError(RetrievalError, TimeoutError):
    """The server did not answer, its whole answer read, within the client's timeout."""

    def __init__(self, url: str, timeout: float | None) -> None:
        self.url, self.timeout = url, timeout
        within = f"within {timeout:g} s" if timeout is not None else "in time"
        super().__init__(f"the search server at {url} did not answer {within}; retry, or make the client's timeout "
                         "longer (RetrievalClient(url, timeout=...))")


class UnexpectedResponseError(RetrievalError):
    """A successful answer whose body is not what the API documents (another program on that port, or a version of
    the server this client does not know)."""


class ResponseTooLargeError(UnexpectedResponseError):
    """An answer larger than the client takes (``max_response_bytes``, or ``max_image_bytes`` for an image file),
    counted after decompression; refused before it is read when its Content-Length says so."""

    def __init__(self, what: str, limit: int, option: str, declared: int | None = None) -> None:
        self.limit, self.option, self.declared = limit, option, declared
        size = f"{declared} bytes" if declared is not None else f"more than {limit} bytes"
        super().__init__(f"{what} answered {size}, beyond this client's {option}={limit}; if that answer is "
                         f"expected, make it larger (RetrievalClient(url, {option}=...))")


class RetrievalAPIError(RetrievalError):
    """The server answered with an error status; ``message`` is its ``detail``, ``body`` the raw answer."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None,
                 request_id: str | None = None, body: Any = None) -> None:
        self.status, self.message, self.retry_after = status, message, retry_after
        self.request_id, self.body = request_id, body
        super().__init__(f"HTTP {status}: {message}")


class InvalidRequestError(RetrievalAPIError):
    """A 4xx: the request was refused as it is; ``message`` says what to change."""


class AuthenticationError(InvalidRequestError):
    """401: the server needs an API token (``RetrievalClient(url, api_key=...)``) and got none or another one."""


class NotFoundError(InvalidRequestError):
    """404: no indexed image with that id (or its file is gone), or no such route at that URL."""


class ServiceUnavailableError(RetrievalAPIError):
    """503: the server is busy or its Milvus collection unreachable; retry after ``retry_after`` seconds."""


class BatchQueryError(InvalidRequestError):
    """One query of a batch could not be answered (its image could not be read); the others were. ``position`` is
    its place in the batch and ``results`` the whole answer, a ``QueryFailure`` in the place of each failed query."""

    def __init__(self, position: int, status: int, message: str, results: list[Any]) -> None:
        super().__init__(status, f"queries[{position}]: {message}")
        self.position, self.results = position, results


def api_error(status: int, message: str, retry_after: float | None = None, request_id: str | None = None,
              body: Any = None) -> RetrievalAPIError:
    """The exception of an error status: its class says what kind of error it is."""
    kind: type[RetrievalAPIError]
    if status == 401:
        kind = AuthenticationError
    elif status == 404:
        kind = NotFoundError
    elif status == 503:
        kind = ServiceUnavailableError
    elif 400 <= status < 500:
        kind = InvalidRequestError
    else:
        kind = RetrievalAPIError
    return kind(status, message, retry_after=retry_after, request_id=request_id, body=body)


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header's seconds, at most ``MAX_RETRY_AFTER_S``; None when absent, a date (the server always
    sends seconds), or not a finite number of seconds at least 0 ("inf", "nan", "-1")."""
    try:
        seconds = float(value) if value is not None and len(value) <= 40 else math.nan
    except ValueError:
        return None
    return min(seconds, MAX_RETRY_AFTER_S) if math.isfinite(seconds) and seconds >= 0 else None
