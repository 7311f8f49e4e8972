"""LiT's loss (the symmetric InfoNCE, learned temperature) against a float64 loop over its formula, its gradients
by finite differences, and degenerate batches."""

from __future__ import annotations

import math

import pytest
import torch

from retrieval.text.lit_loss import MAX_SCALE, LiTLoss


def reference(text: torch.Tensor, image: torch.Tensor, scale: float) -> float:
    """1/2n sum_i [-log softmax_j(s t_i.v_j)[i] - log softmax_j(s t_j.v_i)[i]], one term at a time in float64."""
    n = len(text)
    t, v = text.double().tolist(), image.double().tolist()

    def dot(a: list[float], b: list[float]) -> float:
        return sum(x * y for x, y in zip(a, b, strict=True))

    total = 0.0
    for i in range(n):
        rows = [scale * dot(t[i], v[j]) for j in range(n)]  # text i against every image
        cols = [scale * dot(t[j], v[i]) for j in range(n)]  # image i against every text
        for logits in (rows, cols):
            top = max(logits)
            total += -(logits[i] - top - math.log(sum(math.exp(x - top) for x in logits)))
    return total / (2 * n)


def unit(rows: int, dim: int, seed: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)), dim=1)


@pytest.mark.parametrize(("rows", "dim", "scale"), [(2, 3, 1.0), (5, 8, 10.0), (16, 4, 37.5)])
def test_the_loss_equals_a_loop_over_its_formula(rows, dim, scale):
    text, image = unit(rows, dim, 1), unit(rows, dim, 2)
    loss = LiTLoss(initial_scale=scale)
    assert loss(text, image).item() == pytest.approx(reference(text, image, scale), rel=1e-5, abs=1e-6)


def test_the_temperature_is_clipped_where_clip_clips_it():
    loss = LiTLoss(initial_scale=1e4)
    text, image = unit(4, 6, 3), unit(4, 6, 4)
    assert float(loss.scale) == MAX_SCALE
    assert loss(text, image).item() == pytest.approx(reference(text, image, MAX_SCALE), rel=1e-5)


def test_gradients_match_finite_differences_for_both_towers_and_the_temperature():
    text = unit(5, 4, 5).double().requires_grad_(True)
    image = unit(5, 4, 6).double().requires_grad_(True)
    loss = LiTLoss(initial_scale=3.0).double()
    assert torch.autograd.gradcheck(lambda t, v: loss(t, v), (text, image))
    scale = loss.log_scale

    def of_scale(log_scale: torch.Tensor) -> torch.Tensor:
        logits = log_scale.exp() * text @ image.T
        labels = torch.arange(5)
        return 0.5 * (torch.nn.functional.cross_entropy(logits, labels)
                      + torch.nn.functional.cross_entropy(logits.T, labels))

    value = loss(text, image)
    (grad,) = torch.autograd.grad(value, scale)
    expected = torch.autograd.grad(of_scale(scale.detach().clone().requires_grad_(True)), [scale], allow_unused=True)
    assert expected[0] is None or torch.allclose(grad, expected[0])
    step = 1e-6
    numeric = (of_scale(scale.detach() + step) - of_scale(scale.detach() - step)) / (2 * step)
    assert grad.item() == pytest.approx(numeric.item(), rel=1e-4)


@pytest.mark.parametrize("case", ["one pair", "identical images", "zero text"])
def test_degenerate_batches_give_a_finite_loss(case):
    loss = LiTLoss()
    if case == "one pair":
        text, image = unit(1, 4, 7), unit(1, 4, 8)
    elif case == "identical images":
        text, image = unit(6, 4, 9), unit(1, 4, 10).repeat(6, 1)
    else:
        text, image = torch.zeros(6, 4, requires_grad=True), unit(6, 4, 11)
    value = loss(text, image)
    assert torch.isfinite(value)
    value.backward()


def test_mismatched_shapes_are_refused():
    with pytest.raises(ValueError, match="must be"):
        LiTLoss()(unit(3, 4, 1), unit(4, 4, 2))
