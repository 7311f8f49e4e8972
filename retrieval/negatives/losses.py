"""Losses with LoOp and Symm hard negatives, registered as ``build(loss, negatives=method)``.

LoOp (section 3.3 of the LoOp paper): triplet (eq. 15), HPHN triplet, lifted structure (min form) and
multi-similarity, with ``negatives="loop"`` (arcs) or ``"loop-linear"`` (segments, section 4.2).
Symm (section 3.2 of the Symmetrical Synthesis paper): triplet (eq. 4), lifted (eq. 6), N-pair (eq. 8) and
angular (eq. 10), with ``negatives="symm"``.

All of them work on positive pairs formed from labels (``pairs.positive_pairs``) and, for each, on the
pairs of the other classes. ``|P|`` in the papers' normalisations is the number of positive pairs (the
number of anchors for MS). Each module exposes ``last_stats`` after a forward pass, with
``synthetic_negative_share``: the share of synthetic points among the negatives it used (Symm: the
hardest of the 16 pairs, Figure 7 of the Symm paper; LoOp: points p1, p2 that are not an embedding).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from retrieval.distances import (
    dot_similarity_matrix,
    gram_matrix,
    l2_normalize,
    masked_logsumexp,
    safe_sqrt,
    zero_loss,
)
from retrieval.losses import register_negatives
from retrieval.negatives.loop import pair_of_pairs_distances
from retrieval.negatives.pairs import PositivePairs, pair_combinations, positive_pairs
from retrieval.negatives.symm import POINTS, Combinations, hardest_combination, hardest_of_16, synthetic_share

_GEOMETRY = {"loop": "arc", "loop-linear": "segment"}


def _check_inputs(embeddings: torch.Tensor, labels: torch.Tensor) -> None:
    if embeddings.dim() != 2:
        raise ValueError(f"embeddings must be [B, D], got shape {tuple(embeddings.shape)}")
    if labels.dim() != 1 or labels.numel() != embeddings.shape[0]:
        raise ValueError(f"labels must be [B] with B = {embeddings.shape[0]} (one per row), got {tuple(labels.shape)}")


class _PairOfPairsLoss(nn.Module):
    """Shared plumbing: positive pairs, the [Pp, Pp] mask of pairs of different classes, stats."""

    def __init__(self) -> None:
        super().__init__()
        self.last_stats: dict[str, float] = {}

    @staticmethod
    def _pairs(embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[PositivePairs, torch.Tensor]:
        _check_inputs(embeddings, labels)
        pairs = positive_pairs(labels.to(embeddings.device))
        if len(pairs) == 0:
            raise ValueError(
                "LoOp/Symm losses need positive pairs, but every label appears once in the batch; use "
                "--per-class 2 or more (an even number: ClassBalancedBatchSampler samples_per_class)"
            )
        negative = pairs.labels.view(-1, 1) != pairs.labels.view(1, -1)
        return pairs, negative


# ----------------------------------------------------------------------------------------------------
# LoOp
# ----------------------------------------------------------------------------------------------------


class _LoOpLoss(_PairOfPairsLoss):
    def __init__(self, method: str) -> None:
        super().__init__()
        if method not in _GEOMETRY:
            raise ValueError(f"LoOp method must be one of {sorted(_GEOMETRY)}, got {method!r}")
        self.method = method

    def _loop_distances(self, gram: torch.Tensor, pairs: PositivePairs, negative: torch.Tensor) -> torch.Tensor:
        """[Pp, Pp] matrix of d_{i,j,k,l} (symmetric; zero where ``negative`` is False)."""
        n = len(pairs)
        p, q = pair_combinations(pairs.labels)
        d, sol = pair_of_pairs_distances(
            gram, pairs.first[p], pairs.second[p], pairs.first[q], pairs.second[q], _GEOMETRY[self.method]
        )
        synthetic = (~sol.at_endpoints).float()
        self.last_stats = {
            "synthetic_negative_share": float(synthetic.mean()) if synthetic.numel() else 0.0,
            "loop_combinations": float(p.numel()),
        }
        full = gram.new_zeros(n, n)
        return full.index_put((torch.cat([p, q]), torch.cat([q, p])), torch.cat([d, d]))

    def _prepare(self, embeddings: torch.Tensor, labels: torch.Tensor):
        pairs, negative = self._pairs(embeddings, labels)
        gram = dot_similarity_matrix(l2_normalize(embeddings))  # Algorithm 1, step 3: unit embeddings
        if not negative.any():  # one class only: nothing to push apart
            self.last_stats = {"synthetic_negative_share": 0.0, "loop_combinations": 0.0}
            return None
        return pairs, negative, gram, self._loop_distances(gram, pairs, negative)


def _pair_distances(gram: torch.Tensor, pairs: PositivePairs) -> torch.Tensor:
    """d_{i,j} for unit embeddings, eq. 1: sqrt(2 (1 - s))."""
    return safe_sqrt((2.0 - 2.0 * gram[pairs.first, pairs.second]).clamp_min(0.0))


def _hardest_loop_negative(loop_d: torch.Tensor, negative: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(min over negative pairs of d_{i,j,k,l}, rows that have a negative pair)."""
    big = torch.full_like(loop_d, 4.0)  # above any distance between unit vectors (max 2)
    return torch.where(negative, loop_d, big).amin(dim=1), negative.any(dim=1)


class LoOpTripletLoss(_LoOpLoss):
    """Eq. 15: (1/|P|) sum over (i, j) and (k, l) of another class of [d_ij - d_ijkl + m]_+."""

    def __init__(self, margin: float = 0.2, method: str = "loop") -> None:
        super().__init__(method)
        self.margin = margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prep = self._prepare(embeddings, labels)
        if prep is None:
            return zero_loss(embeddings)
        pairs, negative, gram, loop_d = prep
        d_pos = _pair_distances(gram, pairs)
        hinge = torch.relu(d_pos.unsqueeze(1) - loop_d + self.margin)
        return torch.where(negative, hinge, torch.zeros_like(hinge)).sum() / len(pairs)


class LoOpHPHNTripletLoss(_LoOpLoss):
    """HPHN triplet with LoOp (section 3.3.2): hardest positive of i or j, hardest LoOp negative."""

    def __init__(self, margin: float = 0.2, method: str = "loop") -> None:
        super().__init__(method)
        self.margin = margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prep = self._prepare(embeddings, labels)
        if prep is None:
            return zero_loss(embeddings)
        pairs, negative, gram, loop_d = prep
        labels = labels.to(embeddings.device)
        same = (labels.view(-1, 1) == labels.view(1, -1)) & ~torch.eye(
            len(labels), dtype=torch.bool, device=labels.device
        )
        # The hardest positive is the least similar one: max_k d_ik = sqrt(2 - 2 min_k s_ik).
        min_pos_sim = torch.where(same, gram, torch.full_like(gram, 2.0)).amin(dim=1)
        hardest_pos = safe_sqrt((2.0 - 2.0 * min_pos_sim).clamp_min(0.0))
        hp = torch.maximum(hardest_pos[pairs.first], hardest_pos[pairs.second])
        hn, valid = _hardest_loop_negative(loop_d, negative)
        hinge = torch.relu(hp + self.margin - hn)
        return torch.where(valid, hinge, torch.zeros_like(hinge)).sum() / len(pairs)


class LoOpLiftedMinLoss(_LoOpLoss):
    """Lifted structure, min form, with LoOp (section 3.3.3): [d_ij + m - min d_ijkl]_+."""

    def __init__(self, margin: float = 1.0, method: str = "loop") -> None:
        super().__init__(method)
        self.margin = margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prep = self._prepare(embeddings, labels)
        if prep is None:
            return zero_loss(embeddings)
        pairs, negative, gram, loop_d = prep
        hn, valid = _hardest_loop_negative(loop_d, negative)
        hinge = torch.relu(_pair_distances(gram, pairs) + self.margin - hn)
        return torch.where(valid, hinge, torch.zeros_like(hinge)).sum() / len(pairs)


class LoOpMultiSimilarityLoss(_LoOpLoss):
    """Multi-similarity with LoOp (section 3.3.4).

    Anchor i in pair (i, j): its negatives are the LoOp similarities s_{i,k,j,l} = 1 - d_ijkl^2 / 2 of its
    pair against every pair of another class, kept when s > min_k s_ik - epsilon; positives are the
    batch positives s_ik, kept when s_ik < max s_{i,k,j,l} + epsilon (the unchanged rule, applied to the
    anchor's negatives, which are now the LoOp ones). Pair weighting as in MS.
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        margin: float = 0.1,
        method: str = "loop",
    ) -> None:
        super().__init__(method)
        # Names as the base "ms" loss: gamma is the MS paper's lambda, margin its epsilon.
        self.alpha, self.beta, self.gamma, self.margin = alpha, beta, gamma, margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        prep = self._prepare(embeddings, labels)
        if prep is None:
            return zero_loss(embeddings)
        pairs, negative, gram, loop_d = prep
        labels = labels.to(embeddings.device)
        anchors = torch.cat([pairs.first, pairs.second])
        pair_of_anchor = torch.arange(len(pairs), device=gram.device).repeat(2)
        neg_sim = 1.0 - loop_d[pair_of_anchor].pow(2) / 2.0  # [A, Pp]
        neg_mask = negative[pair_of_anchor]
        sim = gram[anchors]  # [A, B]
        pos_mask = labels[anchors].view(-1, 1) == labels.view(1, -1)
        pos_mask[torch.arange(len(anchors), device=gram.device), anchors] = False
        with torch.no_grad():  # mining only decides which pairs take part
            min_pos = torch.where(pos_mask, sim, torch.full_like(sim, math.inf)).amin(dim=1, keepdim=True)
            max_neg = torch.where(neg_mask, neg_sim, torch.full_like(neg_sim, -math.inf)).amax(dim=1, keepdim=True)
            keep_neg = neg_mask & (neg_sim > min_pos - self.margin)
            keep_pos = pos_mask & (sim < max_neg + self.margin)
        pos_term = masked_logsumexp(-self.alpha * (sim - self.gamma), keep_pos, dim=1, add_one=True) / self.alpha
        neg_term = masked_logsumexp(self.beta * (neg_sim - self.gamma), keep_neg, dim=1, add_one=True) / self.beta
        return (pos_term + neg_term).mean()


# ----------------------------------------------------------------------------------------------------
# Symmetrical synthesis
# ----------------------------------------------------------------------------------------------------


class _SymmLoss(_PairOfPairsLoss):
    normalize = True

    def _features(self, embeddings: torch.Tensor, labels: torch.Tensor):
        pairs, negative = self._pairs(embeddings, labels)
        if not negative.any():  # one class only: nothing to push apart
            self.last_stats = {"synthetic_negative_share": 0.0}
            return None
        # gram_matrix: the values of x @ x.T with a one-matmul backward (the largest cost at D = 512)
        gram = gram_matrix(l2_normalize(embeddings) if self.normalize else embeddings)
        return pairs, negative, gram

    def _record(self, selected: torch.Tensor, negative: torch.Tensor, left: Combinations = POINTS) -> None:
        share = synthetic_share(selected, negative, left=left)
        self.last_stats = {"synthetic_negative_share": float(share)}


class SymmTripletLoss(_SymmLoss):
    """Eq. 4: [D_ij^2 - min over the 16 pairs D_pn^2 + m]_+ for every pair (k, l) of another class."""

    def __init__(self, margin: float = 0.2) -> None:
        super().__init__()
        self.margin = margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        feats = self._features(embeddings, labels)
        if feats is None:
            return zero_loss(embeddings)
        pairs, negative, gram = feats
        # Unit embeddings: the nearest of the 16 pairs is the most similar one, D^2 = 2 - 2 S.
        best, selected = hardest_of_16(gram, pairs.first, pairs.second)
        hardest = (2.0 - 2.0 * best).clamp_min(0.0)
        self._record(selected, negative)
        d_pos_sq = (2.0 - 2.0 * gram[pairs.first, pairs.second]).clamp_min(0.0)  # unit embeddings
        hinge = torch.relu(d_pos_sq.unsqueeze(1) - hardest + self.margin)
        return torch.where(negative, hinge, torch.zeros_like(hinge)).sum() / len(pairs)


class SymmLiftedLoss(_SymmLoss):
    """Eq. 6: [log sum_(k,l) exp(m - min over the 16 pairs D_pn) + D_ij]_+^2, averaged over pairs."""

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.margin = margin

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        feats = self._features(embeddings, labels)
        if feats is None:
            return zero_loss(embeddings)
        pairs, negative, gram = feats
        best, selected = hardest_of_16(gram, pairs.first, pairs.second)
        hardest_sq = (2.0 - 2.0 * best).clamp_min(0.0)
        self._record(selected, negative)
        hardest = safe_sqrt(hardest_sq)
        inner = masked_logsumexp(self.margin - hardest, negative, dim=1) + _pair_distances(gram, pairs)
        valid = negative.any(dim=1)
        per_pair = torch.relu(inner).pow(2)
        return torch.where(valid, per_pair, torch.zeros_like(per_pair)).sum() / len(pairs)


class SymmNPairLoss(_SymmLoss):
    """Eq. 8 on unnormalised features: log(1 + sum_(k,l) exp(max over the 16 pairs S_pn - S_ij)).

    ``l2_reg`` adds the N-pair norm regulariser l2_reg * mean |x|^2 (0 = eq. 8 exactly).
    """

    normalize = False

    def __init__(self, l2_reg: float = 0.0) -> None:
        super().__init__()
        self.l2_reg = l2_reg

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        feats = self._features(embeddings, labels)
        if feats is None:
            return zero_loss(embeddings)
        pairs, negative, gram = feats
        hardest, selected = hardest_of_16(gram, pairs.first, pairs.second)
        self._record(selected, negative)
        s_pos = gram[pairs.first, pairs.second]
        loss = masked_logsumexp(hardest - s_pos.unsqueeze(1), negative, dim=1, add_one=True).mean()
        if self.l2_reg:
            loss = loss + self.l2_reg * embeddings.pow(2).sum(dim=1).mean()
        return loss


# Positive-side pairs congruent to (x_i, x_j) under the reflections (same similarity): (x_i, x_j),
# (x_i', x_j) and (x_i, x_j'), summed as x_p + x_q (indices into the four points of a pair).
ANGULAR_POSITIVE_SUMS = Combinations(((0, 1), (2, 1), (0, 3)))


class SymmAngularLoss(_SymmLoss):
    """Eq. 10 on unnormalised features, f^p = 2 (1 + tan^2 a) x_i.x_j, f^n = 4 tan^2 a (x_p + x_q).x_r.

    The hardest of 12 triplets: (p, q) one of the three pairs congruent to (x_i, x_j), r one of the
    four points of the other class.
    """

    normalize = False

    def __init__(self, alpha: float = 30.0, l2_reg: float = 0.0) -> None:
        super().__init__()
        if not 0.0 < alpha < 90.0:
            raise ValueError(f"angular alpha is an angle in degrees in (0, 90), got {alpha}")
        self.alpha = alpha  # degrees; same name and default as the base "angular" loss
        self.l2_reg = l2_reg

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        feats = self._features(embeddings, labels)
        if feats is None:
            return zero_loss(embeddings)
        pairs, negative, gram = feats
        tan_sq = math.tan(math.radians(self.alpha)) ** 2
        # (x_p + x_q).x_r for the 12 triplets; the positive factor 4 tan^2 a is applied after the max
        hardest, selected = hardest_combination(gram, pairs.first, pairs.second, left=ANGULAR_POSITIVE_SUMS)
        hardest = 4.0 * tan_sq * hardest
        self._record(selected, negative, left=ANGULAR_POSITIVE_SUMS)
        f_pos = 2.0 * (1.0 + tan_sq) * gram[pairs.first, pairs.second]
        loss = masked_logsumexp(hardest - f_pos.unsqueeze(1), negative, dim=1, add_one=True).mean()
        if self.l2_reg:
            loss = loss + self.l2_reg * embeddings.pow(2).sum(dim=1).mean()
        return loss


# ----------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------


def _register_loop(name: str, cls: type[_LoOpLoss]) -> None:
    for method in _GEOMETRY:
        register_negatives(name, method)(lambda _cls=cls, _m=method, **hp: _cls(method=_m, **hp))


_register_loop("triplet", LoOpTripletLoss)
_register_loop("hphn_triplet", LoOpHPHNTripletLoss)
_register_loop("lifted_min", LoOpLiftedMinLoss)
_register_loop("ms", LoOpMultiSimilarityLoss)
register_negatives("triplet", "symm")(SymmTripletLoss)
register_negatives("lifted", "symm")(SymmLiftedLoss)
register_negatives("npair", "symm")(SymmNPairLoss)
register_negatives("angular", "symm")(SymmAngularLoss)
