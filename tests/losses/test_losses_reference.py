"""Every pair-based loss against a slow reference: the paper's formula with explicit Python loops, float64.

The references compute from the raw embeddings (normalising, taking norms of differences) so that they
also check the vectorised code's shortcuts (d^2 = 2 - 2 S, masks, logsumexp tricks). Values and gradients
with respect to the embeddings must agree to ~1e-8.
"""

from __future__ import annotations

import pytest
import torch
from loss_references import (
    f,
    make_batch,
    ref_angular,
    ref_angular_npair,
    ref_binomial,
    ref_contrastive_cosine,
    ref_contrastive_distance,
    ref_generalized_lifted,
    ref_hphn,
    ref_lifted,
    ref_lifted_min,
    ref_nca_triplet,
    ref_nca_triplets,
    ref_npair,
    ref_raw,
    ref_sct,
    ref_triplet,
    ref_vthm,
    ref_vthm_equal_weights,
    semihard_triplets,
)

from retrieval.distances import cosine_similarity_matrix, label_masks
from retrieval.losses import build
from retrieval.losses.miners import vthm

ATOL = 1e-8


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
