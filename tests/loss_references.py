"""Slow references for the pair-based losses: the papers' formulas with explicit Python loops, float64, computed
from the raw embeddings (normalising, taking norms of differences) so that a comparison with them also checks the
vectorised code's shortcuts; and the small labelled batches they are compared on.

A reference whose equation sums over anchors, each against its own row (``@anchor_based``), loops over the anchors
of a ``QueryGallery``: query rows against gallery rows (the rectangular form); called as the others with
``(x, labels)``, the gallery is the batch itself."""

from __future__ import annotations

import functools
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


class QueryGallery:
    """Query rows (the anchors) against gallery rows; ``self_index[i]`` is query i's own gallery row (-1: not
    there). Without a gallery: the batch against itself."""

    def __init__(self, queries, labels, gallery=None, gallery_labels=None, self_index=None):
        self.q, self.yq = queries, [int(v) for v in labels]
        if gallery is None:
            self.g, self.yg, self.self_index = queries, self.yq, list(range(len(self.yq)))
        else:
            self.g, self.yg = gallery, [int(v) for v in gallery_labels]
            self.self_index = [-1] * len(self.yq) if self_index is None else [int(v) for v in self_index]

    @property
    def anchors(self) -> range:
        return range(len(self.yq))

    def cos(self, i, j):
        return unit(self.q, i) @ unit(self.g, j)

    def dist(self, i, j, squared=False):
        d2 = ((unit(self.q, i) - unit(self.g, j)) ** 2).sum()
        return d2 if squared else d2.sqrt()

    def dot(self, i, j):
        return self.q[i] @ self.g[j]

    def positives(self, i):
        return [j for j in range(len(self.yg)) if j != self.self_index[i] and self.yg[j] == self.yq[i]]

    def negatives(self, i):
        return [k for k in range(len(self.yg)) if self.yg[k] != self.yq[i]]

    def positive_pairs(self):
        return [(i, j) for i in self.anchors for j in self.positives(i)]

    def mean_squared_norm(self):
        return sum((self.q[i] ** 2).sum() for i in self.anchors) / len(self.yq)


def anchor_based(reference):
    """``reference(pairs: QueryGallery, ...)`` callable as the square references are, ``reference(x, labels, ...)``."""

    @functools.wraps(reference)
    def call(*args, **kwargs):
        if isinstance(args[0], QueryGallery):
            return reference(*args, **kwargs)
        x, labels, *rest = args
        return reference(QueryGallery(x, labels), *rest, **kwargs)

    return call


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
@anchor_based
def ref_triplet(pairs, margin=0.2, mining="all", squared=False, reduction="positive_pairs"):
    total, count = pairs.q.new_zeros(()), 0
    if mining == "hard":  # batch-hard: per anchor, farthest positive and nearest negative
        for a in pairs.anchors:
            if pairs.positives(a) and pairs.negatives(a):
                hp = max(pairs.dist(a, p, squared) for p in pairs.positives(a))
                hn = min(pairs.dist(a, n, squared) for n in pairs.negatives(a))
                total, count = total + relu(hp - hn + margin), count + 1
        return total / max(count, 1)
    for a, p in pairs.positive_pairs():  # loop eq. 14: sum over triplets / |P|
        for n in pairs.negatives(a):
            d_ap, d_an = pairs.dist(a, p, squared), pairs.dist(a, n, squared)
            if mining == "semihard" and not (d_ap < d_an < d_ap + margin):
                continue
            total, count = total + relu(d_ap - d_an + margin), count + 1
    if reduction == "triplets":  # dcdl eq. 3: the mean over the kept triplets
        return total / max(count, 1)
    return total / max(len(pairs.positive_pairs()), 1)


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


@anchor_based
def ref_contrastive_cosine(pairs, threshold=0.5):
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:
        total = total - sum((pairs.cos(i, j) for j in pairs.positives(i)), pairs.q.new_zeros(()))  # unified eq. 5
        total = total + sum((relu(pairs.cos(i, j) - threshold) for j in pairs.negatives(i)), pairs.q.new_zeros(()))
    return total / len(pairs.anchors)


@anchor_based
def ref_contrastive_distance(pairs, form="distance", pos_margin=0.0, neg_margin=1.0):
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:
        total = total + sum((relu(pairs.dist(i, j) - pos_margin) for j in pairs.positives(i)), pairs.q.new_zeros(()))
        total = total + sum((relu(neg_margin - pairs.dist(i, j)) for j in pairs.negatives(i)), pairs.q.new_zeros(()))
    return total / len(pairs.anchors)


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


@anchor_based
def ref_generalized_lifted(pairs, margin=1.0):
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:  # unified eq. 9 (sign-corrected); an anchor without a positive or negative adds 0
        if not (pairs.positives(i) and pairs.negatives(i)):
            continue
        pos = torch.log(sum(torch.exp(-pairs.cos(i, k)) for k in pairs.positives(i)))
        neg = torch.log(sum(torch.exp(margin + pairs.cos(i, k)) for k in pairs.negatives(i)))
        total = total + relu(pos + neg)
    return total / len(pairs.anchors)


def dot(x, i, j):
    return x[i] @ x[j]


# Sohn 2016's embedding-norm regulariser, lambda = 0.002 (the N-pair reference implementation's reg_lambda):
# on by default for the raw-feature losses (symm section 3.1 relies on it).
NORM_REG = 0.002


def norm_penalty(x, labels, l2_reg):
    return l2_reg * sum((x[i] ** 2).sum() for i in range(len(labels))) / len(labels)


@anchor_based
def ref_npair(pairs, l2_reg=NORM_REG):
    total = pairs.q.new_zeros(())
    for i, j in pairs.positive_pairs():  # symm eq. 7 on raw features
        inner = sum((torch.exp(pairs.dot(i, k) - pairs.dot(i, j)) for k in pairs.negatives(i)), pairs.q.new_zeros(()))
        total = total + torch.log(1 + inner)
    return total / max(len(pairs.positive_pairs()), 1) + l2_reg * pairs.mean_squared_norm()


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


@anchor_based
def ref_vthm(pairs, margin=0.1):
    """Unified section 5.1 with loops: sets P~_i, N~_i."""
    kept_p, kept_n = {}, {}
    for i in pairs.anchors:
        pos, neg = pairs.positives(i), pairs.negatives(i)
        if not pos or not neg:
            kept_p[i], kept_n[i] = [], []
            continue
        s_hard_p = min(f(pairs.cos(i, k)) for k in pos)
        s_hard_n = max(f(pairs.cos(i, k)) for k in neg)
        kept_n[i] = [j for j in neg if f(pairs.cos(i, j)) > s_hard_p - margin]
        kept_p[i] = [j for j in pos if f(pairs.cos(i, j)) < s_hard_n + margin]
    return kept_p, kept_n


def pair_sets(pairs, miner, margin=0.1):
    if miner == "vthm":
        return ref_vthm(pairs, margin)
    return {i: pairs.positives(i) for i in pairs.anchors}, {i: pairs.negatives(i) for i in pairs.anchors}


@anchor_based
def ref_binomial(pairs, alpha=2.0, beta=50.0, gamma=0.5, miner=None):
    kept_p, kept_n = pair_sets(pairs, miner)
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:  # unified eq. 12, averaged over anchors
        if kept_p[i]:
            total = total + sum(softplus(alpha * (gamma - pairs.cos(i, k))) for k in kept_p[i]) / len(kept_p[i])
        if kept_n[i]:
            total = total + sum(softplus(beta * (pairs.cos(i, k) - gamma)) for k in kept_n[i]) / len(kept_n[i])
    return total / len(pairs.anchors)


@anchor_based
def ref_raw(pairs, alpha=2.0, beta=50.0, gamma=0.5, miner=None, margin=0.1):
    kept_p, kept_n = pair_sets(pairs, miner, margin)
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:  # unified eq. 17
        pos = sum((torch.exp(-alpha * (pairs.cos(i, k) - gamma)) for k in kept_p[i]), pairs.q.new_zeros(()))
        neg = sum((torch.exp(beta * (pairs.cos(i, k) - gamma)) for k in kept_n[i]), pairs.q.new_zeros(()))
        total = total + torch.log(1 + pos) / alpha + torch.log(1 + neg) / beta
    return total / len(pairs.anchors)


@anchor_based
def ref_vthm_equal_weights(pairs, margin=0.1):
    kept_p, kept_n = ref_vthm(pairs, margin)
    total = pairs.q.new_zeros(())
    for i in pairs.anchors:  # unified Table 1 "VTHM": weight 1 on every mined pair, averaged over anchors
        total = total + sum((pairs.cos(i, k) for k in kept_n[i]), pairs.q.new_zeros(()))
        total = total - sum((pairs.cos(i, k) for k in kept_p[i]), pairs.q.new_zeros(()))
    return total / len(pairs.anchors)


@anchor_based
def ref_nca_triplets(pairs, mining):
    """[(s_ap, s_an)] for each ordered positive pair with its mined negative (sct HN / SHN)."""
    triplets = []
    for a, p in pairs.positive_pairs():
        s_ap = pairs.cos(a, p)
        candidates = [n for n in pairs.negatives(a) if mining == "hard" or f(pairs.cos(a, n)) < f(s_ap)]
        if candidates:
            n = max(candidates, key=lambda k: f(pairs.cos(a, k)))
            triplets.append((s_ap, pairs.cos(a, n)))
    return triplets


@anchor_based
def ref_nca_triplet(pairs, mining="hard", temperature=1.0):
    triplets = ref_nca_triplets(pairs, mining)
    # sct eq. 1: -log(exp(S_ap) / (exp(S_ap) + exp(S_an)))
    terms = [
        -torch.log(
            torch.exp(s_ap / temperature) / (torch.exp(s_ap / temperature) + torch.exp(s_an / temperature))
        )
        for s_ap, s_an in triplets
    ]
    return sum(terms, pairs.q.new_zeros(())) / max(len(terms), 1)


@anchor_based
def ref_sct(pairs, lam=1.0, hard_rule="paper", threshold=0.8, temperature=None):
    temperature = temperature or (1.0 if hard_rule == "paper" else 0.1)
    terms = []
    for s_ap, s_an in ref_nca_triplets(pairs, "hard"):  # sct eq. 13
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
    return sum(terms, pairs.q.new_zeros(())) / max(len(terms), 1)



@anchor_based
def ref_contrastive(pairs, form="cosine", **kwargs):
    return ref_contrastive_cosine(pairs, **kwargs) if form == "cosine" else ref_contrastive_distance(pairs, **kwargs)


@anchor_based
def ref_ntxent(pairs, temperature=0.1):
    """SimCLR eq. 1 for each (anchor i, positive j): -log(exp(s_ij / tau) / sum_{k != i} exp(s_ik / tau)), k over
    every gallery row but i itself; the mean over those terms."""
    terms = []
    for i, j in pairs.positive_pairs():
        others = [k for k in range(len(pairs.yg)) if k != pairs.self_index[i]]
        denominator = sum(torch.exp(pairs.cos(i, k) / temperature) for k in others)
        terms.append(-torch.log(torch.exp(pairs.cos(i, j) / temperature) / denominator))
    return sum(terms, pairs.q.new_zeros(())) / max(len(terms), 1)


# every loss with the rectangular form (anchors against a gallery) -> its reference, called with a QueryGallery
ANCHOR_REFERENCES = {
    "contrastive": ref_contrastive,
    "triplet": ref_triplet,
    "nca_triplet": ref_nca_triplet,
    "sct": ref_sct,
    "generalized_lifted": ref_generalized_lifted,
    "npair": ref_npair,
    "binomial": ref_binomial,
    "vthm": ref_vthm_equal_weights,
    "raw": ref_raw,
    "ms": functools.partial(ref_raw, miner="vthm"),  # MS = RAW over the VTHM-mined pairs (unified section 5.1)
    "ntxent": ref_ntxent,
}
