"""The fast Symm path: hand-written backward of the 16 inner products, and the amax-based max over cases."""

from __future__ import annotations

import itertools

import pytest
import torch

from retrieval.negatives.pairs import positive_pairs
from retrieval.negatives.symm import (
    hardest_of_16,
    max_over_cases,
    reflect,
    symm_inner_product_planes,
    symm_inner_products,
)

F64 = torch.float64


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


def slow_inner_products(gram: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Obvious reference: each point as explicit coefficients on (x_i, x_j), Gram entries read one by one."""
    n = first.numel()
    out = gram.new_zeros(n, n, 4, 4)
    coefs = []
    for p in range(n):
        i, j = int(first[p]), int(second[p])
        a_i = 2.0 * gram[i, j] / gram[j, j]  # x_i' = a_i x_j - x_i
        a_j = 2.0 * gram[i, j] / gram[i, i]  # x_j' = a_j x_i - x_j
        coefs.append((i, j, [(1.0, 0.0), (0.0, 1.0), (-1.0, a_i), (a_j, -1.0)]))
    for p, q in itertools.product(range(n), repeat=2):
        i, j, cp = coefs[p]
        k, l, cq = coefs[q]
        for a, b in itertools.product(range(4), repeat=2):
            (u0, u1), (v0, v1) = cp[a], cq[b]
            out[p, q, a, b] = (
                u0 * v0 * gram[i, k] + u0 * v1 * gram[i, l] + u1 * v0 * gram[j, k] + u1 * v1 * gram[j, l]
            )
    return out


def test_inner_products_match_reflected_points_and_planes_layout() -> None:
    x = randn(8, 5, seed=1)
    pairs = positive_pairs(torch.tensor([0, 1, 0, 1, 2, 2, 3, 3]))
    dots = symm_inner_products(x @ x.T, pairs.first, pairs.second)
    planes = symm_inner_product_planes(x @ x.T, pairs.first, pairs.second)
    assert torch.equal(planes.permute(2, 3, 0, 1), dots)
    for p, q in itertools.product(range(len(pairs)), repeat=2):
        i, j, k, l = int(pairs.first[p]), int(pairs.second[p]), int(pairs.first[q]), int(pairs.second[q])
        pts_p = [x[i], x[j], reflect(x[i][None], x[j][None])[0], reflect(x[j][None], x[i][None])[0]]
        pts_q = [x[k], x[l], reflect(x[k][None], x[l][None])[0], reflect(x[l][None], x[k][None])[0]]
        for a, b in itertools.product(range(4), repeat=2):
            assert float(dots[p, q, a, b]) == pytest.approx(float(pts_p[a] @ pts_q[b]), abs=1e-10)


def test_inner_product_gradient_matches_reference_on_any_gram() -> None:
    """The hand-written backward, entry by entry (a non-symmetric Gram: every entry is its own input)."""
    pairs = positive_pairs(torch.tensor([0, 1, 0, 1, 2, 2]))
    gram = randn(6, 6, seed=2) + 4.0 * torch.eye(6, dtype=F64)  # diagonal well away from 0
    weights = randn(len(pairs), len(pairs), 4, 4, seed=3)
    g_fast = gram.clone().requires_grad_(True)
    (symm_inner_products(g_fast, pairs.first, pairs.second) * weights).sum().backward()
    g_slow = gram.clone().requires_grad_(True)
    (slow_inner_products(g_slow, pairs.first, pairs.second) * weights).sum().backward()
    assert torch.allclose(g_fast.grad, g_slow.grad, atol=1e-10)
    assert torch.autograd.gradcheck(
        lambda g: symm_inner_products(g, pairs.first, pairs.second), (gram.clone().requires_grad_(True),)
    )


def test_inner_products_finite_for_a_zero_embedding() -> None:
    """A zero embedding's S_ii is clamped: values and gradient stay finite (no 0 / 0)."""
    x = randn(4, 3, seed=4)
    x[1] = 0.0
    gram = (x @ x.T).requires_grad_(True)
    pairs = positive_pairs(torch.tensor([0, 0, 1, 1]))
    out = symm_inner_products(gram, pairs.first, pairs.second)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(gram.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", [(5, 7), (40, 41)], ids=["small-torch-max", "large-amax-route"])
def test_max_over_cases_matches_torch_max_with_ties(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    rows, cols = shape
    x = torch.randint(0, 3, (16, rows, cols), generator=torch.Generator().manual_seed(5)).to(dtype)  # many ties
    x[:, 0, 0] = 2.0  # a full tie: the first case wins
    values, index = max_over_cases(x.clone().requires_grad_(True))
    expected = torch.zeros(rows, cols, dtype=torch.long)
    for r, c in itertools.product(range(rows), range(cols)):
        expected[r, c] = int(torch.nonzero(x[:, r, c] == x[:, r, c].max())[0])  # the first maximum
    assert torch.equal(values, x.amax(0)) and torch.equal(index, expected)
    assert int(index[0, 0]) == 0
    leaf = x.clone().requires_grad_(True)
    upstream = torch.arange(rows * cols, dtype=dtype).view(rows, cols)
    (max_over_cases(leaf)[0] * upstream).sum().backward()
    reference = torch.zeros_like(x)
    for r, c in itertools.product(range(rows), range(cols)):
        reference[expected[r, c], r, c] = upstream[r, c]  # the whole gradient to the first maximum
    assert torch.equal(leaf.grad, reference)


def test_max_over_cases_rejects_no_cases() -> None:
    with pytest.raises(ValueError, match="empty"):
        max_over_cases(torch.zeros(0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_hardest_of_16_matches_max_over_the_inner_products(dtype: torch.dtype) -> None:
    """The fused node: same values, indices and gradient as max over symm_inner_products' 16 cases."""
    x = randn(16, 8, seed=6).to(dtype)
    x[5] = x[4]  # a pair of identical points: its reflections coincide with the originals (ties)
    labels = torch.arange(4).repeat_interleave(4)
    pairs = positive_pairs(labels)
    weights = randn(len(pairs), len(pairs), seed=7).to(dtype)
    g_ref = (x @ x.T).requires_grad_(True)
    ref_values, ref_index = symm_inner_products(g_ref, pairs.first, pairs.second).flatten(2).max(dim=2)
    (ref_values * weights).sum().backward()
    g_fast = (x @ x.T).requires_grad_(True)
    values, index = hardest_of_16(g_fast, pairs.first, pairs.second)
    (values * weights).sum().backward()
    assert torch.equal(values, ref_values)
    assert torch.equal(index, ref_index)
    assert torch.allclose(g_fast.grad, g_ref.grad, atol=1e-5 if dtype == torch.float32 else 1e-12)


def test_double_backward_is_refused_not_wrong() -> None:
    pairs = positive_pairs(torch.tensor([0, 0, 1, 1]))
    gram = (randn(4, 3, seed=8) @ randn(4, 3, seed=8).T).requires_grad_(True)
    values, _ = hardest_of_16(gram, pairs.first, pairs.second)
    (grad,) = torch.autograd.grad(values.sum(), gram, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()
