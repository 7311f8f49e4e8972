"""Symmetrical synthesis: reflection properties and the 16 negative pairs against brute force."""

from __future__ import annotations

import itertools

import pytest
import torch

from retrieval.negatives.pairs import positive_pairs
from retrieval.negatives.symm import reflect, symm_inner_products, symm_sq_distances

F64 = torch.float64


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def test_reflection_properties() -> None:
    x, axis = randn(50, 9, seed=1), randn(50, 9, seed=2) * 3.0
    r = reflect(x, axis)
    u = axis / axis.norm(dim=1, keepdim=True)
    assert torch.allclose(r.norm(dim=1), x.norm(dim=1))  # norm preserved
    assert torch.allclose((r * u).sum(1), (x * u).sum(1))  # similarity to the axis preserved
    assert torch.allclose(reflect(r, axis), x)  # an involution
    assert torch.allclose(reflect(x, axis * 0.01), r)  # only the axis direction matters
    # eq. 2 with alpha = 2, beta = 1: x' = 2 r - x with r the projection on the axis (eq. 1)
    assert torch.allclose(r, 2 * (x * u).sum(1, keepdim=True) * u - x)
    assert not torch.allclose(r, x)


def test_reflection_rejects_zero_axis() -> None:
    with pytest.raises(ValueError, match="zero norm"):
        reflect(randn(2, 3), torch.zeros(2, 3, dtype=F64))


def explicit_points(x: torch.Tensor, i: int, j: int) -> list[torch.Tensor]:
    return [x[i], x[j], reflect(x[i][None], x[j][None])[0], reflect(x[j][None], x[i][None])[0]]


@pytest.mark.parametrize("normalize", [True, False])
def test_sixteen_pairs_and_hardest_match_brute_force(normalize: bool) -> None:
    x = randn(12, 6, seed=3)
    if normalize:
        x = x / x.norm(dim=1, keepdim=True)
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
    pairs = positive_pairs(labels)
    gram = x @ x.T
    dots = symm_inner_products(gram, pairs.first, pairs.second)
    sq = symm_sq_distances(gram, pairs.first, pairs.second)
    hardest_idx = sq.flatten(2).argmin(2)
    for p, q in itertools.product(range(len(pairs)), repeat=2):
        pts_p = explicit_points(x, int(pairs.first[p]), int(pairs.second[p]))
        pts_q = explicit_points(x, int(pairs.first[q]), int(pairs.second[q]))
        best, best_ab = float("inf"), None
        for a, b in itertools.product(range(4), repeat=2):  # scan the 16 negative pairs
            assert dots[p, q, a, b].item() == pytest.approx(float(pts_p[a] @ pts_q[b]), abs=1e-10)
            d2 = float(((pts_p[a] - pts_q[b]) ** 2).sum())
            assert sq[p, q, a, b].item() == pytest.approx(d2, abs=1e-10)
            if d2 < best:
                best, best_ab = d2, a * 4 + b
        if pairs.labels[p] != pairs.labels[q]:
            assert int(hardest_idx[p, q]) == best_ab


def test_synthetic_points_keep_positive_similarity() -> None:
    """x_i . x_j = x_i' . x_j = x_i . x_j' (section 3.1): the positive side of the loss is unchanged."""
    x = randn(2, 7, seed=5)
    xi, xj, xi_s, xj_s = explicit_points(x, 0, 1)
    assert float(xi_s @ xj) == pytest.approx(float(xi @ xj))
    assert float(xi @ xj_s) == pytest.approx(float(xi @ xj))
