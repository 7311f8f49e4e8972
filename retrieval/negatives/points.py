"""The four points of a Symm pair, as combinations of the pair's two originals (Symm paper, section 3.1).

For a pair (x_i, x_j), x_i' = a_i x_j - x_i is x_i reflected about the axis x_j, and x_j' = a_j x_i - x_j, with
a_i = 2 S_ij / S_jj and a_j = 2 S_ij / S_ii (eq. 1-2 with alpha = 2, beta = 1). Every point is therefore
c_0 x_i + c_1 x_j, and inner products of points are bilinear forms on the pairs' Gram entries. The readable
maths (``symm.py``) and the speed kernels (``kernels.py``) share these definitions.
"""

from __future__ import annotations

import numpy as np
import torch

from retrieval.distances import EPS
from retrieval.utils.reads import device_constant

Tensor = torch.Tensor

# Order of the four points of a pair: the two originals, then their synthetic reflections.
POINT_NAMES = ("x_i", "x_j", "x_i'", "x_j'")

# Point a of a pair as coefficients on its originals (x_i, x_j): table[0] + a_i table[1] + a_j table[2].
# x_i' = -x_i + a_i x_j and x_j' = a_j x_i - x_j (eq. 1-2).
_POINT_TABLE = np.array(
    [
        [[1, 0, -1, 0], [0, 1, 0, -1]],  # constant part, [m, point]
        [[0, 0, 0, 0], [0, 0, 1, 0]],  # times a_i
        [[0, 0, 0, 1], [0, 0, 0, 0]],  # times a_j
    ],
    dtype=np.float64,
)
_POINT_IS_SYNTHETIC = np.array([False, False, True, True])


class Combinations:
    """Rows that are sums of a pair's points: row r is the sum of the points ``parts[r]`` (indices into
    POINT_NAMES), the same number of points in every row. Treat as immutable (kernels cache by identity)."""

    def __init__(self, parts: tuple[tuple[int, ...], ...]) -> None:
        if not parts or len({len(p) for p in parts}) != 1 or not parts[0]:
            raise ValueError(f"rows must be non-empty and sum the same number of points, got {parts}")
        if not all(0 <= point < len(POINT_NAMES) for row in parts for point in row):
            raise ValueError(f"points are indices into {POINT_NAMES} (0-3), got {parts}")
        self.parts = tuple(tuple(row) for row in parts)
        self.points = len(parts[0])
        columns = np.array(parts).T  # [points, rows]
        self.table = sum(_POINT_TABLE[:, :, c] for c in columns)  # [3, 2, rows]
        self.synthetic = sum(_POINT_IS_SYNTHETIC[c].astype(np.int64) for c in columns)  # [rows]

    def __len__(self) -> int:
        return len(self.parts)


POINTS = Combinations(((0,), (1,), (2,), (3,)))


def pair_gram_block(gram: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """[2, Pp, 2, Pp] = <original m of pair p, original k of pair q> (originals: 0 = x_i, 1 = x_j)."""
    n = first.numel()
    ends = torch.cat([first, second])
    # index_select (backward: index_add) rather than advanced indexing (backward: sorted index_put)
    return gram.index_select(0, ends).index_select(1, ends).view(2, n, 2, n)


def reflection_forward(s_ij, axis_sq):
    """(a = 2 S_ij / max(axis_sq, EPS), the clamped axis_sq), for torch tensors and NumPy arrays alike; axis_sq
    is [2, Pp] = (S_jj, S_ii), so a = (a_i, a_j) (eq. 1-2)."""
    clamped = axis_sq.clip(min=EPS)
    return 2.0 * s_ij / clamped, clamped


def reflection_coefficients(h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(a = (a_i, a_j), the axes' squared norms clamped to EPS, and unclamped), each [2, Pp], from the Gram
    block h [2, Pp, 2, Pp] = <original m of pair p, original k of pair q>."""
    block = h.diagonal(0, 1, 3)  # [m, k, p]: the pair's own 2 x 2 block
    axis_sq = torch.stack([block[1, 1], block[0, 0]])  # S_jj (the axis of x_i), S_ii (the axis of x_j)
    return (*reflection_forward(block[0, 1], axis_sq), axis_sq)


def combine(x_i: Tensor, x_j: Tensor, a_i: Tensor, a_j: Tensor, dim: int) -> Tensor:
    """Stack (x_i, x_j, a_i x_j - x_i, a_j x_i - x_j) along ``dim``: originals, then reflections."""
    return torch.stack([x_i, x_j, a_i * x_j - x_i, a_j * x_i - x_j], dim=dim)


def sum_rows(planes: Tensor, combinations: Combinations, dim: int) -> Tensor:
    """Point planes -> rows of ``combinations`` along ``dim`` (each row the sum of its points)."""
    if combinations.parts == POINTS.parts:
        return planes
    columns = device_constant(combinations.parts, torch.int64, planes.device).T  # [points, rows]
    return sum(planes.index_select(dim, c) for c in columns)


def synthetic_counts(left: Combinations, right: Combinations) -> np.ndarray:
    """Synthetic points in each case a * len(right) + b."""
    return (left.synthetic[:, None] + right.synthetic[None, :]).ravel()
