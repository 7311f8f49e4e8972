"""A search's inputs checked before it runs: K and the filter, a batch's size and bytes, an embedding; each refusal
a ``QueryError`` (422) that says what is wrong."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from retrieval.index.filters import Filter, parse_filter
from retrieval.index.query_embedder import prepare_vectors
from retrieval.index.search import check_k
from retrieval.serve.defaults import MAX_BATCH_QUERIES, MAX_BATCH_UPLOAD_BYTES
from retrieval.serve.images import QueryError
from retrieval.serve.service.state import ServedIndex


def no_model_refusal(state: ServedIndex) -> QueryError:
    """The 422 for an image query to an index built from embeddings: it has no model to embed the image with."""
    return QueryError("this index was built from embeddings and has no model to embed an image with; send an "
                      f"\"embedding\" (a list of {state.dim} numbers) instead", 422)


def checked_k_and_where(k: object, where: str | None) -> tuple[int, Filter | None]:
    """``k`` and the parsed ``where`` of a search, or a 422 naming what is wrong with them."""
    try:
        return check_k(k), (parse_filter(where) if where is not None else None)
    except ValueError as exc:
        raise QueryError(str(exc), 422) from exc


def batch_upload_bytes(max_upload_bytes: int) -> int:
    """The image bytes one batch may carry in all: the per-image limit for every query, capped (but never below
    one image's limit)."""
    return min(max_upload_bytes * MAX_BATCH_QUERIES, max(MAX_BATCH_UPLOAD_BYTES, max_upload_bytes))


def check_batch_size(count: int) -> None:
    """The one rule on a batch's size: 1 to ``MAX_BATCH_QUERIES`` queries, else a 422 that names the limit."""
    if not 1 <= count <= MAX_BATCH_QUERIES:
        raise QueryError(f"a batch holds 1 to {MAX_BATCH_QUERIES} queries (the server's limit), got {count}; "
                         "split it into several requests", 422)


def check_embedding(embedding: Any, dim: int) -> np.ndarray:
    """A query embedding -> unit float32 vector [d]; 422 for anything but ``d`` finite numbers, not all zero.

    Only real numbers count (JSON numbers; not bools, strings, nulls or nested lists, which NumPy would
    coerce). The direction is what matters, so any finite magnitude is accepted: the vector is scaled by
    its largest component in float64 before it is normalised (1e30 everywhere would overflow a float32 norm).
    """
    if isinstance(embedding, np.ndarray):
        if embedding.dtype.kind not in "iuf":
            raise QueryError(f"'embedding' must hold numbers, got an array of {embedding.dtype}", 422)
        shape = list(embedding.shape)
    elif isinstance(embedding, (list, tuple)):
        shape = [len(embedding)]
    else:
        raise QueryError(f"'embedding' must be a list of {dim} numbers, not {_json_type(embedding)}", 422)
    if shape != [dim]:
        raise QueryError(
            f"'embedding' must be a flat list of {dim} numbers (this index's dimension), got shape {shape}",
            422,
        )
    if not isinstance(embedding, np.ndarray):
        for position, value in enumerate(embedding):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
                raise QueryError(
                    f"'embedding' must be a flat list of {dim} numbers, but item {position} is "
                    f"{_json_type(value)}",
                    422,
                )
    try:
        vector = np.asarray(embedding, dtype=np.float64)
    except OverflowError as exc:  # a JSON integer beyond the float64 range
        raise QueryError(f"'embedding' has a number beyond the float64 range (about 1.8e308): {exc}", 422) from exc
    if not np.all(np.isfinite(vector)):
        position = int(np.flatnonzero(~np.isfinite(vector))[0])
        raise QueryError(
            f"'embedding' item {position} is {vector[position]}: every component must be a finite number "
            "(within the float64 range)",
            422,
        )
    largest = float(np.max(np.abs(vector)))
    if largest == 0:
        raise QueryError(
            "'embedding' is all zeros: it has no direction to compare by cosine; send a non-zero vector", 422
        )
    vector = vector / largest  # now within [-1, 1]: the norm below cannot overflow nor underflow
    return prepare_vectors((vector / math.sqrt(float(vector @ vector))).astype(np.float32), dim)[0]


def _json_type(value: Any) -> str:
    """How a JSON value that is not a number is named in an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return "a list (nested lists are not accepted)"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"
