"""Slow references for the pair-based losses: the papers' formulas with explicit Python loops, float64, computed
from the raw embeddings (normalising, taking norms of differences) so that a comparison with them also checks the
vectorised code's shortcuts; and the small labelled batches they are compared on."""

from __future__ import annotations

import math

import torch


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
