"""Every pair-based loss against a slow reference: the paper's formula with explicit Python loops, float64.

The references compute from the raw embeddings (normalising, taking norms of differences) so that they
also check the vectorised code's shortcuts (d^2 = 2 - 2 S, masks, logsumexp tricks). Values and gradients
with respect to the embeddings must agree to ~1e-8.
"""

from __future__ import annotations

import math

import pytest
import torch

from retrieval.distances import cosine_similarity_matrix, label_masks
from retrieval.losses import build
from retrieval.losses.miners import vthm

ATOL = 1e-8


# --- batches -----------------------------------------------------------------------------------------------
def make_batch(seed: int, classes: int = 4, per_class: int = 3, dim: int = 8, spread: float = 1.5, scale=1.0):
    """Clustered random embeddings (so some triplets are easy and some hard), labels shuffled so that
    positions say nothing about classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    labels = labels[torch.randperm(len(labels), generator=g)]
    centers = torch.randn(classes, dim, generator=g, dtype=torch.float64)
    x = centers[labels] + spread * torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return (scale * x).requires_grad_(True), labels


def unit(x: torch.Tensor, i: int) -> torch.Tensor:
    return x[i] / x[i].norm()


def cos(x, i, j):
    return unit(x, i) @ unit(x, j)


def dist(x, i, j, squared=False):
    d2 = ((unit(x, i) - unit(x, j)) ** 2).sum()
    return d2 if squared else d2.sqrt()


def positives(labels, i):
    return [j for j in range(len(labels)) if j != i and labels[j] == labels[i]]


def negatives(labels, i):
    return [k for k in range(len(labels)) if labels[k] != labels[i]]


def positive_pairs(labels):
    return [(i, j) for i in range(len(labels)) for j in positives(labels, i)]


def semihard_triplets(distance, positive, negative, margin):
    """[a, p, n] bool: triplets (y_a == y_p, a != p, y_a != y_n) with d_ap < d_an < d_ap + margin (FaceNet)."""
    d_ap, d_an = distance.unsqueeze(2), distance.unsqueeze(1)
    return positive.unsqueeze(2) & negative.unsqueeze(1) & (d_an > d_ap) & (d_an < d_ap + margin)


def f(v) -> float:
    return float(v.detach())


def relu(v):
    return torch.clamp(v, min=0.0)


def softplus(v):
    return torch.log1p(torch.exp(v))


# --- references (paper formulas, loops) ---------------------------------------------------------------------
def ref_triplet(x, labels, margin=0.2, mining="all", squared=False):
    if mining == "hard":  # batch-hard: per anchor, farthest positive and nearest negative
        terms = []
        for a in range(len(labels)):
            if positives(labels, a) and negatives(labels, a):
                hp = max(dist(x, a, p, squared) for p in positives(labels, a))
                hn = min(dist(x, a, n, squared) for n in negatives(labels, a))
                terms.append(relu(hp - hn + margin))
        return sum(terms) / len(terms)
    total = x.new_zeros(())
    for a, p in positive_pairs(labels):  # loop eq. 14: sum over triplets / |P|
        for n in negatives(labels, a):
            d_ap, d_an = dist(x, a, p, squared), dist(x, a, n, squared)
            if mining == "semihard" and not (d_ap < d_an < d_ap + margin):
                continue
            total = total + relu(d_ap - d_an + margin)
    return total / len(positive_pairs(labels))


def ref_hphn(x, labels, margin=0.2):
    terms = []
    for i, j in positive_pairs(labels):
        hp = max(
            max(dist(x, i, k) for k in positives(labels, i)), max(dist(x, j, k) for k in positives(labels, j))
        )
        hn = min(
            min(dist(x, i, k) for k in negatives(labels, i)), min(dist(x, j, k) for k in negatives(labels, j))
        )
        terms.append(relu(hp + margin - hn))
    return sum(terms) / len(terms)


def ref_contrastive_cosine(x, labels, threshold=0.5):
    total = x.new_zeros(())
    for i in range(len(labels)):
        for j in range(len(labels)):
            if i == j:
                continue
            s = cos(x, i, j)
            total = total + (-s if labels[i] == labels[j] else relu(s - threshold))  # unified eq. 5
    return total / len(labels)


def ref_contrastive_distance(x, labels, form="distance", pos_margin=0.0, neg_margin=1.0):
    total = x.new_zeros(())
    for i in range(len(labels)):
        for j in range(len(labels)):
            if i == j:
                continue
            d = dist(x, i, j)
            total = total + (relu(d - pos_margin) if labels[i] == labels[j] else relu(neg_margin - d))
    return total / len(labels)


def ref_lifted(x, labels, margin=1.0):
    total = x.new_zeros(())
    pairs = positive_pairs(labels)
    for i, j in pairs:  # symm eq. 5
        inner = sum(torch.exp(margin - dist(x, i, k)) for k in negatives(labels, i))
        inner = inner + sum(torch.exp(margin - dist(x, j, k)) for k in negatives(labels, j))
        total = total + relu(torch.log(inner) + dist(x, i, j)) ** 2
    return total / (2 * len(pairs))


def ref_lifted_min(x, labels, margin=1.0):
    terms = []
    for i, j in positive_pairs(labels):  # loop eq. 16
        hn = min(
            min(dist(x, i, k) for k in negatives(labels, i)), min(dist(x, j, l) for l in negatives(labels, j))
        )
        terms.append(relu(dist(x, i, j) + margin - hn))
    return sum(terms) / len(terms)


def ref_generalized_lifted(x, labels, margin=1.0):
    total = x.new_zeros(())
    for i in range(len(labels)):
        pos = torch.log(sum(torch.exp(-cos(x, i, k)) for k in positives(labels, i)))
        neg = torch.log(sum(torch.exp(margin + cos(x, i, k)) for k in negatives(labels, i)))
        total = total + relu(pos + neg)
    return total / len(labels)


def dot(x, i, j):
    return x[i] @ x[j]


# Sohn 2016's embedding-norm regulariser, lambda = 0.002 (the N-pair reference implementation's reg_lambda):
# on by default for the raw-feature losses (symm section 3.1 relies on it).
NORM_REG = 0.002


def norm_penalty(x, labels, l2_reg):
    return l2_reg * sum((x[i] ** 2).sum() for i in range(len(labels))) / len(labels)


def ref_npair(x, labels, l2_reg=NORM_REG):
    pairs = positive_pairs(labels)
    total = x.new_zeros(())
    for i, j in pairs:  # symm eq. 7 on raw features
        total = total + torch.log(
            1 + sum(torch.exp(dot(x, i, k) - dot(x, i, j)) for k in negatives(labels, i))
        )
    return total / len(pairs) + norm_penalty(x, labels, l2_reg)


def ref_angular(x, labels, alpha=30.0, l2_reg=NORM_REG):
    t2 = math.tan(math.radians(alpha)) ** 2
    pairs = positive_pairs(labels)
    total = x.new_zeros(())
    for i, j in pairs:  # symm eq. 9
        f_p = 2 * (1 + t2) * dot(x, i, j)
        inner = sum(torch.exp(4 * t2 * (x[i] + x[j]) @ x[k] - f_p) for k in negatives(labels, i))
        total = total + torch.log(1 + inner)
    return total / len(pairs) + norm_penalty(x, labels, l2_reg)


def ref_angular_npair(x, labels, alpha=45.0, lambda_ang=2.0, l2_reg=NORM_REG):
    # dcdl eq. 4, the norm penalty once
    npair_and_angular = ref_npair(x, labels, 0.0) + lambda_ang * ref_angular(x, labels, alpha, 0.0)
    return npair_and_angular + norm_penalty(x, labels, l2_reg)


def ref_vthm(x, labels, margin=0.1):
    """Unified section 5.1 with loops: sets P~_i, N~_i."""
    kept_p, kept_n = {}, {}
    for i in range(len(labels)):
        pos, neg = positives(labels, i), negatives(labels, i)
        if not pos or not neg:
            kept_p[i], kept_n[i] = [], []
            continue
        s_hard_p = min(f(cos(x, i, k)) for k in pos)
        s_hard_n = max(f(cos(x, i, k)) for k in neg)
        kept_n[i] = [j for j in neg if f(cos(x, i, j)) > s_hard_p - margin]
        kept_p[i] = [j for j in pos if f(cos(x, i, j)) < s_hard_n + margin]
    return kept_p, kept_n


def pair_sets(x, labels, miner):
    if miner == "vthm":
        return ref_vthm(x, labels)
    n = len(labels)
    return {i: positives(labels, i) for i in range(n)}, {i: negatives(labels, i) for i in range(n)}


def ref_binomial(x, labels, alpha=2.0, beta=50.0, gamma=0.5, miner=None):
    kept_p, kept_n = pair_sets(x, labels, miner)
    total = x.new_zeros(())
    for i in range(len(labels)):  # unified eq. 12, averaged over anchors
        if kept_p[i]:
            total = total + sum(softplus(alpha * (gamma - cos(x, i, k))) for k in kept_p[i]) / len(kept_p[i])
        if kept_n[i]:
            total = total + sum(softplus(beta * (cos(x, i, k) - gamma)) for k in kept_n[i]) / len(kept_n[i])
    return total / len(labels)


def ref_raw(x, labels, alpha=2.0, beta=50.0, gamma=0.5, miner=None):
    kept_p, kept_n = pair_sets(x, labels, miner)
    total = x.new_zeros(())
    for i in range(len(labels)):  # unified eq. 17
        pos = sum((torch.exp(-alpha * (cos(x, i, k) - gamma)) for k in kept_p[i]), x.new_zeros(()))
        neg = sum((torch.exp(beta * (cos(x, i, k) - gamma)) for k in kept_n[i]), x.new_zeros(()))
        total = total + torch.log(1 + pos) / alpha + torch.log(1 + neg) / beta
    return total / len(labels)


def ref_vthm_equal_weights(x, labels, margin=0.1):
    kept_p, kept_n = ref_vthm(x, labels, margin)
    total = x.new_zeros(())
    for i in range(len(labels)):  # unified Table 1 "VTHM": weight 1 on every mined pair, averaged over anchors
        total = total + sum((cos(x, i, k) for k in kept_n[i]), x.new_zeros(()))
        total = total - sum((cos(x, i, k) for k in kept_p[i]), x.new_zeros(()))
    return total / len(labels)


def ref_nca_triplets(x, labels, mining):
    """[(s_ap, s_an)] for each ordered positive pair with its mined negative (sct HN / SHN)."""
    triplets = []
    for a, p in positive_pairs(labels):
        s_ap = cos(x, a, p)
        candidates = [n for n in negatives(labels, a) if mining == "hard" or f(cos(x, a, n)) < f(s_ap)]
        if candidates:
            n = max(candidates, key=lambda k: f(cos(x, a, k)))
            triplets.append((s_ap, cos(x, a, n)))
    return triplets


def ref_nca_triplet(x, labels, mining="hard", temperature=1.0):
    triplets = ref_nca_triplets(x, labels, mining)
    # sct eq. 1: -log(exp(S_ap) / (exp(S_ap) + exp(S_an)))
    terms = [
        -torch.log(
            torch.exp(s_ap / temperature) / (torch.exp(s_ap / temperature) + torch.exp(s_an / temperature))
        )
        for s_ap, s_an in triplets
    ]
    return sum(terms) / len(terms)


def ref_sct(x, labels, lam=1.0, hard_rule="paper", threshold=0.8, temperature=None):
    temperature = temperature or (1.0 if hard_rule == "paper" else 0.1)
    terms = []
    for s_ap, s_an in ref_nca_triplets(x, labels, "hard"):  # sct eq. 13
        hard = f(s_an) > f(s_ap) or (hard_rule == "paper_or_threshold" and f(s_an) > threshold)
        if hard:
            terms.append(lam * s_an)
        else:
            terms.append(
                -torch.log(
                    torch.exp(s_ap / temperature)
                    / (torch.exp(s_ap / temperature) + torch.exp(s_an / temperature))
                )
            )
    return sum(terms) / len(terms)


# --- the comparison -----------------------------------------------------------------------------------------
CASES = [
    ("triplet", {}, ref_triplet),
    ("triplet", {"margin": 0.3, "squared": True}, ref_triplet),
    ("triplet", {"mining": "semihard"}, ref_triplet),
    ("triplet", {"mining": "semihard", "squared": True, "margin": 0.5}, ref_triplet),
    ("triplet", {"mining": "hard"}, ref_triplet),
    ("triplet", {"mining": "hard", "squared": True}, ref_triplet),
    ("hphn_triplet", {}, ref_hphn),
    ("hphn_triplet", {"margin": 0.5}, ref_hphn),
    ("contrastive", {}, ref_contrastive_cosine),
    ("contrastive", {"threshold": 0.1}, ref_contrastive_cosine),
    ("contrastive", {"form": "distance"}, ref_contrastive_distance),
    ("contrastive", {"form": "distance", "pos_margin": 0.3, "neg_margin": 1.2}, ref_contrastive_distance),
    ("lifted", {}, ref_lifted),
    ("lifted", {"margin": 0.5}, ref_lifted),
    ("lifted_min", {}, ref_lifted_min),
    ("generalized_lifted", {}, ref_generalized_lifted),
    ("generalized_lifted", {"margin": 0.2}, ref_generalized_lifted),
    ("npair", {}, ref_npair),
    ("npair", {"l2_reg": 0.01}, ref_npair),
    ("npair", {"l2_reg": 0.0}, ref_npair),
    ("angular", {}, ref_angular),
    ("angular_npair", {"l2_reg": 0.0}, ref_angular_npair),
    ("angular", {"alpha": 40.0, "l2_reg": 0.01}, ref_angular),
    ("angular_npair", {}, ref_angular_npair),
    ("binomial", {}, ref_binomial),
    ("binomial", {"miner": "vthm"}, ref_binomial),
    ("binomial", {"alpha": 3.0, "beta": 10.0, "gamma": 0.2}, ref_binomial),
    ("raw", {}, ref_raw),
    ("raw", {"miner": "vthm"}, ref_raw),
    ("raw", {"alpha": 3.0, "beta": 10.0, "gamma": 0.2}, ref_raw),
    ("ms", {}, lambda x, y: ref_raw(x, y, miner="vthm")),
    ("vthm", {}, ref_vthm_equal_weights),
    ("vthm", {"margin": 0.3}, ref_vthm_equal_weights),
    ("nca_triplet", {}, ref_nca_triplet),
    ("nca_triplet", {"mining": "semihard"}, ref_nca_triplet),
    ("nca_triplet", {"temperature": 0.1}, ref_nca_triplet),
    ("sct", {}, ref_sct),
    ("sct", {"lam": 0.1}, ref_sct),
    ("sct", {"hard_rule": "paper_or_threshold", "threshold": 0.3}, ref_sct),
]
RAW_FEATURE_LOSSES = {"npair", "angular", "angular_npair"}


def _case_id(case):
    name, kwargs, _ = case
    return name + ("-" + "-".join(f"{k}={v}" for k, v in kwargs.items()) if kwargs else "")


# 4 classes x 3 (two seeds) and a wider 3 x 3 batch where SHN finds no negative for some pairs.
BATCHES = [{"seed": 0}, {"seed": 1}, {"seed": 2, "classes": 3, "per_class": 3, "spread": 2.0}]


@pytest.mark.parametrize("batch", BATCHES, ids=["4x3-s0", "4x3-s1", "3x3-wide"])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_loss_matches_paper_formula(case, batch):
    name, kwargs, reference = case
    # raw-feature losses see moderate norms (exp of dot products); the rest is normalised inside anyway
    x, labels = make_batch(**batch, scale=0.5 if name in RAW_FEATURE_LOSSES else 1.0)
    loss = build(name, **kwargs)
    value = loss(x, labels)
    (grad,) = torch.autograd.grad(value, x)
    expected = reference(x, labels.tolist(), **kwargs)
    (expected_grad,) = torch.autograd.grad(expected, x)
    assert value.dtype == torch.float64
    assert torch.allclose(value, expected, atol=ATOL, rtol=0), (float(value), float(expected))
    assert torch.allclose(grad, expected_grad, atol=ATOL, rtol=0)
    assert grad.abs().max() > 1e-6  # the batch is not degenerate: something is learnt


# --- the test batches exercise both sides of every branch (else the comparison above proves little) -------
def test_batches_have_semihard_and_other_triplets():
    for batch in BATCHES:
        x, labels = make_batch(**batch)
        loss = build("triplet", mining="all")
        pos, neg = label_masks(labels)
        d = loss.distance(loss.similarity(x.detach()))
        semi = semihard_triplets(d, pos, neg, 0.2)
        all_triplets = pos.unsqueeze(2) & neg.unsqueeze(1)
        assert 0 < int(semi.sum()) < int(all_triplets.sum())
        loss(x, labels)
        assert 0 < loss.last_stats["active_triplets"] < loss.last_stats["triplets"]


def test_batches_have_mined_and_dropped_vthm_pairs():
    dropped_positive = False
    for batch in BATCHES:
        x, labels = make_batch(**batch)
        pos, neg = label_masks(labels)
        kept_p, kept_n = vthm(cosine_similarity_matrix(x.detach()), pos, neg, 0.1)
        assert 0 < int(kept_n.sum()) < int(neg.sum())
        assert int(kept_p.sum()) > 0
        dropped_positive |= int(kept_p.sum()) < int(pos.sum())
        ref_p, ref_n = ref_vthm(x, labels.tolist())
        for i in range(len(labels)):  # the miner matches the loop definition pair by pair
            assert sorted(torch.nonzero(kept_p[i]).flatten().tolist()) == sorted(ref_p[i])
            assert sorted(torch.nonzero(kept_n[i]).flatten().tolist()) == sorted(ref_n[i])
    assert dropped_positive


def test_batches_have_hard_and_easy_sct_triplets():
    shn_dropped = False
    for batch in BATCHES:
        x, labels = make_batch(**batch)
        triplets = ref_nca_triplets(x, labels.tolist(), "hard")
        hard = sum(f(s_an) > f(s_ap) for s_ap, s_an in triplets)
        assert 0 < hard < len(triplets)
        loss = build("sct")
        loss(x, labels)
        assert loss.last_stats["hard_fraction"] == pytest.approx(hard / len(triplets))
        for mining in ("hard", "semihard"):  # the same measure whatever the mining (SCT Figure 6)
            nca = build("nca_triplet", mining=mining)
            nca(x, labels)
            assert nca.last_stats["hard_fraction"] == pytest.approx(hard / len(triplets))
        shn = ref_nca_triplets(x, labels.tolist(), "semihard")
        assert len(shn) > 0
        shn_dropped |= len(shn) < len(triplets)
    assert shn_dropped  # SHN drops the pairs whose positive is less similar than every negative


def test_sct_threshold_rule_changes_the_loss():
    x, labels = make_batch(0)
    paper = build("sct", temperature=0.1)(x, labels)
    threshold = build("sct", hard_rule="paper_or_threshold", threshold=0.3)(x, labels)
    assert not torch.allclose(paper, threshold)


# --- gradcheck where the loss is smooth ---------------------------------------------------------------------
SMOOTH = [
    ("binomial", {}),
    ("raw", {}),
    ("generalized_lifted", {}),
    ("lifted", {}),
    ("npair", {"l2_reg": 0.01}),
    ("angular", {}),
    ("angular_npair", {}),
    ("contrastive", {"threshold": -1.0}),  # every negative active: linear in S
]


@pytest.mark.parametrize(("name", "kwargs"), SMOOTH, ids=[n for n, _ in SMOOTH])
def test_gradcheck(name, kwargs):
    x, labels = make_batch(3, classes=3, per_class=2, dim=4, scale=0.5)
    loss = build(name, **kwargs)
    x = x.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: loss(e, labels), (x,), eps=1e-6, atol=1e-6)
