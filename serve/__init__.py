"""Serving: ``SearchService`` (index + ONNX embedder, thread-safe, micro-batched), HTTP API, Gradio UI.

``retrieval serve --index INDEX_DIR [--report REPORT]`` or ``python app.py`` run both on one port. The names below
are imported on first use: the command line reads ``retrieval.serve.defaults`` without loading the web stack.
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
