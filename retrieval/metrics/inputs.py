"""The checks and conversions every metric applies to its inputs, so that each says the same thing about a bad one.

Embeddings [n, d] become a float32 (float64 stays float64) CPU tensor; labels [n] (ints, strings, or floats holding
integers) a numpy array; the labels of a query and a gallery set shared int64 codes 0..C-1. Each failure is a
ValueError that names the argument and what is wrong with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def as_embeddings(x: Any, name: str) -> torch.Tensor:
    """A [n, d] float32/float64 CPU tensor, or a ValueError that says what is wrong."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        try:
            t = torch.from_numpy(np.asarray(x))
        except TypeError as err:
            raise ValueError(f"{name} must be a numeric array [n, d]; got {type(x).__name__}") from err
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, d]; got shape {tuple(t.shape)} (reshape to [n, d])")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); pass at least one row and column")
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)):
        raise ValueError(f"{name} must hold real numbers; got dtype {t.dtype}")
    if t.dtype != torch.float64:
        t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf; check the model output before evaluating")
    return t.contiguous()


def as_label_array(labels: Any, n: int, name: str) -> np.ndarray:
    """Labels as a 1-D numpy array (ints or strings) of length n."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [n]; got shape {arr.shape}")
    if len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} entries but its embeddings have {n} rows")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must be integer or string class labels; got non-integer floats")
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iubUSO":
        raise ValueError(f"{name} must be integer or string class labels; got dtype {arr.dtype}")
    return arr


def encode_labels(query_labels: np.ndarray, gallery_labels: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Map (possibly string) labels of both sets to shared int64 codes 0..C-1."""
    if gallery_labels is None:
        _, codes = np.unique(query_labels, return_inverse=True)
        return (codes.astype(np.int64).ravel(),)
    if query_labels.dtype.kind != gallery_labels.dtype.kind and "U" in (
        query_labels.dtype.kind,
        gallery_labels.dtype.kind,
    ):
        raise ValueError("query_labels and gallery_labels must both be strings or both be integers")
    both = np.concatenate([query_labels, gallery_labels])
    _, codes = np.unique(both, return_inverse=True)
    codes = codes.astype(np.int64).ravel()
    return codes[: len(query_labels)], codes[len(query_labels) :]
