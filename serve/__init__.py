"""Serving: ``SearchService`` (index + ONNX embedder, thread-safe, micro-batched), HTTP API, Gradio UI.

``retrieval serve --index INDEX_DIR [--report REPORT]`` or ``python app.py`` run both on one port.
"""

from retrieval.serve.defaults import DEFAULT_INDEX_DIR, DEFAULT_REPORT, DEMO_DIR, missing_artifacts_message
from retrieval.serve.service import SearchResponse, SearchService

__all__ = [
    "DEFAULT_INDEX_DIR",
    "DEFAULT_REPORT",
    "DEMO_DIR",
    "SearchResponse",
    "SearchService",
    "missing_artifacts_message",
]
