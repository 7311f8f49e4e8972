"""What the server tells its operator: Prometheus metrics at ``GET /metrics`` and one access-log line per request.

Contract:

- ``install_observability(app, service, responses)`` (called by ``create_api``) adds ``GET /metrics`` (Prometheus
  text format, in the OpenAPI document as ``text/plain``) and the ``ObservedRequests`` middleware; each app has its
  own ``CollectorRegistry``, so several apps in one process never share or clash. ``/metrics`` is an API route like
  the others: the bearer token covers it when the server has one (``/health`` alone stays public). ``build_app``
  then calls ``outermost(app)``, so that the requests the security layers refuse are counted and logged too.
- Metrics: ``retrieval_http_requests_total{method, route, status}`` and
  ``retrieval_http_request_duration_seconds{method, route}`` (a histogram), where ``route`` is the route's template
  (``/items/{item_id}``, never one series per id; ``/docs-assets/{path}`` for a mounted folder), ``ui`` for the
  Gradio app's requests (mounted at the root) and ``unmatched`` for paths no route has; ``method`` is a standard
  method or ``OTHER``. Computed at scrape time from the service:
  ``retrieval_index_vectors`` (what is searched now), ``retrieval_index_generation`` (states served so far, 1 = the
  first) and ``retrieval_index_reloads_total`` (states a writer's change swapped in), and of the current model's
  micro-batcher ``retrieval_batcher_queue_length`` (requests waiting for a model call) and
  ``retrieval_batcher_batch_size`` (a histogram of rows per model call; it restarts when an index built with
  another model is swapped in); plus the ``process_*`` metrics.
- Access log: logger ``retrieval.access``, level INFO, one record per HTTP request once it is answered, with the
  fields ``request_id``, ``method``, ``route``, ``status``, ``duration_ms``, ``client`` (the record's ``access``
  attribute; ``JsonFormatter`` writes them as one JSON object per line). The request id is the client's
  ``X-Request-ID`` when that is a short safe token (``REQUEST_ID``), else a new one; the response carries it back in
  ``X-Request-ID``. ``client`` is the peer's IP address, or the X-Forwarded-For one where uvicorn trusts the peer as
  a proxy (``retrieval serve --forwarded-allow-ips``); a value that is not an IP address is logged as ``invalid``.
  Never logged: bodies, headers other than the id, query strings, raw paths, tokens.
- ``configure_logging(level, fmt)``: the server's stderr (the ``retrieval`` and ``uvicorn`` loggers), text or JSON.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest as render_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.routing import Mount
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from retrieval.serve.defaults import LOG_FORMATS, LOG_LEVELS
from retrieval.serve.routes import leaf_routes
from retrieval.serve.service import SearchService

METRICS_PATH = "/metrics"
ACCESS_LOGGER = "retrieval.access"
REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a client's id is kept only when it is this: safe in any log line
ZONE_ID = re.compile(r"[A-Za-z0-9._-]{1,16}")  # an IPv6 zone (interface name): Python accepts any text there
INVALID_CLIENT = "invalid"  # logged for a client address that is not an IP address (a forged X-Forwarded-For)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})  # others: "OTHER" (bounded labels)
UI_ROUTE, UNMATCHED_ROUTE = "ui", "unmatched"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

access_log = logging.getLogger(ACCESS_LOGGER)


def client_of(scope: Scope) -> str | None:
    """The request's client address as an IP address in text (``INVALID_CLIENT`` for anything else), or None.

    Behind a trusted proxy uvicorn puts the X-Forwarded-For value here as the client sent it: any length, any
    characters; only what parses as an address may reach a log line."""
    client = scope.get("client")
    if not client:
        return None
    host = client[0]
    try:
        address = ipaddress.ip_address(host) if isinstance(host, str) and len(host) <= 64 else None
    except ValueError:
        address = None
    zone = getattr(address, "scope_id", None)  # IPv6 only
    if address is None or (zone is not None and not ZONE_ID.fullmatch(zone)):
        return INVALID_CLIENT
    return str(address)


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-ID`` if it is exactly one short safe token, else a new random one."""
    given = Headers(scope=scope).getlist(REQUEST_ID_HEADER)
    if len(given) == 1 and REQUEST_ID.fullmatch(given[0]):
        return given[0]
    return uuid.uuid4().hex


class ServiceCollector(Collector):
    """The service's gauges and histograms, read from it at each scrape (nothing to keep in step)."""

    def __init__(self, service: SearchService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        """The index's size and generation and the current model's micro-batcher, as they are now."""
        state = self.service.current()  # one state for every figure of this scrape
        generation = self.service.generation
        yield GaugeMetricFamily("retrieval_index_vectors", "vectors in the index searched now", value=len(state))
        yield GaugeMetricFamily("retrieval_index_generation",
                                "index states served since the start (1: the first; +1 per reload)", value=generation)
        yield CounterMetricFamily("retrieval_index_reloads",
                                  "index states swapped in after a writer changed the folder", value=generation - 1)
        batcher = state.model.batcher
        yield GaugeMetricFamily("retrieval_batcher_queue_length",
                                "image queries waiting for a model call", value=batcher.queued)
        counts, rows = list(batcher.batch_sizes), batcher.rows  # copies: the worker thread goes on counting
        yield HistogramMetricFamily("retrieval_batcher_batch_size", "rows embedded per model call",
                                    buckets=batch_buckets(counts, batcher.max_batch), sum_value=rows)


def batch_buckets(counts: list[int], max_batch: int) -> list[tuple[str, float]]:
    """Cumulative Prometheus buckets (powers of two up to ``max_batch``, then +Inf) of per-size call counts."""
    bounds = sorted({2**i for i in range(max_batch.bit_length()) if 2**i <= max_batch} | {max_batch})
    buckets = [(str(float(bound)), float(sum(counts[: bound + 1]))) for bound in bounds]
    return [*buckets, ("+Inf", float(sum(counts)))]


class Observability:
    """One app's metrics (its own registry) and its access log."""

    def __init__(self, app: FastAPI, service: SearchService) -> None:
        self.app = app
        self.registry = CollectorRegistry()
        self.requests = Counter("retrieval_http_requests", "HTTP requests answered", ("method", "route", "status"),
                                registry=self.registry)
        self.latency = Histogram("retrieval_http_request_duration_seconds", "time to answer an HTTP request",
                                 ("method", "route"), buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(ServiceCollector(service))
        ProcessCollector(registry=self.registry)
        self._templates: list[Any] | None = None

    def route_of(self, scope: Scope) -> str:
        """The template of the app's route that the path matches (any method), ``ui`` or ``unmatched``."""
        if self._templates is None:  # routes are complete once serving starts (the UI is mounted after the API)
            self._templates = list(leaf_routes(self.app.routes))
        for route in self._templates:
            path_regex = getattr(route, "path_regex", None)
            if path_regex is not None and path_regex.match(scope["path"]):
                if isinstance(route, Mount):  # static files, or the Gradio app at the root: one series each
                    return f"{route.path}/{{path}}" if route.path else UI_ROUTE
                return route.path
        return UNMATCHED_ROUTE

    def record(self, scope: Scope, status: int, seconds: float, request_id: str) -> None:
        """Count, time and log one answered request."""
        method = scope["method"] if scope["method"] in METHODS else "OTHER"
        route = self.route_of(scope)
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)
        if access_log.isEnabledFor(logging.INFO):
            fields = {"request_id": request_id, "method": method, "route": route, "status": status,
                      "duration_ms": round(seconds * 1000, 2), "client": client_of(scope)}
            access_log.info("%s %s %s %d %.2fms client=%s", request_id, method, route, status,
                            fields["duration_ms"], fields["client"], extra={"access": fields})

    def metrics(self) -> Response:
        """The registry in Prometheus' text format."""
        return Response(render_metrics(self.registry), media_type=CONTENT_TYPE_LATEST)


class ObservedRequests:
    """ASGI middleware: every HTTP request gets a request id (echoed in ``X-Request-ID``), is counted, timed and
    logged once when answered."""

    def __init__(self, app: ASGIApp, observability: Observability) -> None:
        self.app, self.observability = app, observability

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_of(scope)
        status = 500  # unless a response starts: an exception reaches Starlette's error handler, which answers 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  (b"x-request-id", request_id.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.observability.record(scope, status, time.perf_counter() - started, request_id)


def install_observability(app: FastAPI, service: SearchService,
                          responses: dict[int | str, dict[str, Any]] | None = None) -> Observability:
    """Add ``GET /metrics`` and the request middleware to ``app`` (``responses``: its documented error statuses)."""
    observability = Observability(app, service)
    app.state.observability = observability
    documented = {200: {"description": "Prometheus metrics in the text exposition format",
                        "content": {"text/plain": {"schema": {"type": "string"}}}}} | (responses or {})

    # async: answered on the event loop (it only reads counters and /proc), so an exhausted thread pool never
    # blocks a scrape
    @app.get(METRICS_PATH, response_class=Response, responses=documented)
    async def metrics() -> Response:
        """Prometheus metrics: requests by route and status, latencies, the micro-batcher, the index's size."""
        return observability.metrics()

    app.add_middleware(ObservedRequests, observability=observability)
    return observability


def outermost(app: FastAPI) -> None:
    """Move ``ObservedRequests`` in front of every middleware added after it (the security layers), so that what they
    refuse (400, 401, 403) is counted and logged too. Before the app starts: its middleware stack is built then."""
    entries = [entry for entry in app.user_middleware if entry.cls is ObservedRequests]
    app.user_middleware[:] = entries + [entry for entry in app.user_middleware if entry.cls is not ObservedRequests]


# --- the server's log lines -------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and an access record's fields."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (non-ASCII escaped, so a line is always one line)."""
        line = {"time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line |= getattr(record, "access", {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SERVER_LOGGERS = ("retrieval", "uvicorn")


def configure_logging(level: str = "info", fmt: str = "text") -> Callable[[], None]:
    """Send the ``retrieval`` and ``uvicorn`` loggers from ``level`` up to stderr, as ``fmt`` lines (text or json);
    returns the function that undoes it. They stop propagating meanwhile, so no root handler prints a line twice."""
    if level not in LOG_LEVELS or fmt not in LOG_FORMATS:
        raise ValueError(f"log level must be one of {LOG_LEVELS} and format one of {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    saved = []
    for name in SERVER_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False

    def undo() -> None:
        for logger, previous_level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(previous_level)
            logger.propagate = propagate

    return undo
