"""``CollectionClient``: a pymilvus client that keeps its collections searchable through a Milvus restart and says
plainly when the server cannot be reached.

Milvus keeps a collection's searchable copy in memory: after a restart a collection comes back ``released``, and
every search, get or query of it fails until someone loads it. The client loads it then and tries the call once
more. A server that cannot be reached (refused, gone, timed out) raises ``MilvusUnavailable``, which a server answers
as 503 with Retry-After; each outage is logged once, when it starts, and once when it ends, instead of pymilvus'
traceback per call. Nothing here knows what a collection holds (``milvus_collection``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5  # what a 503 asks a client to wait while Milvus is unreachable
NOT_LOADED = 101  # Milvus' code for a collection that is not loaded (released)
CONNECT_FAILED = 2  # pymilvus' code for a channel it could not open
LOADING_CALLS = frozenset({"search", "query", "query_iterator", "get", "search_iterator", "hybrid_search"})


class MilvusUnavailable(RuntimeError):
    """The Milvus server cannot be reached now; the call may succeed once it is back."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(f"the Milvus server at {uri} cannot be reached ({reason}); try again once it is back")
        self.uri, self.reason = uri, reason
        self.retry_after_s = RETRY_AFTER_S


def is_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the server could not be reached: a refused or broken channel or a
    deadline, not an answer the server gave."""
    import grpc
    from pymilvus.exceptions import MilvusException

    unreachable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    seen: BaseException | None = exc
    for _ in range(8):  # the chain pymilvus builds is short; a cycle must not loop
        if seen is None:
            return False
        if isinstance(seen, grpc.RpcError) and callable(getattr(seen, "code", None)):
            return seen.code() in unreachable
        code = getattr(seen, "code", None)
        if code in unreachable or (isinstance(seen, MilvusException) and code == CONNECT_FAILED):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def is_not_loaded(exc: BaseException) -> bool:
    """Whether ``exc`` is Milvus saying the collection is not loaded (released, as after a restart)."""
    message = str(getattr(exc, "message", "") or exc).lower()
    return getattr(exc, "code", None) == NOT_LOADED or "not loaded" in message or "state 'released'" in message


class Outages:
    """One log line when a server becomes unreachable and one when it is back, per URI, whatever the calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down_since: dict[str, float] = {}

    def failed(self, uri: str, reason: str) -> None:
        with self._lock:
            first = uri not in self._down_since
            self._down_since.setdefault(uri, time.monotonic())
        if first:
            log.warning("the Milvus server at %s cannot be reached (%s): searches answer 503 until it is back",
                        uri, reason)

    def succeeded(self, uri: str) -> None:
        if uri not in self._down_since:  # the common case, without the lock
            return
        with self._lock:
            since = self._down_since.pop(uri, None)
        if since is not None:
            log.warning("the Milvus server at %s is back after %.0f s", uri, time.monotonic() - since)


OUTAGES = Outages()


def short_reason(exc: BaseException) -> str:
    """The first line of pymilvus' message, without its traceback or retry preamble."""
    text = str(getattr(exc, "message", "") or exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


class CollectionClient:
    """A ``pymilvus.MilvusClient`` (``client``) whose reads load a released collection and retry once, and whose
    calls raise ``MilvusUnavailable`` when the server at ``uri`` cannot be reached. Every other attribute is the
    client's own."""

    def __init__(self, client: Any, uri: str) -> None:
        self._client, self.uri = client, uri

    def __getattr__(self, name: str) -> Any:
        if name == "_client":  # not set yet (a copy being made): never look it up on itself
            raise AttributeError(name)
        attribute = getattr(self._client, name)
        if not callable(attribute) or name.startswith("_"):
            return attribute
        return functools.partial(self._call, name, attribute)

    def _call(self, name: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                result = method(*args, **kwargs)
            except Exception as exc:
                collection = args[0] if args else kwargs.get("collection_name")
                if name not in LOADING_CALLS or not isinstance(collection, str) or not is_not_loaded(exc):
                    raise
                log.info("Milvus collection %s is not loaded (as after a restart of Milvus); loading it", collection)
                self._client.load_collection(collection)
                result = method(*args, **kwargs)
        except Exception as exc:
            if not is_unreachable(exc):
                raise
            OUTAGES.failed(self.uri, short_reason(exc))
            raise MilvusUnavailable(self.uri, short_reason(exc)) from None
        OUTAGES.succeeded(self.uri)
        return result

    def ensure_loaded(self, collection: str, timeout_s: float | None = None) -> None:
        """Load ``collection`` unless it is loaded (what searching it needs), each call within ``timeout_s`` (None:
        the client's); MilvusUnavailable when the server cannot be reached."""
        from pymilvus.client.types import LoadState

        state = self._call("get_load_state", self._client.get_load_state, collection, timeout=timeout_s)
        if state.get("state") != LoadState.Loaded:
            self._call("load_collection", self._client.load_collection, collection, timeout=timeout_s)


class RpcErrorTracebacks(logging.Filter):
    """Drops pymilvus' own log records of each failed call and each failed reconnection (tracebacks): the
    exception raised carries the message, and an outage is logged once by ``Outages``, not once per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.funcName != "_log_rpc_error" and not record.getMessage().startswith("Connection recovery failed")


class LiteFallbacks(logging.Filter):
    """Drops the log records of a call Milvus Lite does not implement and pymilvus answers itself: the query
    iterator asks the server for a timestamp (AllocTimestamp), Lite's in-process gRPC server logs a traceback, and
    pymilvus warns and takes the client's clock, which is right for a server in this process."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("failed to get mvccTs"):
            return False
        return not (message.startswith("Exception calling application") and record.exc_info is not None
                    and isinstance(record.exc_info[1], NotImplementedError))


_FILTERS = {"pymilvus.decorators": RpcErrorTracebacks(), "pymilvus.client.connection_manager": RpcErrorTracebacks(),
            "grpc._server": LiteFallbacks(),
            "pymilvus.client.iterator.query_iterator": LiteFallbacks()}


def quiet_pymilvus_logs() -> None:
    """Install the filters above on the loggers that report them (once)."""
    for name, kept_out in _FILTERS.items():
        logger = logging.getLogger(name)
        if not any(type(f) is type(kept_out) for f in logger.filters):
            logger.addFilter(kept_out)
