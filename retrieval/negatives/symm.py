"""Symmetrical Synthesis (Gu & Ko, AAAI 2020): synthetic points by reflection, hardest of 16 negative pairs.

For a pair (x_k, x_l) of one class, x_k' is x_k reflected about the axis x_l and x_l' is x_l reflected about
x_k (section 3.1, eq. 1-2 with alpha = 2, beta = 1). Reflection keeps the norm and the similarity to the
axis, so (x_k', x_l) and (x_k, x_l') are as similar as (x_k, x_l).

For a positive pair (i, j) and a pair (k, l) of another class, the negative pairs are the 16 pairs of
{x_i, x_j, x_i', x_j'} x {x_k, x_l, x_k', x_l'} (section 3.2); the loss uses the hardest one. Every point is
a combination of its pair's two originals, x_i' = 2 (S_ij / S_jj) x_j - x_i, so the 16 inner products are
A_p H_pq A_q^T with H_pq the 2x2 Gram block of the originals: nothing of size D is built per pair.
"""

from __future__ import annotations

import torch

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


def pair_point_coefficients(gram_ii: torch.Tensor, gram_jj: torch.Tensor, gram_ij: torch.Tensor) -> torch.Tensor:
    """[Pp, 4, 2]: x_i, x_j, x_i' (about x_j), x_j' (about x_i) as combinations of (x_i, x_j)."""
    # x_i' = a_i x_j - x_i with a_i = 2 S_ij / S_jj; x_j' = a_j x_i - x_j with a_j = 2 S_ij / S_ii.
    a = 2.0 * gram_ij.unsqueeze(-1) / torch.stack([gram_ii, gram_jj], dim=-1).clamp_min(EPS)  # [a_j, a_i]
    template = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0]], dtype=a.dtype, device=a.device)
    slots = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=a.dtype, device=a.device)
    return template + slots * a.unsqueeze(1)  # row 2 gets a_i in column 1, row 3 gets a_j in column 0


def symm_inner_products(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, Pp, 4, 4]: <point a of pair p, point b of pair q> for every two positive pairs p, q.

    ``gram`` is the [B, B] inner-product matrix of the embeddings the loss works on (unit or raw).
    """
    coef = pair_point_coefficients(gram[first, first], gram[second, second], gram[first, second])
    ends = torch.stack([first, second], dim=-1).reshape(-1)  # x_i, x_j of pair 0, then of pair 1, ...
    n = first.numel()
    # index_select (backward: index_add) rather than 4-D advanced indexing (backward: sorted index_put)
    h = gram.index_select(0, ends).index_select(1, ends).view(n, 2, n, 2).transpose(1, 2)  # [Pp, Pp, 2, 2]
    return torch.einsum("pam,pqmn,qbn->pqab", coef, h, coef)


def point_sq_norms(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, 4] squared norms of the four points of each pair (reflection keeps the norm)."""
    n_i, n_j = gram[first, first], gram[second, second]
    return torch.stack([n_i, n_j, n_i, n_j], dim=-1)


def symm_sq_distances(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """[Pp, Pp, 4, 4] squared Euclidean distances between the points of pair p and those of pair q."""
    dots = symm_inner_products(gram, first, second)
    norms = point_sq_norms(gram, first, second)
    return (norms[:, None, :, None] + norms[None, :, None, :] - 2.0 * dots).clamp_min(0.0)


def synthetic_share(selected: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Share of synthetic points among the selected hardest pairs (Figure 7's ratio^(syn)).

    ``selected`` holds flattened indices a * 4 + b into the 4 x 4 grid (a: positive-side point,
    b: negative-side point); ``used`` marks the entries that are negative pairs.
    """
    with torch.no_grad():
        syn = (selected // 4 >= 2).float() + (selected % 4 >= 2).float()  # points 2, 3 are the synthetic ones
        return (syn * used).sum() / (2 * used.sum()).clamp_min(1)
