"""``SearchService``: one opened index (ONNX embedder + faiss + catalogue) answering searches from any thread.

Image queries are preprocessed in the caller's thread and embedded by a ``MicroBatcher``, so requests
that arrive together share one model call; the faiss search itself is thread-safe and runs in the
caller's thread. Catalogue lookups use per-thread read-only SQLite connections.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from retrieval.index import IMAGE_EXTENSIONS, Index, SearchResult, index_stats
from retrieval.index.embedder import Embedder, prepare_vectors
from retrieval.onnx_runtime import preprocess_images
from serve.batcher import MicroBatcher
from serve.catalogue_reader import CatalogueReader
from serve.defaults import DEFAULT_MAX_PIXELS, DEFAULT_MAX_UPLOAD_BYTES, MAX_K
from serve.diagnostics import LeaveOneOut, leave_one_out
from serve.images import QueryError, decode_image


@dataclass
class SearchResponse:
    results: list[SearchResult]
    k: int
    timing: dict[str, float] = field(default_factory=dict)  # milliseconds, plus the batch size

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "count": len(self.results),
            "results": [r.to_dict() | {"image_url": f"/items/{r.id}/image"} for r in self.results],
            "timing": self.timing,
        }


class SearchService:
    """Open ``index_dir`` once; ``search(image | embedding, k)`` from many threads."""

    def __init__(
        self,
        index_dir: str | Path,
        embedder: Embedder | None = None,
        max_batch: int = 32,
        max_wait_ms: float = 5.0,
        max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        self.index_dir = Path(index_dir)
        self.index = Index.open(self.index_dir, embedder=embedder)
        self.embedder = (
            self.index.embedder
        )  # loads the ONNX model recorded in index.json now, not per request
        self.catalogue = CatalogueReader(self.index.layout.catalogue)
        self.max_upload_bytes, self.max_pixels = int(max_upload_bytes), int(max_pixels)
        self.batcher = MicroBatcher(self._embed_batch, max_batch=max_batch, max_wait_ms=max_wait_ms)
        self._lock = threading.Lock()
        self._stats: dict[str, Any] | None = None
        self._loo: LeaveOneOut | None = None

    def _embed_batch(self, batch: np.ndarray) -> np.ndarray:
        return self.embedder.embed(batch)

    # --- facts
    @property
    def dim(self) -> int:
        return self.index.dim

    def __len__(self) -> int:
        return len(self.index)

    def describe(self) -> dict[str, Any]:
        return {
            "index_dir": str(self.index_dir.resolve()),
            "vectors": len(self),
            "embedding_dim": self.dim,
            "index_key": self.index.info.get("index_key"),
            "model_hash": self.index.model_hash,
            "model_path": self.index.info.get("model_path"),
            "input_size": int(self.embedder.model_config["input_size"]),
        }

    # --- search
    def check_k(self, k: int) -> int:
        if not 1 <= int(k) <= MAX_K:
            raise QueryError(f"k must be between 1 and {MAX_K}, got {k}", 422)
        return int(k)

    def embed_images(self, images: list[Image.Image]) -> tuple[np.ndarray, dict[str, float]]:
        started = time.perf_counter()
        with self.batcher.reservation() as submit:
            batch = preprocess_images(images, self.embedder.model_config)
            prepared = time.perf_counter()
            future = submit(batch)
        result = future.result(timeout=120)
        timing = {
            "preprocess_ms": (prepared - started) * 1000,
            "embed_ms": (time.perf_counter() - prepared) * 1000,
            "batch_wait_ms": result.wait_ms,
            "batch_size": result.batch_size,
        }
        return result.embeddings, timing

    def search(
        self,
        query: Image.Image | bytes | np.ndarray | list[float],
        k: int = 10,
        exclude_ids: tuple[int, ...] = (),
    ) -> SearchResponse:
        """Top-k of a PIL image, the bytes of an image file, or an embedding [d]; ``exclude_ids`` dropped."""
        k = self.check_k(k)
        started = time.perf_counter()
        timing: dict[str, float] = {}
        if isinstance(query, (bytes, bytearray)):
            query = decode_image(bytes(query), self.max_upload_bytes, self.max_pixels)
            timing["decode_ms"] = (time.perf_counter() - started) * 1000
        if isinstance(query, Image.Image):
            embedding, embed_timing = self.embed_images([query])
            timing.update(embed_timing)
        else:
            embedding = self.check_embedding(query)
        search_started = time.perf_counter()
        results = self._search_vectors(embedding, k, set(exclude_ids))
        timing["search_ms"] = (time.perf_counter() - search_started) * 1000
        timing["total_ms"] = (time.perf_counter() - started) * 1000
        return SearchResponse(results, k, {key: round(v, 3) for key, v in timing.items()})

    def check_embedding(self, embedding: Any) -> np.ndarray:
        try:
            vector = np.asarray(embedding, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise QueryError(f"'embedding' must be a list of {self.dim} numbers: {exc}", 422) from exc
        if vector.ndim != 1 or vector.shape[0] != self.dim:
            raise QueryError(
                f"'embedding' must be a flat list of {self.dim} numbers (this index's dimension), "
                f"got shape {list(vector.shape)}",
                422,
            )
        try:
            return prepare_vectors(vector, self.dim)
        except ValueError as exc:
            raise QueryError(str(exc), 422) from exc

    def _search_vectors(self, embedding: np.ndarray, k: int, exclude: set[int]) -> list[SearchResult]:
        scores, ids = self.index.search_arrays(embedding, k + len(exclude))
        keep = [
            (float(s), int(i)) for s, i in zip(scores[0], ids[0], strict=True) if i >= 0 and i not in exclude
        ]
        rows = self.catalogue.rows([i for _, i in keep])
        return [SearchResult(i, rows[i]["path"], rows[i]["label"], s) for s, i in keep[:k] if i in rows]

    # --- catalogue
    def item(self, image_id: int) -> dict[str, Any] | None:
        return self.catalogue.row(image_id)

    def image_path(self, image_id: int) -> Path | None:
        """The file of an indexed image: only if catalogued as indexed and still an image file on disk."""
        row = self.catalogue.row(image_id)
        if row is None:
            return None
        path = Path(row["path"])
        if path.suffix.lower() not in IMAGE_EXTENSIONS or not path.is_file():
            return None
        return path

    # --- slower summaries, computed once
    def index_stats(self) -> dict[str, Any]:
        with self._lock:
            if self._stats is None:
                self._stats = index_stats(self.index_dir, queries=200)
            return self._stats

    def leave_one_out(self) -> LeaveOneOut:
        with self._lock:
            if self._loo is None:
                self._loo = leave_one_out(self.index, self.catalogue)
            return self._loo

    def close(self) -> None:
        self.batcher.close()
        self.index.close()
