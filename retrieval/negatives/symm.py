"""Symmetrical Synthesis (Gu & Ko, AAAI 2020): synthetic points by reflection, hardest of 16 negative pairs.

For a pair (x_k, x_l) of one class, x_k' is x_k reflected about the axis x_l and x_l' is x_l reflected about
x_k (section 3.1, eq. 1-2 with alpha = 2, beta = 1). Reflection keeps the norm and the similarity to the
axis, so (x_k', x_l) and (x_k, x_l') are as similar as (x_k, x_l).

For a positive pair (i, j) and a pair (k, l) of another class, the negative pairs are the 16 pairs of
{x_i, x_j, x_i', x_j'} x {x_k, x_l, x_k', x_l'} (section 3.2); the loss uses the hardest one. Every point is
a combination of its pair's two originals, x_i' = 2 (S_ij / S_jj) x_j - x_i, so the 16 inner products are
affine in the Gram entries of the originals: nothing of size D is built per pair, and the [4, 4, Pp, Pp]
planes come from the gathered Gram block by broadcasts (one autograd node, hand-written backward).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from retrieval.distances import EPS

# Order of the four points of a pair: the two originals, then their synthetic reflections.
POINT_NAMES = ("x_i", "x_j", "x_i'", "x_j'")
IS_SYNTHETIC = torch.tensor([False, False, True, True])


def reflect(x: torch.Tensor, axis: torch.Tensor) -> torch.Tensor:
    """x' = 2 (x . u) u - x with u = axis / |axis| (eq. 1-2, alpha = 2, beta = 1); rows of [..., D]."""
    if x.shape != axis.shape:
        raise ValueError(f"x and axis must have the same shape, got {tuple(x.shape)} and {tuple(axis.shape)}")
    axis_norm = axis.norm(dim=-1, keepdim=True)
    if (axis_norm <= EPS).any():
        raise ValueError("reflect: an axis has zero norm, so it defines no direction; drop zero embeddings")
    u = axis / axis_norm
    return 2.0 * (x * u).sum(dim=-1, keepdim=True) * u - x


# Rows of the flattened 2x2 diagonal block (S_ii, S_ij, S_ji, S_jj) that divide a_i and a_j.
_AXIS_ROWS = torch.tensor([3, 0])


def _reflection_coefficients(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a = (a_i, a_j), the axes' squared norms clamped to EPS, and unclamped), each [2, Pp], per pair.

    x_i' = a_i x_j - x_i with a_i = 2 S_ij / S_jj; x_j' = a_j x_i - x_j with a_j = 2 S_ij / S_ii (eq. 1-2).
    """
    block = torch.diagonal(h, dim1=1, dim2=3).reshape(4, -1)  # S_ii, S_ij, S_ji, S_jj per pair
    axis_sq = block.index_select(0, _AXIS_ROWS.to(h.device))  # S_jj (axis of x_i), S_ii (axis of x_j)
    clamped = axis_sq.clamp_min(EPS)
    return 2.0 * block[1] / clamped, clamped, axis_sq


Tensor = torch.Tensor


def _combine(x_i: Tensor, x_j: Tensor, a_i: Tensor, a_j: Tensor, dim: int) -> Tensor:
    """Stack (x_i, x_j, a_i x_j - x_i, a_j x_i - x_j) along ``dim``: originals, then reflections."""
    return torch.stack([x_i, x_j, a_i * x_j - x_i, a_j * x_i - x_j], dim=dim)


def _uncombine(g: Tensor, x_i: Tensor, x_j: Tensor, a_i: Tensor, a_j: Tensor, dim: int) -> tuple[Tensor, ...]:
    """Backward of ``_combine``: gradients of x_i, x_j and of a_i, a_j (not yet summed over broadcasts)."""
    g0, g1, g2, g3 = g.unbind(dim)
    return g0 - g2 + a_j * g3, g1 + a_i * g2 - g3, g2 * x_j, g3 * x_i


def _planes_forward(h: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """[4, 4, Pp, Pp] planes from the [2, Pp, 2, Pp] Gram block, and what the backward needs."""
    a, clamped, axis_sq = _reflection_coefficients(h)
    a_i, a_j = a
    left = _combine(h[0], h[1], a_i[:, None, None], a_j[:, None, None], dim=0)  # [4, p, k, q]
    l_i, l_j = left[:, :, 0], left[:, :, 1]  # [4, p, q]: point a of pair p against x_k, x_l of pair q
    return _combine(l_i, l_j, a_i, a_j, dim=1), (h, left, a, clamped, axis_sq)  # [a, b, p, q]


def _planes_backward(grad: torch.Tensor, saved: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Gradient of the [2, Pp, 2, Pp] Gram block from that of the [4, 4, Pp, Pp] planes."""
    h, left, a, clamped, axis_sq = saved
    a_i, a_j = a
    # right factor (points of pair q), then left factor (points of pair p)
    g_li, g_lj, g_ai_r, g_aj_r = _uncombine(grad, left[:, :, 0], left[:, :, 1], a_i, a_j, dim=1)
    g_left = torch.stack([g_li, g_lj], dim=2)  # [4, p, k, q]
    g_hi, g_hj, g_ai_l, g_aj_l = _uncombine(g_left, h[0], h[1], a_i[:, None, None], a_j[:, None, None], dim=0)
    g_a = torch.stack(
        [g_ai_r.sum(dim=(0, 1)) + g_ai_l.sum(dim=(1, 2)), g_aj_r.sum(dim=(0, 1)) + g_aj_l.sum(dim=(1, 2))]
    )
    g_h = torch.stack([g_hi, g_hj])
    # a = 2 S_ij / max(axis_sq, EPS): chain rule onto the pairs' diagonal blocks
    g_over = g_a / clamped
    g_diag = torch.diagonal(g_h, dim1=1, dim2=3)  # a view: writes land in g_h
    g_diag[0, 1] += 2.0 * g_over.sum(dim=0)
    g_axis = g_over * a * (axis_sq >= EPS)
    g_diag[1, 1] -= g_axis[0]
    g_diag[0, 0] -= g_axis[1]
    return g_h


SMALL_CASE_SIZE = 1024  # entries per case up to which torch.max(dim=0) beats the amax route on CPU


def _first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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


def _scatter_to_index(grad: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """Backward of taking entry ``index`` along a new dim 0 of size n."""
    return grad.new_zeros((n, *grad.shape)).scatter_(0, index.unsqueeze(0), grad.unsqueeze(0))


class _SymmPlanes(torch.autograd.Function):
    """[2, Pp, 2, Pp] Gram block of the originals -> [4, 4, Pp, Pp] inner products of the four points.

    One autograd node with a hand-written backward, so that the ~30 small ops of the forward do not each
    record a backward node (at B = 32 per-op overhead is most of the Symm losses' extra cost).
    """

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> torch.Tensor:
        planes, saved = _planes_forward(h)
        ctx.save_for_backward(*saved)
        return planes

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _planes_backward(grad, ctx.saved_tensors)


class _HardestOf16(torch.autograd.Function):
    """Gram block -> (largest of the 16 inner products, its index a * 4 + b), [Pp, Pp] each, in one node."""

    @staticmethod
    def forward(ctx, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        planes, saved = _planes_forward(h)
        values, index = _first_max(planes.flatten(0, 1))
        ctx.save_for_backward(index, *saved)
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_index: torch.Tensor | None) -> torch.Tensor:
        index, *saved = ctx.saved_tensors
        return _planes_backward(_scatter_to_index(grad, index, 16).view(4, 4, *grad.shape), saved)


class _MaxOverFirstDim(torch.autograd.Function):
    """(max, first index of the max) over dim 0: the values and gradient of ``x.max(dim=0)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, index = _first_max(x)
        ctx.save_for_backward(index)
        ctx.n = x.shape[0]
        ctx.mark_non_differentiable(index)
        return values, index

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor, _grad_index: torch.Tensor | None) -> torch.Tensor:
        (index,) = ctx.saved_tensors
        return _scatter_to_index(grad, index, ctx.n)


def max_over_cases(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.max(dim=0)`` (values, indices; the first maximum on ties) for a NaN-free float tensor."""
    if x.shape[0] == 0:
        raise ValueError("max_over_cases: dim 0 is empty, there is no case to take the maximum of")
    return _MaxOverFirstDim.apply(x)


def _gram_block(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[2, Pp, 2, Pp] block [m, p, k, q] = <original m of pair p, original k of pair q>."""
    n = first.numel()
    # index_select (backward: index_add) rather than advanced indexing (backward: sorted index_put)
    ends = torch.cat([first, second])
    return gram.index_select(0, ends).index_select(1, ends).view(2, n, 2, n)


def hardest_of_16(gram: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """[Pp, Pp] largest of the 16 inner products of pairs p and q, and its index a * 4 + b (first on ties).

    The values and gradient of ``symm_inner_products(...).flatten(2).max(dim=2)``, in one autograd node.
    """
    return _HardestOf16.apply(_gram_block(gram, first, second))


def symm_inner_product_planes(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[4, 4, Pp, Pp]: entry [a, b, p, q] is <point a of pair p, point b of pair q>.

    ``gram`` is the [B, B] inner-product matrix of the embeddings the loss works on (unit or raw). The 16
    cases are the outer dimensions so that reductions over them run over contiguous planes.
    """
    return _SymmPlanes.apply(_gram_block(gram, first, second))


def symm_inner_products(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, Pp, 4, 4]: <point a of pair p, point b of pair q> for every two positive pairs p, q."""
    return symm_inner_product_planes(gram, first, second).permute(2, 3, 0, 1)


def point_sq_norms(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, 4] squared norms of the four points of each pair (reflection keeps the norm)."""
    n_i, n_j = gram[first, first], gram[second, second]
    return torch.stack([n_i, n_j, n_i, n_j], dim=-1)


def symm_sq_distances(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, Pp, 4, 4] squared Euclidean distances between the points of pair p and those of pair q."""
    dots = symm_inner_products(gram, first, second)
    norms = point_sq_norms(gram, first, second)
    return (norms[:, None, :, None] + norms[None, :, None, :] - 2.0 * dots).clamp_min(0.0)


# Number of synthetic points (0, 1 or 2) in each of the 16 pairs, indexed a * 4 + b.
_SYNTHETIC_COUNT = (IS_SYNTHETIC.view(4, 1).float() + IS_SYNTHETIC.view(1, 4).float()).flatten()


def synthetic_share(selected: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Share of synthetic points among the selected hardest pairs (Figure 7's ratio^(syn)).

    ``selected`` holds flattened indices a * 4 + b into the 4 x 4 grid (a: positive-side point,
    b: negative-side point); ``used`` marks the entries that are negative pairs.
    """
    if selected.device.type == "cpu":  # NumPy: a few microseconds instead of eight torch dispatches
        counts = _SYNTHETIC_COUNT.numpy()[selected.numpy()][used.numpy()]
        return torch.tensor(counts.sum() / max(2 * counts.size, 1), dtype=torch.float32)
    return synthetic_share_on_device(selected, used)


@torch.no_grad()
def synthetic_share_on_device(selected: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """``synthetic_share`` without leaving the tensors' device (the path a GPU batch takes)."""
    syn = _SYNTHETIC_COUNT.to(selected.device)[selected]  # points 2, 3 are the synthetic ones
    return (syn * used).sum() / (2 * used.sum()).clamp_min(1)
