"""The fast Symm path: the planes node (torch, hand-written backward) against a slow reference, and the hardest
case (NumPy kernel, torch max node) against autograd through the max over the planes."""

from __future__ import annotations

import itertools

import pytest
import torch

from retrieval.negatives import kernels
from retrieval.negatives.pairs import positive_pairs
from retrieval.negatives.symm import (
    POINTS,
    Combinations,
    combination_inner_products,
    hardest_combination,
    hardest_of_16,
    reflect,
    symm_inner_products,
    synthetic_share,
    synthetic_share_on_device,
)

F64 = torch.float64
ANGULAR = Combinations(((0, 1), (2, 1), (0, 3)))  # x_i + x_j, x_i' + x_j, x_i + x_j'


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
            out[p, q, a, b] = u0 * v0 * gram[i, k] + u0 * v1 * gram[i, l] + u1 * v0 * gram[j, k] + u1 * v1 * gram[j, l]
    return out


def test_inner_products_match_reflected_points_and_planes_layout() -> None:
    x = randn(8, 5, seed=1)
    pairs = positive_pairs(torch.tensor([0, 1, 0, 1, 2, 2, 3, 3]))
    dots = symm_inner_products(x @ x.T, pairs.first, pairs.second)
    planes = combination_inner_products(x @ x.T, pairs.first, pairs.second)
    sums = combination_inner_products(x @ x.T, pairs.first, pairs.second, left=ANGULAR)
    assert torch.equal(planes.permute(2, 3, 0, 1), dots)
    for p, q in itertools.product(range(len(pairs)), repeat=2):
        i, j, k, l = int(pairs.first[p]), int(pairs.second[p]), int(pairs.first[q]), int(pairs.second[q])
        pts_p = [x[i], x[j], reflect(x[i][None], x[j][None])[0], reflect(x[j][None], x[i][None])[0]]
        pts_q = [x[k], x[l], reflect(x[k][None], x[l][None])[0], reflect(x[l][None], x[k][None])[0]]
        for a, b in itertools.product(range(4), repeat=2):
            assert float(dots[p, q, a, b]) == pytest.approx(float(pts_p[a] @ pts_q[b]), abs=1e-10)
        for row, (a1, a2) in enumerate([(0, 1), (2, 1), (0, 3)]):  # x_i + x_j, x_i' + x_j, x_i + x_j'
            for b in range(4):
                assert float(sums[row, b, p, q]) == pytest.approx(float((pts_p[a1] + pts_p[a2]) @ pts_q[b]), abs=1e-10)


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


@pytest.fixture(params=["numpy", "torch"])
def backend(request, monkeypatch) -> str:
    """Run the hardest-case node in NumPy (CPU, few pairs) or in torch (GPU, many pairs) whatever the size."""
    monkeypatch.setattr(kernels, "NUMPY_MAX_PAIRS", 10**6 if request.param == "numpy" else -1)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("shape", [(5, 7), (40, 41)], ids=["small-torch-max", "large-amax-route"])
def test_max_over_cases_matches_a_scan_with_ties(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """The torch path's max node: the first maximum on ties, and the whole gradient to it."""
    rows, cols = shape
    x = torch.randint(0, 3, (16, rows, cols), generator=torch.Generator().manual_seed(5)).to(dtype)  # many ties
    x[:, 0, 0] = 2.0  # a full tie: the first case wins
    leaf = x.clone().requires_grad_(True)
    values, index = kernels._MaxOverFirstDim.apply(leaf)
    expected = torch.zeros(rows, cols, dtype=torch.long)
    for r, c in itertools.product(range(rows), range(cols)):
        expected[r, c] = int(torch.nonzero(x[:, r, c] == x[:, r, c].max())[0])  # the first maximum
    assert torch.equal(values, x.amax(0)) and torch.equal(index, expected)
    assert int(index[0, 0]) == 0
    upstream = torch.arange(rows * cols, dtype=dtype).view(rows, cols)
    (values * upstream).sum().backward()
    reference = torch.zeros_like(x)
    for r, c in itertools.product(range(rows), range(cols)):
        reference[expected[r, c], r, c] = upstream[r, c]  # the whole gradient to the first maximum
    assert torch.equal(leaf.grad, reference)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("left", [POINTS, ANGULAR], ids=["16-points", "12-angular"])
def test_hardest_combination_matches_max_over_the_inner_products(
    dtype: torch.dtype, left: Combinations, backend: str
) -> None:
    """Same values, indices and gradient as autograd through max over every inner product, where the maximum is
    clear; where two cases tie up to rounding, the chosen one is a maximum."""
    x = randn(24, 8, seed=6).to(dtype)
    labels = torch.arange(6).repeat_interleave(4)
    pairs = positive_pairs(labels)
    weights = randn(len(pairs), len(pairs), seed=7).to(dtype)
    g_ref = (x @ x.T).requires_grad_(True)
    planes = combination_inner_products(g_ref, pairs.first, pairs.second, left=left).flatten(0, 1)
    top2 = planes.detach().topk(2, dim=0).values
    clear = (top2[0] - top2[1]) > (1e-4 if dtype == torch.float32 else 1e-9)
    ref_values, ref_index = planes.max(dim=0)
    (ref_values * weights * clear).sum().backward()
    g_fast = (x @ x.T).requires_grad_(True)
    values, index = hardest_combination(g_fast, pairs.first, pairs.second, left=left)
    (values * weights * clear).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert values.dtype == dtype and index.dtype == torch.long
    assert clear.float().mean() > 0.9  # the comparison below covers most entries
    assert torch.equal(index[clear], ref_index[clear])
    assert torch.allclose(values, ref_values, atol=tol)
    chosen = planes.detach().gather(0, index.unsqueeze(0))[0]
    assert torch.allclose(chosen, ref_values.detach(), atol=tol)
    assert torch.allclose(g_fast.grad, g_ref.grad, atol=tol)


@pytest.mark.parametrize("left", [POINTS, ANGULAR], ids=["16-points", "12-angular"])
def test_hardest_combination_takes_the_first_of_exact_ties(left: Combinations, backend: str) -> None:
    """0/1 embeddings with 1, 2 or 4 ones: every a_i and inner product is dyadic, so ties are exact in both paths."""
    x = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [0, 0, 1, 0],
            [0, 0, 1, 0],
            [1, 1, 1, 1],
            [0, 1, 1, 0],
            [0, 0, 0, 1],
            [1, 0, 0, 1],
        ],
        dtype=F64,
    )
    pairs = positive_pairs(torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]))
    gram = x @ x.T
    values, index = hardest_combination(gram, pairs.first, pairs.second, left=left)
    planes = combination_inner_products(gram, pairs.first, pairs.second, left=left).flatten(0, 1)
    ties = 0
    for p, q in itertools.product(range(len(pairs)), repeat=2):
        column = planes[:, p, q].tolist()
        assert int(index[p, q]) == column.index(max(column)) and float(values[p, q]) == max(column)
        ties += column.count(max(column)) > 1
    assert ties >= 8  # the case really has ties to break


@pytest.mark.parametrize("left", [POINTS, ANGULAR], ids=["16-points", "12-angular"])
@pytest.mark.parametrize(
    "first, second",
    [([0, 2, 4, 6], [1, 3, 5, 7]), ([0, 2, 0, 5], [1, 3, 4, 5])],
    ids=["disjoint-pairs", "shared-sample-and-pair-of-one-sample"],
)
def test_hardest_combination_gradient_passes_gradcheck(left, first, second, backend: str) -> None:
    """Finite differences on a non-symmetric Gram (every entry its own input): the independent check of both
    hand-written backwards, also where pairs share a sample or a pair is one sample twice."""
    first, second = torch.tensor(first), torch.tensor(second)
    gram = randn(8, 8, seed=9) + 4.0 * torch.eye(8, dtype=F64)  # diagonal well away from 0, no near-ties
    weights = randn(4, 4, seed=10)
    assert torch.autograd.gradcheck(
        lambda g: hardest_combination(g, first, second, left=left)[0] * weights, (gram.requires_grad_(True),)
    )


def test_hardest_of_16_finite_for_a_zero_embedding(backend: str) -> None:
    x = randn(4, 3, seed=4)
    x[1] = 0.0
    gram = (x @ x.T).requires_grad_(True)
    pairs = positive_pairs(torch.tensor([0, 0, 1, 1]))
    values, _ = hardest_of_16(gram, pairs.first, pairs.second)
    values.sum().backward()
    assert torch.isfinite(values).all() and torch.isfinite(gram.grad).all()


def test_double_backward_is_refused_not_wrong(backend: str) -> None:
    pairs = positive_pairs(torch.tensor([0, 0, 1, 1]))
    gram = (randn(4, 3, seed=8) @ randn(4, 3, seed=8).T).requires_grad_(True)
    values, _ = hardest_of_16(gram, pairs.first, pairs.second)
    upstream = torch.ones_like(values, requires_grad=True)  # so that the gradient itself has a graph
    (grad,) = torch.autograd.grad(values, gram, upstream, create_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        grad.sum().backward()


def test_default_route_and_edge_inputs_of_the_kernel() -> None:
    """B = 32 takes the NumPy kernel; a transposed Gram and int32 indices give the same result; no pairs give
    empty outputs; an in-place change of the Gram before backward is an error, not a wrong gradient."""
    x = randn(32, 6, seed=11)
    pairs = positive_pairs(torch.arange(8).repeat_interleave(4))
    symmetric = x @ x.T
    symmetric = (symmetric + symmetric.T) / 2  # exactly symmetric, so its transpose has the same entries
    gram = symmetric.clone().requires_grad_(True)
    values, index = hardest_of_16(gram, pairs.first, pairs.second)
    assert "Kernel" in type(values.grad_fn).__name__
    values.sum().backward()
    transposed = symmetric.clone().T.requires_grad_(True)  # a non-contiguous view
    assert not transposed.is_contiguous()
    values_t, index_t = hardest_of_16(transposed, pairs.first.int(), pairs.second.int())
    values_t.sum().backward()
    assert torch.allclose(values_t, values, atol=1e-12) and torch.equal(index_t, index)
    assert torch.allclose(transposed.grad, gram.grad, atol=1e-12)
    none = torch.zeros(0, dtype=torch.long)
    assert hardest_of_16(gram, none, none)[0].shape == (0, 0)
    fresh = (x @ x.T).requires_grad_(True)
    leaf = fresh.clone()
    values, _ = hardest_of_16(leaf, pairs.first, pairs.second)
    leaf.mul_(3.0)
    with pytest.raises(RuntimeError, match="inplace"):
        values.sum().backward()


def test_combinations_sum_points_and_count_synthetics() -> None:
    assert ANGULAR.points == 2 and list(ANGULAR.synthetic) == [0, 1, 1]
    with pytest.raises(ValueError, match="same number of points"):
        Combinations(((0,), (1, 2)))
    with pytest.raises(ValueError, match="0-3"):
        Combinations(((-1,), (0,)))
    selected = torch.randint(0, 12, (7, 7), generator=torch.Generator().manual_seed(1))
    used = torch.rand(7, 7, generator=torch.Generator().manual_seed(2)) > 0.3
    synthetic = 0
    for case in selected[used].tolist():  # (x_p + x_q).x_r: points 2 and 3 are the reflections
        synthetic += sum(point >= 2 for point in ANGULAR.parts[case // 4]) + (case % 4 >= 2)
    expected = synthetic / (3 * int(used.sum()))
    assert float(synthetic_share(selected, used, left=ANGULAR)) == pytest.approx(expected)
    assert float(synthetic_share_on_device(selected, used, left=ANGULAR)) == pytest.approx(expected)
