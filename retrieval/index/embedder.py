"""What the index needs from a model: the ``ImageEmbedder`` protocol, loading an ONNX file, normalisation.

Similarity is the inner product of L2-normalised vectors (cosine). A model that does not normalise its
output (``normalized`` False) is normalised here, before indexing and before searching, so that stored
and query vectors always live on the unit sphere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class ImageEmbedder(Protocol):
    """The interface of ``retrieval.onnx_runtime.OnnxEmbedder`` that indexing and search use."""

    @property
    def embedding_dim(self) -> int: ...

    @property
    def model_hash(self) -> str: ...

    @property
    def normalized(self) -> bool: ...

    @property
    def model_config(self) -> dict[str, Any]: ...

    def embed(self, images: Any) -> np.ndarray: ...


class ModelMismatchError(ValueError):
    """A query model differs from the model that built the index."""


def load_model(
    path: str | Path, providers: str = "auto", spin: bool = False, intra_op_threads: int | None = None
) -> ImageEmbedder:
    """Open an exported ONNX embedder (``retrieval export``).

    Indexing is a throughput job whose decoding workers need the CPU between batches, so onnxruntime's idle
    threads sleep rather than spin by default.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} not found; export one with `retrieval export`")
    try:
        from retrieval.onnx_runtime import OnnxEmbedder
    except ModuleNotFoundError as exc:  # the ONNX runtime wrapper is its own part of the toolkit
        raise RuntimeError(f"cannot load ONNX models: {exc}; is retrieval.onnx_runtime installed?") from exc
    return OnnxEmbedder(str(path), providers=providers, spin=spin, intra_op_threads=intra_op_threads)


def l2_normalize_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float32, C-contiguous); an all-zero row is a clear error, not NaN."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array [n, d], got shape {vectors.shape}")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        raise ValueError("an embedding is all zeros or not finite; it has no direction to compare by cosine")
    return np.ascontiguousarray(vectors / norms, dtype=np.float32)


def prepare_vectors(vectors: np.ndarray, dim: int) -> np.ndarray:
    """Check the dimension and normalise (cheap, and a no-op for a model that already normalises)."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim == 1:
        vectors = vectors[None, :]
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise ValueError(f"expected embeddings of shape [n, {dim}], got {tuple(vectors.shape)}")
    return l2_normalize_rows(vectors)


COMPATIBLE_WITH = "compatible_with"  # ONNX metadata: JSON list of the model hashes a model was trained to match


def declared_compatible(embedder: ImageEmbedder) -> frozenset[str]:
    """The model hashes ``embedder``'s metadata declares it compatible with (trained ``compatible-with`` them:
    its embeddings may be compared with theirs); empty for a model that declares none."""
    raw = (getattr(embedder, "metadata", None) or {}).get(COMPATIBLE_WITH)
    try:
        hashes = json.loads(raw) if raw else []
    except ValueError:
        return frozenset()
    return frozenset(h for h in hashes if isinstance(h, str) and h) if isinstance(hashes, list) else frozenset()


def is_compatible(embedder: ImageEmbedder, info: Mapping[str, Any]) -> bool:
    """Whether ``embedder`` may search (and be added to) an index whose index.json is ``info``: the same model,
    or one declared compatible with its model (by the ONNX file's hash or its PyTorch weights' hash)."""
    if embedder.model_hash == info.get("model_hash"):
        return True
    built_by = {info.get("model_hash"), info.get("source_model_hash")} - {None}
    return bool(declared_compatible(embedder) & built_by)


def check_model_match(info: Mapping[str, Any], embedder: ImageEmbedder, index_dir: Path) -> None:
    """Refuse a query model other than the one that built the index, unless it is declared compatible with it."""
    if not is_compatible(embedder, info):
        raise ModelMismatchError(
            f"the index in {index_dir} was built by model {info.get('model_path') or '?'} (model_hash "
            f"{info.get('model_hash')}), but the query model has model_hash {embedder.model_hash} and is not "
            "declared compatible with it; embeddings of different models are not comparable. Search with the same "
            "model, or upgrade the index to this one (retrieval index upgrade), which re-embeds the gallery while "
            "it keeps answering"
        )
