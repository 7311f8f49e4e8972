"""Symmetrical Synthesis (Gu & Ko, AAAI 2020): synthetic points by reflection, hardest of 16 negative pairs.

For a pair (x_k, x_l) of one class, x_k' is x_k reflected about the axis x_l and x_l' is x_l reflected about
x_k (section 3.1, eq. 1-2 with alpha = 2, beta = 1). Reflection keeps the norm and the similarity to the
axis, so (x_k', x_l) and (x_k, x_l') are as similar as (x_k, x_l).

For a positive pair (i, j) and a pair (k, l) of another class, the negative pairs are the 16 pairs of
{x_i, x_j, x_i', x_j'} x {x_k, x_l, x_k', x_l'} (section 3.2); the loss uses the hardest one.

Every point is a combination c_0 x_i + c_1 x_j of its pair's two originals (``points.py``), so the inner
product of a point of pair p and a point of pair q is the bilinear form c(p)^T H_pq c(q) on the 2 x 2 Gram
block H_pq of the originals: nothing of size D is built per pair. This module holds the readable torch form
(``combination_inner_products``, differentiable by autograd); ``hardest_combination`` runs the speed kernels
of ``kernels.py``, which compute the same values and gradients.
"""

from __future__ import annotations

import torch

from retrieval.distances import EPS, gram_matrix, l2_normalize
from retrieval.negatives.base import HardNegativeMethod
from retrieval.negatives.kernels import hardest_combination, synthetic_share_numpy
from retrieval.negatives.pairs import PositivePairs
from retrieval.negatives.points import (
    POINT_NAMES,
    POINTS,
    Combinations,
    combine,
    pair_gram_block,
    reflection_coefficients,
    sum_rows,
    synthetic_counts,
)
from retrieval.utils.reads import Stat, device_constant

Tensor = torch.Tensor

__all__ = [
    "ANGULAR_POSITIVE_SUMS",
    "POINTS",
    "POINT_NAMES",
    "Combinations",
    "SymmetricalSynthesis",
    "combination_inner_products",
    "hardest_combination",
    "hardest_of_16",
    "point_sq_norms",
    "reflect",
    "symm_inner_products",
    "symm_sq_distances",
    "synthetic_share",
    "synthetic_share_on_device",
]

# Positive-side pairs congruent to (x_i, x_j) under the reflections (same similarity): (x_i, x_j),
# (x_i', x_j) and (x_i, x_j'), summed as x_p + x_q (the angular loss's negative side, eq. 10).
ANGULAR_POSITIVE_SUMS = Combinations(((0, 1), (2, 1), (0, 3)))


def reflect(x: Tensor, axis: Tensor) -> Tensor:
    """x' = 2 (x . u) u - x with u = axis / |axis| (eq. 1-2, alpha = 2, beta = 1); rows of [..., D]."""
    if x.shape != axis.shape:
        raise ValueError(f"x and axis must have the same shape, got {tuple(x.shape)} and {tuple(axis.shape)}")
    axis_norm = axis.norm(dim=-1, keepdim=True)
    if (axis_norm <= EPS).any():
        raise ValueError("reflect: an axis has zero norm, so it defines no direction; drop zero embeddings")
    u = axis / axis_norm
    return 2.0 * (x * u).sum(dim=-1, keepdim=True) * u - x


def combination_inner_products(
    gram: Tensor, first: Tensor, second: Tensor, left: Combinations = POINTS, right: Combinations = POINTS
) -> Tensor:
    """[rows_left, rows_right, Pp, Pp]: <left row a of pair p, right row b of pair q>.

    ``gram`` is the [B, B] inner-product matrix of the embeddings the loss works on (unit or raw); pair p is
    (first[p], second[p]).
    """
    h = pair_gram_block(gram, first, second)  # [m, p, k, q]
    (a_i, a_j), _, _ = reflection_coefficients(h)
    left_points = combine(h[0], h[1], a_i[:, None, None], a_j[:, None, None], dim=0)  # [4, p, k, q]
    planes = combine(left_points[:, :, 0], left_points[:, :, 1], a_i, a_j, dim=1)  # [a, b, p, q]
    return sum_rows(sum_rows(planes, left, 0), right, 1)


def hardest_of_16(gram: Tensor, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    """[Pp, Pp] largest of the 16 inner products of pairs p and q, and its index a * 4 + b (first on ties)."""
    return hardest_combination(gram, first, second)


def symm_inner_products(gram: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """[Pp, Pp, 4, 4]: <point a of pair p, point b of pair q> for every two positive pairs p, q."""
    return combination_inner_products(gram, first, second).permute(2, 3, 0, 1)


def point_sq_norms(gram: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """[Pp, 4] squared norms of the four points of each pair (reflection keeps the norm)."""
    n_i, n_j = gram[first, first], gram[second, second]
    return torch.stack([n_i, n_j, n_i, n_j], dim=-1)


def symm_sq_distances(gram: Tensor, first: Tensor, second: Tensor) -> Tensor:
    """[Pp, Pp, 4, 4] squared Euclidean distances between the points of pair p and those of pair q."""
    dots = symm_inner_products(gram, first, second)
    norms = point_sq_norms(gram, first, second)
    return (norms[:, None, :, None] + norms[None, :, None, :] - 2.0 * dots).clamp_min(0.0)


def synthetic_share(
    selected: Tensor, used: Tensor, left: Combinations = POINTS, right: Combinations = POINTS
) -> Tensor:
    """Share of synthetic points among the points of the selected hardest cases (Figure 7's ratio^(syn)).

    ``selected`` holds flattened case indices a * len(right) + b (as ``hardest_combination`` returns them);
    ``used`` marks the entries that are negative pairs.
    """
    if selected.device.type == "cpu":
        return synthetic_share_numpy(selected, used, left, right)
    return synthetic_share_on_device(selected, used, left, right)


@torch.no_grad()
def synthetic_share_on_device(
    selected: Tensor, used: Tensor, left: Combinations = POINTS, right: Combinations = POINTS
) -> Tensor:
    """``synthetic_share`` without leaving the tensors' device (the path a GPU batch takes)."""
    counts = device_constant(tuple(synthetic_counts(left, right).tolist()), torch.float32, selected.device)
    return (counts[selected] * used).sum() / ((left.points + right.points) * used.sum()).clamp_min(1)


class SymmetricalSynthesis(HardNegativeMethod):
    """Symm (section 3.2): the hardest negative of pairs p, q is the most similar of the 16 pairs of their
    points (of the loss's ``positive_rows`` against the 4 points for the angular loss, eq. 10), on unit
    embeddings or, for the losses on raw inner products (N-pair, angular, section 4.2), on raw ones.

    ``synthetic_negative_share``: the share of synthetic points in the hardest pairs used (Figure 7).
    """

    supports_rows = True
    empty_stats = {"synthetic_negative_share": 0.0}

    def gram(self, embeddings: Tensor, unit: bool) -> Tensor:
        # gram_matrix: the values of x @ x.T with a one-matmul backward (the largest cost at D = 512)
        return gram_matrix(l2_normalize(embeddings) if unit else embeddings)

    def hardest(
        self, gram: Tensor, pairs: PositivePairs, negative: Tensor, rows: Combinations | None, *,
        columns: PositivePairs | None = None, combinations: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, dict[str, Stat]]:
        """Every pair of pairs scored at once (``combinations`` unused); Algorithm 1's pairs only (no ``columns``)."""
        left = POINTS if rows is None else rows
        hardest, selected = hardest_combination(gram, pairs.first, pairs.second, left=left)
        return hardest, {"synthetic_negative_share": synthetic_share(selected, negative, left=left)}
