"""Serving: ``SearchService`` (index + ONNX embedder, thread-safe, micro-batched), HTTP API, Gradio UI.

``retrieval serve --index INDEX_DIR [--report REPORT]`` or ``python app.py`` run both on one port. The names below
are imported on first use: the command line reads ``retrieval.serve.defaults`` without loading the web stack.

- ``service``: ``SearchService``: the served index answering searches from any thread, following its writers.
- ``batcher``: ``MicroBatcher``: embedding requests that arrive together run as one model call.
- ``api``: the HTTP API (FastAPI), made of ``routes``: the API's routes, one router per resource.
- ``bodies``: request bodies of untrusted size and shape, read through a cap.
- ``images``: untrusted query bytes turned into an image, with errors a client can act on.
- ``admission``: what the server lets in, budgeted by what work costs.
- ``security``: who may reach the server, request by request (bearer token, same origin, host names).
- ``exposure``: who may reach the server, decided at start-up (no web stack).
- ``observability``: Prometheus metrics and one access-log line per request.
- ``collector``: the garbage collector kept off the start-up heap while the server runs.
- ``config``: ``ServerConfig``: the server's settings, declared once (light).
- ``defaults``: default artifact locations shared by ``make demo`` and ``python app.py``.
- ``server``: one process, one port: the API with the Gradio app mounted, run by uvicorn.
- ``ui``: the Gradio app, a module a tab.
- ``upload_cache``: the Gradio app's own folder of uploaded files, pruned by age and size.
- ``examples``: the app's example queries, chosen by one rule.
- ``diagnostics``: where the index fails: leave-one-out top-1, per-class Recall@1, similarity to the nearest other.
- ``curation_view``: the served index's near-duplicate groups and label suspects, for the Evaluation tab.
- ``stats_view``: the Index tab's statistics as Markdown.
- ``report_files``: a run's report files read and checked.
- ``report_summary``: a run report in words.
- ``report_plots``: a run report's pictures and the results grid's curves.
- ``page_text``: text from users shown as text, fractions as percentages.
"""

from retrieval.utils.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "defaults": ["DEFAULT_INDEX_DIR", "DEFAULT_REPORT", "DEMO_DIR", "missing_artifacts_message"],
    "service": ["SearchResponse", "SearchService"],
})
__all__ = [
    "DEFAULT_INDEX_DIR",
    "DEFAULT_REPORT",
    "DEMO_DIR",
    "SearchResponse",
    "SearchService",
    "missing_artifacts_message",
]
