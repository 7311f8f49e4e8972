"""LoOp geometry: the exact KKT solution against brute-force grid oracles, degenerate cases, gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reads_back import ReadsBack

from retrieval.negatives.kernels import pair_starts_numpy
from retrieval.negatives.loop import (
    ARC_CASES,
    optimal_arc_distance,
    optimal_segment_distance,
    pair_of_pairs_distances,
)
from retrieval.negatives.pairs import (
    expected_combinations,
    nonzero_2d,
    pair_combinations,
    pair_grid,
    pair_starts_torch,
    positive_pairs,
)

F64 = torch.float64


def unit(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g, dtype=F64)
    return x / x.norm(dim=-1, keepdim=True)


# --- oracles ------------------------------------------------------------------------------------------


def slerp(x1: torch.Tensor, x2: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Points at fractions t [M, K, n] along the shortest arcs x1 -> x2 [M, D] (slerp, independent of eq. 2-3)."""
    a0 = (2 * torch.arcsin(((x1 - x2).norm(dim=-1) / 2).clamp(max=1)))[:, None, None, None]
    t = t.unsqueeze(-1)
    w1 = torch.where(a0 > 1e-12, torch.sin((1 - t) * a0) / torch.sin(a0).clamp_min(1e-300), 1 - t)
    w2 = torch.where(a0 > 1e-12, torch.sin(t * a0) / torch.sin(a0).clamp_min(1e-300), t)
    return w1 * x1[:, None, None] + w2 * x2[:, None, None]


def lerp(x1: torch.Tensor, x2: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    t = t.unsqueeze(-1)
    return (1 - t) * x1[:, None, None] + t * x2[:, None, None]


def grid_oracle(x1, x2, y1, y2, curve=slerp, n: int = 61, rounds: int = 5, keep: int = 4) -> torch.Tensor:
    """Brute force for M problems at once: a dense n x n grid over both curve parameters, then a new grid
    over the neighbourhood of each of the `keep` best cells, `rounds` times. Returns [M]."""
    m = x1.shape[0]
    lo1, hi1 = torch.zeros(m, 1, dtype=F64), torch.ones(m, 1, dtype=F64)
    lo2, hi2 = lo1.clone(), hi1.clone()
    s = torch.linspace(0, 1, n, dtype=F64)
    best = torch.full((m,), math.inf, dtype=F64)
    for _ in range(rounds):
        t1 = lo1[..., None] + (hi1 - lo1)[..., None] * s  # [M, K, n]
        t2 = lo2[..., None] + (hi2 - lo2)[..., None] * s
        k = t1.shape[1]
        d = torch.cdist(curve(x1, x2, t1).flatten(0, 1), curve(y1, y2, t2).flatten(0, 1)).view(m, k * n * n)
        vals, flat = d.topk(keep, dim=1, largest=False)
        best = torch.minimum(best, vals[:, 0])
        cell, a, b = flat // (n * n), (flat % (n * n)) // n, flat % n
        c1 = t1[torch.arange(m)[:, None], cell, a]
        c2 = t2[torch.arange(m)[:, None], cell, b]
        st1 = ((hi1 - lo1) / (n - 1)).gather(1, cell)
        st2 = ((hi2 - lo2) / (n - 1)).gather(1, cell)
        lo1, hi1 = (c1 - st1).clamp(0, 1), (c1 + st1).clamp(0, 1)
        lo2, hi2 = (c2 - st2).clamp(0, 1), (c2 + st2).clamp(0, 1)
    return best


def endpoint_min(x1, x2, y1, y2) -> torch.Tensor:
    pts_x, pts_y = torch.stack([x1, x2], 1), torch.stack([y1, y2], 1)
    return torch.cdist(pts_x, pts_y).flatten(1).amin(1)


def on_arc(p, x1, x2, tol=1e-9) -> bool:
    ang = lambda a, b: 2 * torch.arcsin(((a - b).norm(dim=-1) / 2).clamp(max=1))  # noqa: E731 - accurate
    return bool(
        ((ang(x1, p) + ang(p, x2) - ang(x1, x2)).abs() < tol).all() and ((p.norm(dim=-1) - 1).abs() < tol).all()
    )


# --- arc: random cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("dim,count", [(2, 60), (3, 200), (8, 120), (64, 80)])
def test_arc_distance_matches_grid_oracle(dim: int, count: int) -> None:
    x = unit(4, count, dim, seed=dim)
    # Mix in short arcs and near-by pairs so that every KKT case occurs.
    x[1, : count // 3] = unit(count // 3, dim, seed=dim + 100) * 0.3 + x[0, : count // 3]
    x[1] = x[1] / x[1].norm(dim=-1, keepdim=True)
    d, p1, p2 = optimal_arc_distance(x[0], x[1], x[2], x[3], return_points=True)
    assert torch.isfinite(d).all()
    assert on_arc(p1, x[0], x[1]) and on_arc(p2, x[2], x[3])
    assert torch.allclose(d, (p1 - p2).norm(dim=-1), atol=1e-12)
    assert (d <= endpoint_min(x[0], x[1], x[2], x[3]) + 1e-12).all()
    oracle = grid_oracle(x[0], x[1], x[2], x[3])
    assert (d <= oracle + 1e-9).all()  # ours are points on the arcs, so never below the true minimum
    assert torch.allclose(d, oracle, atol=1e-4), (d - oracle).abs().max()


def test_every_kkt_case_occurs_and_is_exact() -> None:
    """Across random problems the interior, one-boundary and corner cases are all exercised."""
    from retrieval.negatives.loop import solve_arcs

    x = unit(4, 3000, 3, seed=7)
    x[1] = x[0] + 0.8 * (x[1] - x[0])
    x[1] = x[1] / x[1].norm(dim=-1, keepdim=True)
    cx, cy = (x[0] * x[1]).sum(-1), (x[2] * x[3]).sum(-1)
    sx, sy = (x[1] - cx[:, None] * x[0]).norm(dim=-1), (x[3] - cy[:, None] * x[2]).norm(dim=-1)
    h = torch.einsum("amd,bmd->mab", x[:2], x[2:])
    case = solve_arcs(cx, sx, cy, sy, h).case
    names = {ARC_CASES[c].split("(")[1] for c in case.unique().tolist()}
    assert names == {f"{k})" for k in range(9)}, names


# --- arc: degenerate geometry ------------------------------------------------------------------------


def _check(x1, x2, y1, y2, expected: float | None = None, atol: float = 1e-6) -> torch.Tensor:
    rows = [t.reshape(1, -1).clone().requires_grad_(True) for t in (x1, x2, y1, y2)]
    d, p1, p2 = optimal_arc_distance(*rows, return_points=True)
    d.sum().backward()
    assert torch.isfinite(d).all() and torch.isfinite(p1).all() and torch.isfinite(p2).all()
    assert all(torch.isfinite(r.grad).all() for r in rows)
    assert d.item() <= endpoint_min(*[r.detach() for r in rows]).item() + 1e-6
    if expected is not None:
        assert d.item() == pytest.approx(expected, abs=atol)
    return d.detach()


def test_degenerate_identical_endpoints() -> None:
    x, y = unit(2, 5, seed=3)
    _check(x, x, y, y, expected=(x - y).norm().item())
    y2 = unit(5, seed=4)
    _check(x, x, y, y2, expected=float(grid_oracle(*(t[None] for t in (x, x, y, y2)))), atol=1e-4)  # point to arc


def test_degenerate_antipodal_pair_uses_endpoints() -> None:
    x, y1, y2 = unit(3, 6, seed=5)
    # No unique shortest arc between antipodal points: the "arc" is its two endpoints.
    d = _check(x, -x, y1, y2)
    expected = float(torch.minimum(*(grid_oracle(*(t[None] for t in (p, p, y1, y2))) for p in (x, -x))))
    assert d.item() == pytest.approx(expected, abs=1e-4)


def test_degenerate_same_great_circle() -> None:
    e = lambda a: torch.tensor([math.cos(a), math.sin(a), 0.0], dtype=F64)  # noqa: E731
    _check(e(0.0), e(1.0), e(0.5), e(2.0), expected=0.0)  # overlapping arcs
    _check(e(0.0), e(1.0), e(1.5), e(2.5), expected=2 * math.sin(0.25))  # disjoint arcs: gap of 0.5 rad
    _check(e(0.0), e(1.0), e(2.5), e(1.5), expected=2 * math.sin(0.25))  # reversed direction
    _check(e(0.0), e(1.0), e(0.0), e(1.0), expected=0.0)  # the same arc
    _check(e(0.0), e(1.0), e(1.0), e(0.0), expected=0.0)


def test_degenerate_intersecting_arcs() -> None:
    e1, e2, e3 = torch.eye(3, dtype=F64)
    s = 1 / math.sqrt(2)
    # x-arc from e1 to e2 crosses the y-arc from (e3 + e1 + e2)/.. to (-e3 + e1 + e2)/.. in its middle.
    mid = (e1 + e2) * s
    y1 = (mid + 0.5 * e3) / (mid + 0.5 * e3).norm()
    y2 = (mid - 0.7 * e3) / (mid - 0.7 * e3).norm()
    _check(e1, e2, y1, y2, expected=0.0, atol=1e-7)
    _check(e1, e2, e1, e3, expected=0.0)  # arcs sharing an endpoint


def test_degenerate_float32_close_points_no_nan() -> None:
    x = unit(4, 50, 16, seed=11).float()
    x[1] = x[0] + 1e-7 * torch.randn(50, 16)
    x[3] = -x[2]
    x = x / x.norm(dim=-1, keepdim=True)
    rows = [t.clone().requires_grad_(True) for t in x]
    d = optimal_arc_distance(*rows)
    d.sum().backward()
    assert torch.isfinite(d).all() and all(torch.isfinite(r.grad).all() for r in rows)
    assert (d <= endpoint_min(*x) + 1e-5).all()


def test_rejects_bad_input() -> None:
    x = unit(3, 4)
    with pytest.raises(ValueError, match="unit-norm"):
        optimal_arc_distance(x * 2, x, x, x)
    with pytest.raises(ValueError, match="same shape"):
        optimal_arc_distance(x, x[:2], x, x)
    with pytest.raises(ValueError, match="NaN"):
        optimal_arc_distance(x, x, x, torch.full_like(x, float("nan")))


# --- gradients (supplementary eq. 27-30) ------------------------------------------------------------


def test_arc_gradient_matches_finite_differences() -> None:
    """Angles held constant at the optimum (Danskin): autograd agrees with finite differences."""
    raw = [
        t.clone().requires_grad_(True)
        for t in torch.randn(4, 12, 5, dtype=F64, generator=torch.Generator().manual_seed(2))
    ]

    def f(a, b, c, d):
        n = lambda t: t / t.norm(dim=-1, keepdim=True)  # noqa: E731
        return optimal_arc_distance(n(a), n(b), n(c), n(d))

    assert torch.autograd.gradcheck(f, raw, eps=1e-6, atol=1e-6)


def test_gradient_reaches_all_four_embeddings_interior_case() -> None:
    from retrieval.negatives.loop import solve_arcs

    x = unit(4, 200, 5, seed=21)
    cx, cy = (x[0] * x[1]).sum(-1), (x[2] * x[3]).sum(-1)
    sx, sy = (x[1] - cx[:, None] * x[0]).norm(dim=-1), (x[3] - cy[:, None] * x[2]).norm(dim=-1)
    case = solve_arcs(cx, sx, cy, sy, torch.einsum("amd,bmd->mab", x[:2], x[2:])).case
    m = int(torch.nonzero(case <= 1)[0])  # an interior optimum (case 0): p1, p2 strictly inside both arcs
    rows = [x[r, m : m + 1].clone().requires_grad_(True) for r in range(4)]
    d = optimal_arc_distance(*rows)
    d.sum().backward()
    assert d.item() > 0.1
    assert all(r.grad.abs().sum() > 1e-3 for r in rows)


# --- segments (section 4.2) --------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [2, 3, 16])
def test_segment_distance_matches_grid_oracle(dim: int) -> None:
    g = torch.Generator().manual_seed(dim)
    x = torch.randn(4, 60, dim, dtype=F64, generator=g)
    x[1, :10] = x[0, :10]  # a point against a segment
    x[3, 10:20] = x[2, 10:20] + 2.0 * (x[1, 10:20] - x[0, 10:20])  # parallel segments
    d, p1, p2 = optimal_segment_distance(x[0], x[1], x[2], x[3], return_points=True)
    oracle = grid_oracle(*x, curve=lerp)
    assert (d <= oracle + 1e-9).all()
    assert torch.allclose(d, oracle, atol=1e-4), (d - oracle).abs().max()
    assert (d <= endpoint_min(*x) + 1e-12).all()


def test_segment_gradient_matches_finite_differences() -> None:
    raw = [
        t.clone().requires_grad_(True)
        for t in torch.randn(4, 10, 4, dtype=F64, generator=torch.Generator().manual_seed(9))
    ]
    assert torch.autograd.gradcheck(optimal_segment_distance, raw, eps=1e-6, atol=1e-6)


# --- pairs and the batched (Gram) path ---------------------------------------------------------------


@pytest.mark.parametrize("batch,per_class", [(8, 2), (32, 4), (128, 4), (48, 8)])
def test_pair_of_pairs_count(batch: int, per_class: int) -> None:
    labels = torch.arange(batch // per_class).repeat_interleave(per_class)
    labels = labels[torch.randperm(batch, generator=torch.Generator().manual_seed(0))]
    pairs = positive_pairs(labels)
    assert len(pairs) == batch // 2
    assert (labels[pairs.first] == labels[pairs.second]).all() and (pairs.first != pairs.second).all()
    used = torch.cat([pairs.first, pairs.second])
    assert used.unique().numel() == batch
    p, q = pair_combinations(pairs.labels)
    assert p.numel() == expected_combinations(batch, per_class) == batch * (batch - per_class) // 8
    assert (pairs.labels[p] != pairs.labels[q]).all()


def test_positive_pairs_follow_labels_and_skip_odd_leftovers() -> None:
    labels = torch.tensor([5, 1, 5, 1, 1, 5, 5, 9])
    pairs = positive_pairs(labels)
    assert sorted(zip(pairs.first.tolist(), pairs.second.tolist(), strict=True)) == [(0, 2), (1, 3), (5, 6)]


def test_positive_pairs_numpy_and_device_paths_agree_with_a_loop() -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(200):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        labels = torch.randint(0, 1 + trial % 9, (n,), generator=gen)
        expected = []
        for c in sorted(set(labels.tolist())):
            members = [i for i in range(n) if labels[i] == c]
            expected += [(members[m], members[m + 1]) for m in range(0, len(members) - 1, 2)]
        order_np, pos_np = pair_starts_numpy(labels.numpy())
        order_t, pos_t = pair_starts_torch(labels)  # the path a CUDA tensor takes
        assert torch.equal(torch.from_numpy(order_np), order_t) and torch.equal(torch.from_numpy(pos_np), pos_t)
        pairs = positive_pairs(labels)
        assert sorted(zip(pairs.first.tolist(), pairs.second.tolist(), strict=True)) == sorted(expected)
        assert torch.equal(pairs.labels, labels[pairs.first])
    assert len(positive_pairs(torch.zeros(0, dtype=torch.long))) == 0


def test_pair_combinations_match_a_loop_and_wait_once() -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(50):
        labels = torch.randint(0, 1 + trial % 7, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen)
        n = len(labels)
        with ReadsBack() as combining:
            p, q = pair_combinations(labels)
        assert list(zip(p.tolist(), q.tolist(), strict=True)) == [
            (a, b) for a in range(n) for b in range(a + 1, n) if labels[a] != labels[b]]
        # one nonzero: on a GPU every boolean-mask index would wait for the device again
        assert combining.count == 1


def test_nonzero_2d_gives_numpys_rows_and_columns_in_order() -> None:
    rng = np.random.default_rng(3)
    for shape in [(0, 0), (0, 5), (5, 0), (1, 1), (7, 3), (3, 7), (64, 200)]:
        for density in (0.0, 0.3, 1.0):
            mask = rng.random(shape) < density
            rows, columns = nonzero_2d(mask)
            expected_rows, expected_columns = np.nonzero(mask)
            assert rows.dtype == columns.dtype == np.int64
            assert np.array_equal(rows, expected_rows) and np.array_equal(columns, expected_columns)


@pytest.mark.parametrize("negative_pairs", ["consecutive", "all"])
def test_the_host_pair_grid_holds_algorithm_1s_pairs_and_their_combinations_in_order(negative_pairs) -> None:
    gen = torch.Generator().manual_seed(11)
    for trial in range(60):
        n = 0 if trial == 0 else int(torch.randint(1, 30, (1,), generator=gen))
        labels = torch.randint(-2, 1 + trial % 6, (n,), generator=gen)
        grid = pair_grid(labels.numpy(), negative_pairs)
        values = labels.tolist()
        expected = []  # Algorithm 1: each class's members paired in order of appearance, classes in label order
        for c in sorted(set(values)):
            members = [i for i in range(n) if values[i] == c]
            expected += [(members[m], members[m + 1]) for m in range(0, len(members) - 1, 2)]
        every = [(a, b) for a in range(n) for b in range(a + 1, n) if values[a] == values[b]]
        columns = expected if negative_pairs == "consecutive" else every
        assert list(zip(grid.pairs.first.tolist(), grid.pairs.second.tolist(), strict=True)) == expected
        assert grid.pairs.labels.tolist() == [values[i] for i, _ in expected]
        if negative_pairs == "all":
            assert list(zip(grid.columns.first.tolist(), grid.columns.second.tolist(), strict=True)) == every
        negative = [[values[i] != values[k] for k, _ in columns] for i, _ in expected]
        assert grid.negative.tolist() == negative or (not expected and grid.negative.numel() == 0)
        solved = [(p, q) for p in range(len(expected)) for q in range(len(columns)) if negative[p][q]
                  and (negative_pairs == "all" or p < q)]
        p, q = grid.combinations
        assert list(zip(p.tolist(), q.tolist(), strict=True)) == solved
        tensors = [grid.pairs.first, grid.pairs.second, *grid.combinations]
        assert all(t.dtype == torch.int64 for t in tensors) and grid.negative.dtype == torch.bool
        assert grid.to(torch.device("cpu")).combinations[0] is grid.combinations[0]  # already there: no copy


@pytest.mark.parametrize("geometry", ["arc", "segment"])
def test_gram_path_equals_explicit_points(geometry: str) -> None:
    x = unit(24, 7, seed=4)
    x[3] = x[2]  # a degenerate positive pair
    labels = torch.arange(6).repeat_interleave(4)
    pairs = positive_pairs(labels)
    p, q = pair_combinations(pairs.labels)
    i, j, k, l = pairs.first[p], pairs.second[p], pairs.first[q], pairs.second[q]  # noqa: E741
    d, _ = pair_of_pairs_distances(x @ x.T, i, j, k, l, geometry)
    explicit = optimal_arc_distance if geometry == "arc" else optimal_segment_distance
    assert torch.allclose(d, explicit(x[i], x[j], x[k], x[l]), atol=1e-7)
