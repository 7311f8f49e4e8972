"""The weight view (unified paper, Theorem 3.1): pair_weights against the paper's closed-form weights."""

from __future__ import annotations

import pytest
import torch

from retrieval.distances import cosine_similarity_matrix, label_masks
from retrieval.losses import build, pair_weights


def batch(seed: int = 0, classes: int = 4, per_class: int = 3, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    centers = torch.randn(classes, dim, generator=g, dtype=torch.float64)
    x = centers[labels] + 1.5 * torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return x, labels


def check(weights: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.allclose(weights, expected, atol=1e-10, rtol=0)
    assert (weights >= -1e-12).all()  # eq. 2: w >= 0
    assert weights.abs().sum() > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_contrastive_weights_eq6(seed):
    x, labels = batch(seed)
    threshold = 0.1
    s, w = pair_weights(build("contrastive", threshold=threshold), x, labels)
    pos, neg = label_masks(labels)
    m = len(labels)
    expected = (pos | (neg & (s > threshold))).double() / m  # eq. 6: indicator of A, times the 1/m mean
    assert 0 < int((neg & (s > threshold)).sum()) < int(neg.sum())
    check(w, expected)
    assert torch.allclose(s, cosine_similarity_matrix(x))


@pytest.mark.parametrize("seed", [0, 1])
def test_triplet_weights_eq8(seed):
    # eq. 7 is [s_in - s_ip + lambda]_+; on squared distances of unit vectors d^2 = 2 - 2 s, so the triplet of
    # symm eq. 3 is 2 [s_in - s_ip + m/2]_+ and every pair's weight counts the violated triplets it is in.
    x, labels = batch(seed)
    margin = 0.4
    s, w = pair_weights(build("triplet", margin=margin, squared=True), x, labels)
    pos, neg = label_masks(labels)
    violated = pos.unsqueeze(2) & neg.unsqueeze(1) & (s.unsqueeze(1) - s.unsqueeze(2) + margin / 2 > 0)
    scale = 2.0 / int(pos.sum())  # eq. 14 divides by |P|
    expected = scale * (violated.sum(dim=2) + violated.sum(dim=1)).double()  # positives, negatives (I_B)
    assert 0 < int(violated.sum()) < int((pos.unsqueeze(2) & neg.unsqueeze(1)).sum())
    check(w, expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_binomial_weights_eq13_14(seed):
    x, labels = batch(seed)
    alpha, beta, gamma = 2.0, 50.0, 0.5
    s, w = pair_weights(build("binomial"), x, labels)
    pos, neg = label_masks(labels)
    m = len(labels)
    p_size = pos.sum(dim=1, keepdim=True).double()
    n_size = neg.sum(dim=1, keepdim=True).double()
    w_pos = alpha * torch.exp(alpha * (gamma - s)) / (1 + torch.exp(alpha * (gamma - s))) / p_size  # eq. 13
    w_neg = beta * torch.exp(beta * (s - gamma)) / (1 + torch.exp(beta * (s - gamma))) / n_size  # eq. 14
    expected = torch.where(pos, w_pos, torch.where(neg, w_neg, torch.zeros_like(s))) / m
    check(w, expected)


# margins chosen so that some anchors have an inactive hinge (all their weights must then be 0)
@pytest.mark.parametrize(("seed", "margin"), [(0, -2.3), (1, -2.9)])
def test_generalized_lifted_weights_eq10_11(seed, margin):
    x, labels = batch(seed)
    s, w = pair_weights(build("generalized_lifted", margin=margin), x, labels)
    pos, neg = label_masks(labels)
    m = len(labels)
    w_pos = torch.where(pos, torch.exp(-s), torch.zeros_like(s))
    w_pos = w_pos / w_pos.sum(dim=1, keepdim=True)  # eq. 10
    w_neg = torch.where(neg, torch.exp(s), torch.zeros_like(s))
    w_neg = w_neg / w_neg.sum(dim=1, keepdim=True)  # eq. 11
    hinge = torch.log(torch.where(pos, torch.exp(-s), torch.zeros_like(s)).sum(1)) + torch.log(
        torch.where(neg, torch.exp(margin + s), torch.zeros_like(s)).sum(1)
    )
    active = (hinge > 0).unsqueeze(1)
    assert 0 < int(active.sum()) < m
    expected = torch.where(active, w_pos + w_neg, torch.zeros_like(s)) / m
    check(w, expected)


def test_ms_weights_are_raw_eq15_16_on_vthm_pairs():
    x, labels = batch(0)
    alpha, beta, gamma, margin = 2.0, 50.0, 0.5, 0.1
    s, w = pair_weights(build("ms"), x, labels)
    pos, neg = label_masks(labels)
    hardest_pos = torch.where(pos, s, torch.full_like(s, 9.0)).amin(1, keepdim=True)
    hardest_neg = torch.where(neg, s, torch.full_like(s, -9.0)).amax(1, keepdim=True)
    kept_p = pos & (s < hardest_neg + margin)  # section 5.1
    kept_n = neg & (s > hardest_pos - margin)
    assert int(kept_n.sum()) < int(neg.sum())
    expected = torch.zeros_like(s)
    m = len(labels)
    for i in range(m):  # eq. 15-16, loops on purpose
        for j in range(m):
            if kept_p[i, j]:
                rel = sum(torch.exp(alpha * (s[i, j] - s[i, k])) for k in range(m) if kept_p[i, k])
                expected[i, j] = 1 / (rel + torch.exp(alpha * (s[i, j] - gamma))) / m
            elif kept_n[i, j]:
                rel = sum(torch.exp(-beta * (s[i, j] - s[i, k])) for k in range(m) if kept_n[i, k])
                expected[i, j] = 1 / (rel + torch.exp(-beta * (s[i, j] - gamma))) / m
    check(w, expected)


def test_weights_of_every_cosine_loss_are_finite_and_zero_on_the_diagonal():
    x, labels = batch(2)
    for name in [
        "contrastive",
        "triplet",
        "hphn_triplet",
        "lifted",
        "lifted_min",
        "generalized_lifted",
        "binomial",
        "raw",
        "ms",
        "nca_triplet",
        "sct",
    ]:
        s, w = pair_weights(build(name), x, labels)
        assert torch.isfinite(w).all(), name
        assert (torch.diagonal(w) == 0).all(), name
        assert w.abs().sum() > 0, name
        assert not w.requires_grad and not s.requires_grad


def test_pair_weights_refuses_raw_feature_losses():
    x, labels = batch(0)
    with pytest.raises(TypeError, match="dot products"):
        pair_weights(build("npair"), x, labels)
    with pytest.raises(TypeError, match="from_similarity"):
        pair_weights(torch.nn.MSELoss(), x, labels)
