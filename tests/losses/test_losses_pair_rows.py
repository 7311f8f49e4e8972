"""The positive-pair losses (triplet all/semihard, N-pair, angular, NCA triplet, SCT) work on one row per
positive pair, never on a [B, B, B] anchor x positive x negative cube: their values on uneven batches, their
degenerate cases, the size of what they keep for backward, and the one-matmul Gram helper they use.
"""

from __future__ import annotations

import pytest
import torch
from loss_references import (
    ref_angular,
    ref_angular_npair,
    ref_nca_triplet,
    ref_npair,
    ref_sct,
    ref_triplet,
)

from retrieval.distances import gram_matrix
from retrieval.losses import build

ATOL = 1e-8

PAIR_ROW_CASES = [
    ("triplet", {"mining": "all"}, ref_triplet),
    ("triplet", {"mining": "semihard", "margin": 0.5}, ref_triplet),
    ("nca_triplet", {"mining": "hard"}, ref_nca_triplet),
    ("nca_triplet", {"mining": "semihard"}, ref_nca_triplet),
    ("sct", {}, ref_sct),
    ("npair", {}, ref_npair),
    ("angular", {}, ref_angular),
    ("angular_npair", {}, ref_angular_npair),
]
RAW_FEATURE_LOSSES = {"npair", "angular", "angular_npair"}


def uneven_batch(class_sizes: list[int], seed: int = 0, dim: int = 8, scale: float = 1.0):
    """Classes of different sizes (so |P_i| differs between anchors), labels shuffled."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.repeat_interleave(torch.arange(len(class_sizes)), torch.tensor(class_sizes))
    labels = labels[torch.randperm(len(labels), generator=g)]
    centers = torch.randn(len(class_sizes), dim, generator=g, dtype=torch.float64)
    x = centers[labels] + 1.5 * torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return (scale * x).requires_grad_(True), labels


def _id(case) -> str:
    name, kwargs, _ = case
    return name + "".join(f"-{k}={v}" for k, v in kwargs.items())


@pytest.mark.parametrize("case", PAIR_ROW_CASES, ids=[_id(c) for c in PAIR_ROW_CASES])
def test_uneven_classes_match_paper_formula(case):
    name, kwargs, reference = case
    # N-pair tuples need a positive for every anchor: no singleton class for those
    sizes = [5, 2, 3, 2] if name in RAW_FEATURE_LOSSES else [5, 2, 1, 3, 2]
    x, labels = uneven_batch(sizes, scale=0.5 if name in RAW_FEATURE_LOSSES else 1.0)
    value = build(name, **kwargs)(x, labels)
    (grad,) = torch.autograd.grad(value, x)
    expected = reference(x, labels.tolist(), **kwargs)
    (expected_grad,) = torch.autograd.grad(expected, x)
    assert torch.allclose(value, expected, atol=ATOL, rtol=0), (float(value), float(expected))
    assert torch.allclose(grad, expected_grad, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", PAIR_ROW_CASES, ids=[_id(c) for c in PAIR_ROW_CASES])
def test_saved_tensors_are_pair_rows_not_a_cube(case):
    """What autograd keeps for backward is at most |P| x B (one row per positive pair), not B^3."""
    name, kwargs, _ = case
    batch_size, per_class = 64, 4
    labels = torch.arange(batch_size // per_class).repeat_interleave(per_class)
    x = torch.randn(batch_size, 16, dtype=torch.float64, requires_grad=True)
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = build(name, **kwargs)(x, labels)
    value.backward()
    num_positive_pairs = batch_size * (per_class - 1)
    assert sizes and max(sizes) <= num_positive_pairs * (batch_size + 1)  # + 1: the log(1 + ...) column
    assert max(sizes) < batch_size**3 // 8
    assert torch.isfinite(x.grad).all() and x.grad.abs().max() > 0


@pytest.mark.parametrize("name", sorted(RAW_FEATURE_LOSSES))
def test_npair_family_one_class_batch_is_zero_not_nan(name):
    """No negatives anywhere: every log(1 + empty sum) is 0, so only the L2 penalty is left."""
    x, labels = uneven_batch([4], scale=3.0)
    loss = build(name, l2_reg=0.01)
    value = loss(x, labels)
    (grad,) = torch.autograd.grad(value, x)
    penalty = 0.01 * (x.detach() ** 2).sum(dim=1).mean()
    assert torch.allclose(value.detach(), penalty, atol=1e-12, rtol=0)
    assert torch.allclose(grad, 0.02 * x.detach() / len(labels), atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", sorted(RAW_FEATURE_LOSSES))
def test_npair_family_large_logits_stay_finite(name):
    """Raw features with norms ~ 50: dot products in the thousands, exp would overflow without the LSE."""
    x, labels = uneven_batch([2, 2, 2, 2], scale=20.0)
    value = build(name)(x, labels)
    (grad,) = torch.autograd.grad(value, x)
    assert torch.isfinite(value) and value > 0
    assert torch.isfinite(grad).all() and grad.abs().max() > 0


def test_gram_matrix_values_and_gradients():
    x = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    assert torch.equal(gram_matrix(x), x @ x.T)
    assert torch.autograd.gradcheck(gram_matrix, (x,))
    assert torch.autograd.gradgradcheck(gram_matrix, (x,))
    weights = torch.randn(7, 7, dtype=torch.float64)  # not symmetric: both halves of G must reach x
    (grad,) = torch.autograd.grad((gram_matrix(x) * weights).sum(), x)
    (expected,) = torch.autograd.grad(((x @ x.T) * weights).sum(), x)
    assert torch.allclose(grad, expected, atol=1e-12, rtol=0)
