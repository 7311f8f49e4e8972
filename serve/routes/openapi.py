"""The OpenAPI document as served: FastAPI's, with the searches' request bodies (they name this index's embedding
dimension, known once the app is built) and without the list-shaped 422 FastAPI adds to routes with parameters."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI

from retrieval.serve.routes.items import IMAGE_PATH, ITEM_PATH
from retrieval.serve.routes.schemas import batch_request_body, search_request_body
from retrieval.serve.routes.search import BATCH_PATH, SEARCH_PATH


def install_openapi(app: FastAPI, dim: int) -> None:
    """Serve ``app``'s document with the request bodies of an index of ``dim`` dimensions, built once, on first
    request."""
    fastapi_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """FastAPI's document, plus the searches' request bodies, less the list-shaped 422 it adds to every route
        with parameters: an item id is any string (a bad one is 404), and validation errors are sent as
        ``{"detail": str}`` (declared)."""
        if app.openapi_schema is None:
            document = fastapi_openapi()  # cached in app.openapi_schema; edited in place once
            paths = document["paths"]
            paths[SEARCH_PATH]["post"]["requestBody"] = search_request_body(dim)
            paths[BATCH_PATH]["post"]["requestBody"] = batch_request_body(dim)
            for route in (ITEM_PATH, IMAGE_PATH):
                paths[route]["get"]["responses"].pop("422", None)
            schemas = document.get("components", {}).get("schemas", {})
            if "HTTPValidationError" not in json.dumps(paths):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
