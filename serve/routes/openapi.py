"""The OpenAPI document as served: FastAPI's, with the searches' request bodies (they name this index's embedding
dimension, known once the app is built, and take a "text" query while the server has a text model) and without the
list-shaped 422 FastAPI adds to routes with parameters."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from retrieval.serve.routes.items import IMAGE_PATH, ITEM_PATH
from retrieval.serve.routes.schemas import batch_request_body, search_request_body
from retrieval.serve.routes.search import BATCH_PATH, SEARCH_PATH


def install_openapi(app: FastAPI, dim: int, text_search: Callable[[], bool] = lambda: False) -> None:
    """Serve ``app``'s document with the request bodies of an index of ``dim`` dimensions, built on first request,
    once with and once without the "text" query: ``text_search()`` says whether the server has a text model now (it
    may gain or lose one when the index is reloaded)."""
    fastapi_openapi = app.openapi
    generated: list[dict[str, Any]] = []  # FastAPI's own document, made once, before any edit
    documents: dict[bool, dict[str, Any]] = {}  # text search on or off -> the document served

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the searches' request bodies, less the list-shaped 422 it adds to every route
        with parameters: an item id is any string (a bad one is 404), and validation errors are sent as
        ``{"detail": str}`` (declared)."""
        text = bool(text_search())
        if text not in documents:
            if not generated:
                generated.append(copy.deepcopy(fastapi_openapi()))
            document = copy.deepcopy(generated[0])
            paths = document["paths"]
            paths[SEARCH_PATH]["post"]["requestBody"] = search_request_body(dim, text)
            paths[BATCH_PATH]["post"]["requestBody"] = batch_request_body(dim, text)
            for route in (ITEM_PATH, IMAGE_PATH):
                paths[route]["get"]["responses"].pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            if "HTTPValidationError" not in json.dumps(paths):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
            documents[text] = document
        app.openapi_schema = documents[text]
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
