"""Embedding rows scaled to unit length, in NumPy: the one helper the index (which refuses a row without a direction)
and training's evaluation (which keeps it) share."""

from __future__ import annotations

import numpy as np

ZERO_ROWS = ("refuse", "keep")  # what l2_normalize_rows does with an all-zero row


def l2_normalize_rows(vectors: np.ndarray, zero_rows: str = "refuse") -> np.ndarray:
    """Rows of the 2-D ``vectors`` scaled to unit length (float32, C-contiguous).

    ``zero_rows="refuse"``: an all-zero or non-finite row is a clear error, not NaN (it has no direction to compare
    by cosine); ``"keep"``: an all-zero row stays zero (a pooled backbone feature may be all zero, and that must not
    stop an evaluation)."""
    if zero_rows not in ZERO_ROWS:
        raise ValueError(f"zero_rows must be one of {ZERO_ROWS}, got {zero_rows!r}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ValueError(f"embeddings must be a 2-D array [n, d], got shape {vectors.shape}")
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    if zero_rows == "keep":
        return vectors / np.maximum(norms, 1e-12)
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        raise ValueError("an embedding is all zeros or not finite; it has no direction to compare by cosine")
    return np.ascontiguousarray(vectors / norms, dtype=np.float32)
