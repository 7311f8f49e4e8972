"""Speed kernels of the hard-negative maths, apart from it; ``hardest_combination`` dispatches to them.

The readable, differentiable torch forms are in ``symm.py`` (``combination_inner_products``, then a max over the
cases) and ``pairs.py``; the kernels here compute the same values and gradients faster, and
``tests/losses/test_negatives_symm_fast.py`` holds them to the readable forms. This module owns the size thresholds:

- CPU, float32/64, at most ``NUMPY_MAX_PAIRS`` positive pairs: a NumPy kernel does the hardest case at once.
  The planes are C_left G C_right^T for sparse coefficient matrices C, and its backward touches only the
  selected cases (at B = 32 a torch operation costs 5-10 us of dispatch plus its autograd node, and
  per-operation cost is most of the Symm losses' extra time).
- otherwise (GPU, and CPU with many pairs): the [4, 4, Pp, Pp] planes come from the gathered Gram block by
  broadcasts in one autograd node with a hand-written backward, then a max node that avoids ``max(dim)`` on
  large CPU inputs (``SMALL_CASE_SIZE``).

The NumPy pairing (``pair_starts_numpy``) and share count (``synthetic_share_numpy``) are the CPU branches of
``pairs.positive_pairs`` and ``symm.synthetic_share``: a few NumPy calls cost less than torch's per-op dispatch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from retrieval.distances import EPS
from retrieval.negatives.points import (
    POINTS,
    Combinations,
    combine,
    pair_gram_block,
    reflection_coefficients,
    reflection_forward,
    sum_rows,
    synthetic_counts,
)

Tensor = torch.Tensor

NUMPY_MAX_PAIRS = 40  # CPU: the NumPy kernel up to this many positive pairs, torch above (equal cost at 40)
SMALL_CASE_SIZE = 1024  # entries per case up to which torch.max(dim=0) beats the amax route on CPU


def hardest_combination(
    gram: Tensor, first: Tensor, second: Tensor, left: Combinations = POINTS, right: Combinations = POINTS
) -> tuple[Tensor, Tensor]:
    """[Pp, Pp] largest inner product of a left row of pair p and a right row of pair q, and its index
    a * len(right) + b (the first on ties): the values and gradient of
    ``symm.combination_inner_products(...).flatten(0, 1).max(dim=0)``, by the fastest kernel for the input.
    """
    on_cpu = gram.device.type == "cpu" and gram.dtype in (torch.float32, torch.float64)
    if on_cpu and 0 < first.numel() <= NUMPY_MAX_PAIRS:
        return _HardestCombinationKernel.apply(gram, first, second, left, right)
    planes = sum_rows(sum_rows(_SymmPlanes.apply(pair_gram_block(gram, first, second)), left, 0), right, 1)
    return _MaxOverFirstDim.apply(planes.flatten(0, 1))


def synthetic_share_numpy(selected: Tensor, used: Tensor, left: Combinations, right: Combinations) -> Tensor:
    """``symm.synthetic_share`` for CPU tensors: a few microseconds instead of eight torch dispatches."""
    counts = synthetic_counts(left, right)[selected.numpy()][used.numpy()]
    return torch.tensor(counts.sum() / max((left.points + right.points) * counts.size, 1), dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------
# torch: the planes in one node with a hand-written backward, then a max node
# ----------------------------------------------------------------------------------------------------


def _reflection_backward(g_a, a, clamped, axis_sq):
    """Chain rule of a = (a_i, a_j) = 2 S_ij / max((S_jj, S_ii), EPS), for torch tensors and NumPy arrays alike:
    the gradients of S_ij, S_jj and S_ii of each pair from that of a ([2, Pp] each)."""
    g_over = g_a / clamped
    g_axis = g_over * a * (axis_sq >= EPS)
    return 2.0 * g_over.sum(0), -g_axis[0], -g_axis[1]


def _uncombine(g: Tensor, x_i: Tensor, x_j: Tensor, a_i: Tensor, a_j: Tensor, dim: int) -> tuple[Tensor, ...]:
    """Backward of ``points.combine``: gradients of x_i, x_j and of a_i, a_j (not yet summed over broadcasts)."""
    g0, g1, g2, g3 = g.unbind(dim)
    return g0 - g2 + a_j * g3, g1 + a_i * g2 - g3, g2 * x_j, g3 * x_i


class _SymmPlanes(torch.autograd.Function):
    """[2, Pp, 2, Pp] Gram block of the originals -> [4, 4, Pp, Pp] inner products of the four points.

    One autograd node with a hand-written backward, so that the ~30 small ops of the forward do not each
    record a backward node.
    """

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        a, clamped, axis_sq = reflection_coefficients(h)
        a_i, a_j = a
        left = combine(h[0], h[1], a_i[:, None, None], a_j[:, None, None], dim=0)  # [4, p, k, q]
        ctx.save_for_backward(h, left, a, clamped, axis_sq)
        return combine(left[:, :, 0], left[:, :, 1], a_i, a_j, dim=1)  # [a, b, p, q]

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, grad: Tensor) -> Tensor:
        h, left, a, clamped, axis_sq = ctx.saved_tensors
        a_i, a_j = a
        # right factor (points of pair q), then left factor (points of pair p)
        g_li, g_lj, g_ai_r, g_aj_r = _uncombine(grad, left[:, :, 0], left[:, :, 1], a_i, a_j, dim=1)
        g_left = torch.stack([g_li, g_lj], dim=2)  # [4, p, k, q]
        g_hi, g_hj, g_ai_l, g_aj_l = _uncombine(g_left, h[0], h[1], a_i[:, None, None], a_j[:, None, None], dim=0)
        g_a = torch.stack(
            [g_ai_r.sum(dim=(0, 1)) + g_ai_l.sum(dim=(1, 2)), g_aj_r.sum(dim=(0, 1)) + g_aj_l.sum(dim=(1, 2))]
        )
        g_h = torch.stack([g_hi, g_hj])
        g_diag = g_h.diagonal(0, 1, 3)  # a view: writes land in g_h
        g_ij, g_jj, g_ii = _reflection_backward(g_a, a, clamped, axis_sq)
        g_diag[0, 1] += g_ij
        g_diag[1, 1] += g_jj
        g_diag[0, 0] += g_ii
        return g_h


def _first_max(x: Tensor) -> tuple[Tensor, Tensor]:
    """(amax over dim 0, first index of the max), without ``max(dim)``: on CPU it (and any comparison that
    makes bools) is 5-30x slower than ``amax`` and float arithmetic on a [16, 64, 64] tensor. Below about
    1,000 entries per case the opposite holds (fixed per-op cost dominates), so small inputs use ``max``,
    which also returns the first index on ties."""
    if x[0].numel() <= SMALL_CASE_SIZE:
        return x.max(dim=0)
    n = x.shape[0]
    values = x.amax(dim=0)
    case = torch.arange(n, dtype=x.dtype, device=x.device).view(-1, *([1] * (x.dim() - 1)))
    # key = sign(max - x) + case / n: below 1 exactly at the maxima, smallest at the first one
    key = (values - x).sign_().add_(case, alpha=1.0 / n).amin(dim=0)
    return values, (key * n).round_().long()


class _MaxOverFirstDim(torch.autograd.Function):
    """(max, first index of the max) over dim 0: the values and gradient of ``x.max(dim=0)``."""

    @staticmethod
    def forward(ctx, x: Tensor) -> tuple[Tensor, Tensor]:
        values, index = _first_max(x)
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor, _grad_index: Tensor | None) -> Tensor:
        (index,) = ctx.saved_tensors
        return grad.new_zeros((ctx.n, *grad.shape)).scatter_(0, index.unsqueeze(0), grad.unsqueeze(0))


# ----------------------------------------------------------------------------------------------------
# NumPy: the CPU kernel for few pairs
# ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _tables(combinations: Combinations, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(constant part [2 rows, 1], the a_i / a_j part [2, 2 rows]) of the coefficients, row m * rows + r."""
    table = combinations.table.reshape(3, -1).astype(dtype)
    return table[0][:, None], np.ascontiguousarray(table[1:])


@dataclass
class _KernelSaved:
    """What the kernel's backward needs from its forward (besides the Gram matrix and the selected cases)."""

    diagonal: tuple[np.ndarray, np.ndarray, np.ndarray]  # flat positions of S_ii, S_ij, S_jj in gram
    columns: tuple[np.ndarray, np.ndarray]  # flat positions of (p, first[p]), (p, second[p]) in a [Pp, B] block
    a: np.ndarray  # [2, Pp]: a_i, a_j
    axis_sq: np.ndarray  # [2, Pp]: S_jj, S_ii
    clamped: np.ndarray  # axis_sq clamped to EPS
    matrices: tuple[np.ndarray, np.ndarray]  # C_left [rows_l Pp, B], C_right [rows_r Pp, B]
    left_gram: np.ndarray  # C_left G
    combinations: tuple[Combinations, Combinations]


def _coefficient_matrix(combinations: Combinations, a: np.ndarray, columns: tuple[np.ndarray, ...], n: int):
    """[rows Pp, B]: row r * Pp + p holds the coefficients of row r of pair p at the columns of its originals."""
    const, per_a = _tables(combinations, a.dtype)
    pairs = a.shape[1]
    coef = (const + per_a.T @ a).reshape(2, len(combinations), pairs)  # [m, r, p]
    matrix = np.zeros((len(combinations), pairs * n), a.dtype)
    matrix[:, columns[0]] = coef[0]
    matrix[:, columns[1]] += coef[1]  # += : a pair (i, i) of one sample gets both coefficients
    return matrix.reshape(-1, n)


def _kernel_forward(
    gram: np.ndarray, first: np.ndarray, second: np.ndarray, left: Combinations, right: Combinations
) -> tuple[np.ndarray, np.ndarray, _KernelSaved]:
    n, pairs = gram.shape[0], first.size
    first, second = first.astype(np.int64, copy=False), second.astype(np.int64, copy=False)
    entries = gram.reshape(-1)
    diagonal = (first * n + first, first * n + second, second * n + second)
    axis_sq = np.stack([entries[diagonal[2]], entries[diagonal[0]]])
    a, clamped = reflection_forward(entries[diagonal[1]], axis_sq)
    rows = np.arange(pairs) * n
    columns = (rows + first, rows + second)
    c_left, c_right = (_coefficient_matrix(c, a, columns, n) for c in (left, right))
    left_gram = c_left @ gram
    planes = (left_gram @ c_right.T).reshape(len(left), pairs, len(right), pairs)
    cases = planes.transpose(1, 3, 0, 2).reshape(pairs, pairs, -1)  # [p, q, a * rows_right + b]
    index = cases.argmax(-1)  # the first maximum
    saved = _KernelSaved(diagonal, columns, a, axis_sq, clamped, (c_left, c_right), left_gram, (left, right))
    return cases.max(-1), index, saved


def _kernel_backward(grad: np.ndarray, index: np.ndarray, gram: np.ndarray, saved: _KernelSaved) -> np.ndarray:
    """Gradient of the [B, B] Gram matrix from that of the [Pp, Pp] hardest values."""
    (left, right), (c_left, c_right) = saved.combinations, saved.matrices
    n, pairs = gram.shape[0], index.shape[0]
    g_cases = np.zeros((pairs * pairs, len(left) * len(right)), grad.dtype)
    g_cases[np.arange(pairs * pairs), index.reshape(-1)] = grad.reshape(-1)
    g_planes = g_cases.reshape(pairs, pairs, len(left), len(right)).transpose(2, 0, 3, 1)
    g_planes = g_planes.reshape(len(left) * pairs, len(right) * pairs)
    g_planes_right = g_planes @ c_right
    g_gram = c_left.T @ g_planes_right  # planes = C_l G C_r^T
    g_a = 0.0
    for combinations, g_matrix in ((left, g_planes_right @ gram.T), (right, g_planes.T @ saved.left_gram)):
        by_pair = g_matrix.reshape(len(combinations), pairs * n)
        g_coef = np.concatenate([by_pair[:, saved.columns[0]], by_pair[:, saved.columns[1]]])  # [m * rows + r, p]
        g_a = g_a + _tables(combinations, grad.dtype)[1] @ g_coef
    # a onto the pairs' own Gram entries; add.at: correct even if pairs share a sample
    g_entries = g_gram.reshape(-1)
    ii, ij, jj = saved.diagonal
    g_ij, g_jj, g_ii = _reflection_backward(g_a, saved.a, saved.clamped, saved.axis_sq)
    np.add.at(g_entries, ij, g_ij)
    np.add.at(g_entries, jj, g_jj)
    np.add.at(g_entries, ii, g_ii)
    return g_gram


class _HardestCombinationKernel(torch.autograd.Function):
    """Gram [B, B] -> (largest <left row of pair p, right row of pair q>, its index a * rows_right + b)."""

    @staticmethod
    def forward(ctx, gram: Tensor, first: Tensor, second: Tensor, left: Combinations, right: Combinations):
        values, index, ctx.kernel = _kernel_forward(gram.numpy(), first.numpy(), second.numpy(), left, right)
        index = torch.from_numpy(index)
        ctx.save_for_backward(gram, index)  # through autograd: an in-place change to either is an error
        ctx.mark_non_differentiable(index)
        return torch.from_numpy(values), index

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, grad: Tensor, _grad_index: Tensor | None):
        gram, index = (t.detach().numpy() for t in ctx.saved_tensors)
        return torch.from_numpy(_kernel_backward(grad.numpy(), index, gram, ctx.kernel)), None, None, None, None


def pair_starts_numpy(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(stable argsort of labels, sorted positions that open a pair: even rank in its class, next one same)."""
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    same_as_next = sorted_labels[1:] == sorted_labels[:-1]
    index = np.arange(len(labels))
    class_start = np.maximum.accumulate(np.where(np.concatenate(([True], ~same_as_next)), index, 0))
    opens = ((index - class_start) % 2 == 0)[:-1] & same_as_next
    return order, np.flatnonzero(opens)
