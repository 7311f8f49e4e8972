"""A caller's queries and options -> the API's JSON (``{"image": BASE64}``, ``{"embedding": [...]}``, ``{"text":
...}``, ``k``, ``where``, ``rerank``), checked here where that is cheap, so that a mistake is named before any request
(the server checks the rest: its limits, the embedding's dimension, a filter's grammar)."""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError

QUERY_KEYS = ("image", "embedding", "text")  # a query is exactly one of these (the API's JSON keys)
ImageInput = str | os.PathLike[str] | bytes | bytearray | memoryview  # a file path, or the file's bytes
# one batch query: {"image": path or bytes} | {"embedding": vector} | {"text": words}, or a Path, bytes or a vector
Query = Mapping[str, Any] | os.PathLike[str] | bytes | bytearray | memoryview | np.ndarray | list | tuple


def image_entry(image: ImageInput, name: str = "image") -> str:
    """An image file (its path) or its bytes, in base64."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif isinstance(image, (str, os.PathLike)):
        path = Path(image)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"{name}: {path} {what}; give an image file's path, or its bytes")
        data = path.read_bytes()
    else:
        raise ParameterError(name, f"must be an image file's path or its bytes, got {type(image).__name__}")
    if not data:
        raise ParameterError(name, "is empty: give an image file's bytes")
    return base64.b64encode(data).decode("ascii")


def embedding_entry(embedding: Any, name: str = "embedding") -> list[float]:
    """A query vector (a list of numbers, a NumPy array, anything ``np.asarray`` reads) as a JSON list."""
    try:
        vector = np.asarray(embedding, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ParameterError(name, f"must be a list or array of numbers: {exc}") from None
    if vector.ndim != 1 or not vector.size:
        raise ParameterError(name, f"must be one vector of numbers (1-D, not empty), got shape {vector.shape}")
    if not np.isfinite(vector).all():
        raise ParameterError(name, "holds NaN or infinite numbers; give finite ones")
    return vector.tolist()


def text_entry(text: Any, name: str = "text") -> str:
    """Words to search by (the server strips them and checks their length)."""
    if not isinstance(text, str):
        raise ParameterError(name, f"must be a string (what you are looking for, in words), got {type(text).__name__}")
    if not text.strip():
        raise ParameterError(name, "is empty; say what you are looking for, e.g. \"a red apple\"")
    return text


def query_entry(image: Any = None, embedding: Any = None, text: Any = None, prefix: str = "") -> dict[str, Any]:
    """The API's JSON of one query: exactly one of ``image``, ``embedding`` and ``text`` (named ``prefix`` + key in
    an error: ``queries[3].image``)."""
    given = [key for key, value in zip(QUERY_KEYS, (image, embedding, text), strict=True) if value is not None]
    if len(given) != 1:
        raise ParameterError(prefix.rstrip(".") or "a search", "needs exactly one of image, embedding and text, got "
                             + (" and ".join(given) if given else "none"))
    if image is not None:
        return {"image": image_entry(image, f"{prefix}image")}
    if embedding is not None:
        return {"embedding": embedding_entry(embedding, f"{prefix}embedding")}
    return {"text": text_entry(text, f"{prefix}text")}


def batch_entry(query: Query, position: int) -> dict[str, Any]:
    """One query of a batch: a mapping of one of the API's keys, or a path (``Path``), image bytes or a vector."""
    name = f"queries[{position}]"
    if isinstance(query, Mapping):
        unknown = sorted(str(key) for key in query if key not in QUERY_KEYS)
        if unknown:
            raise ParameterError(name, f"has unknown keys {', '.join(unknown)}; a query is one of "
                                 '{"image": path or bytes}, {"embedding": vector} or {"text": words}')
        return query_entry(query.get("image"), query.get("embedding"), query.get("text"), f"{name}.")
    if isinstance(query, str):  # a path and words are both strings: the caller says which
        raise ParameterError(name, f"is a string ({query[:40]!r}): give {{\"image\": path}} for an image file or "
                             "{\"text\": words} to search by text")
    if isinstance(query, (os.PathLike, bytes, bytearray, memoryview)):
        return query_entry(image=query, prefix=f"{name}.")
    return query_entry(embedding=query, prefix=f"{name}.")


def checked_k(k: Any) -> int:
    """``k``, a positive integer (the server names its own upper bound)."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ParameterError("k", f"must be a positive integer (the number of results), got {k!r}")
    return int(k)


def checked_rerank(rerank: Any) -> str | dict[str, Any] | None:
    """``rerank``: None, a method name, or a mapping of ``method`` and its parameters (the server checks both)."""
    if rerank is None or isinstance(rerank, str):
        return rerank
    if isinstance(rerank, Mapping):
        if "method" not in rerank:
            raise ParameterError("rerank", 'needs "method" (qe, dba or kreciprocal) with its parameters')
        for key, value in rerank.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ParameterError("rerank", f"{key} must be a finite number, got {value}")
        return dict(rerank)
    raise ParameterError("rerank", f'must be a method name (e.g. "qe") or a mapping such as {{"method": "qe", '
                         f'"k": 10}}, got {type(rerank).__name__}')


def options(k: Any, where: Any, rerank: Any) -> dict[str, Any]:
    """The JSON body's ``k``, ``where`` and ``rerank``, checked; ``where`` and ``rerank`` left out when None."""
    if where is not None and (not isinstance(where, str) or not where.strip()):
        raise ParameterError("where", f"must be a filter expression such as 'label = \"cat\"', got {where!r}")
    chosen = checked_rerank(rerank)
    return {"k": checked_k(k)} | ({"where": where} if where is not None else {}) | (
        {"rerank": chosen} if chosen is not None else {})
