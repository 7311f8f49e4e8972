"""Margin triplet losses on Euclidean distances: triplet (all / semi-hard / batch-hard) and HPHN triplet."""

from __future__ import annotations

import math

import torch

from retrieval.losses.base import (
    AnchorPairs,
    DistancePairLoss,
    anchors_with_triplets,
    check_pair_rows,
    masked_max,
    masked_min,
    mean_over,
)
from retrieval.negatives.base import NEGATIVE_PAIRS_READING, PairTerms
from retrieval.negatives.pairs import check_negative_pairs
from retrieval.utils.reads import Stat, share

TRIPLET_MINING = ("all", "semihard", "hard")
# What the summed hinge of "all" / "semihard" is divided by: the positive pairs |P| (loop eq. 14) or the number of
# mined triplets (dcdl eq. 3, where |P| "represents the number of triplets").
TRIPLET_REDUCTIONS = ("positive_pairs", "triplets")


@torch.no_grad()
def triplet_stats(s_ap: torch.Tensor, s_an: torch.Tensor, losses: torch.Tensor, kept: torch.Tensor
                  ) -> dict[str, Stat]:
    """Share of kept triplets with S_an > S_ap (hard), and how many have a nonzero hinge (active)."""
    count = kept.sum()
    hard = ((s_an > s_ap) & kept).sum()
    active = ((losses > 0) & kept).sum()
    return {
        "triplets": count,
        "hard_fraction": share(hard, count),
        "active_triplets": active,
        "active_fraction": share(active, count),
    }


class TripletLoss(DistancePairLoss):
    """[d_ap - d_an + m]_+ (loop eq. 14; squared distances as symm eq. 3 with ``squared=True``).

    mining:
      - ``"all"``: every valid triplet, summed and divided by the number of (ordered) positive pairs |P|
        exactly as eq. 14 writes it.
      - ``"semihard"``: the same sum restricted to triplets with d_ap < d_an < d_ap + m (FaceNet), still
        divided by |P| (a batch with few semi-hard triplets gives a small loss, as in eq. 14).
      - ``"hard"``: batch-hard (Hermans et al.): per anchor the farthest positive and the nearest negative,
        averaged over anchors that have both.

    ``reduction="triplets"`` divides the sum by the number of kept triplets instead (dcdl eq. 3: a mean over
    the mined triplets; 0 when none is kept).
    """

    paper_equation = (
        "loop eq. 14 (symm eq. 3 with squared=True; dcdl eq. 3 as dcdl runs it: squared, semihard, "
        "reduction=triplets); + LoOp: loop eq. 15; + Symm: symm eq. 4"
    )
    readings = {
        "reduction": (
            "'positive_pairs' = the hinge sum over |P| (loop eq. 14, default) or 'triplets' = the mean "
            "over the kept triplets (dcdl eq. 3)"
        ),
        "mining": (
            "'all' (loop eq. 14), 'semihard' (FaceNet, Schroff et al. 2015 sec. 3.2: d_ap < d_an < d_ap +"
            " m) or 'hard' (batch-hard)"
        ),
    }

    def __init__(
        self, margin: float = 0.2, mining: str = "all", squared: bool = False, reduction: str = "positive_pairs"
    ) -> None:
        super().__init__(squared=squared)
        if mining not in TRIPLET_MINING:
            raise ValueError(f"triplet mining must be one of {TRIPLET_MINING}, got {mining!r}")
        if reduction not in TRIPLET_REDUCTIONS:
            raise ValueError(f"triplet reduction must be one of {TRIPLET_REDUCTIONS}, got {reduction!r}")
        self.margin = margin
        self.mining = mining
        self.reduction = reduction

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        """Eq. 14 over the triplets (anchor a, gallery positive p, gallery negative n) of every anchor."""
        similarity, positive, negative = pairs.similarity, pairs.positive, pairs.negative
        distance = self.distance(similarity)
        if self.mining == "hard":
            return self._batch_hard(similarity, distance, positive, negative)
        # One row per positive pair (a, p): [|P|, M] instead of a dense [B, M, M] cube (|P| = B (K - 1)).
        a, p = positive.nonzero(as_tuple=True)  # [|P|] each: small; the check comes before the [|P|, M] terms
        check_pair_rows(len(a), similarity.shape[1], type(self).__name__)
        d_ap = distance[a, p].unsqueeze(1)  # [|P|, 1]
        d_an = distance[a]  # [|P|, M]
        losses = torch.relu(d_ap - d_an + self.margin)  # eq. 14
        kept = negative[a]
        if self.mining == "semihard":  # FaceNet: d_ap < d_an < d_ap + m
            kept = kept & (d_an > d_ap) & (d_an < d_ap + self.margin)
        self.last_stats = triplet_stats(similarity[a, p].unsqueeze(1), similarity[a], losses, kept)
        if self.reduction == "triplets":  # dcdl eq. 3
            return mean_over(losses, kept)
        num_positive_pairs = positive.sum().clamp_min(1).to(similarity.dtype)
        return torch.where(kept, losses, torch.zeros_like(losses)).sum() / num_positive_pairs  # loop eq. 14

    def _batch_hard(
        self, similarity: torch.Tensor, distance: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        hardest_positive = masked_max(distance, positive, dim=1)
        hardest_negative = masked_min(distance, negative, dim=1)
        losses = torch.relu(hardest_positive - hardest_negative + self.margin)
        valid = anchors_with_triplets(positive, negative)
        with torch.no_grad():
            s_ap = masked_min(similarity, positive, dim=1)
            s_an = masked_max(similarity, negative, dim=1)
        self.last_stats = triplet_stats(s_ap, s_an, losses, valid)
        return mean_over(losses, valid)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """LoOp eq. 15 / Symm eq. 4 (squared): (1/|P|) sum over pair (i, j) and pair (k, l) of another class of
        [d_ij - d_(ij)(kl) + m]_+, d_(ij)(kl) the hardest negative of the two pairs."""
        if self.mining != "all" or self.reduction != "positive_pairs":
            raise ValueError(f"triplet mining={self.mining!r}, reduction={self.reduction!r} has no pair-level form; "
                             "hard negatives use mining='all', reduction='positive_pairs'")
        d_positive = self.distance(terms.positive_similarity())
        hinge = torch.relu(d_positive.unsqueeze(1) - terms.negative_distance(self.squared) + self.margin)
        return torch.where(terms.negative, hinge, torch.zeros_like(hinge)).sum() / len(terms.pairs)


class HPHNTripletLoss(DistancePairLoss):
    """Hard-positive hard-negative triplet (loop section 3.3.2), one term per positive pair (i, j):

    [max(max_{c_k = c_i} d_ik, max_{c_l = c_j} d_jl) + m
     - min(min_{c_k != c_i} d_ik, min_{c_l != c_j} d_jl)]_+,
    averaged over the positive pairs P (ordered pairs; the term is symmetric in i, j so the mean is the
    same as over unordered pairs). Pairs of a class with no negative in the batch contribute nothing.
    """

    paper_equation = "loop section 3.3.2; + LoOp: its LoOp form"
    rectangular = False
    square_only = ("the term of a positive pair (i, j) takes the hardest positive and negative of j as well as of i "
                   "(loop section 3.3.2), which for a gallery row j is its own row of similarities")
    readings = {"negative_pairs": NEGATIVE_PAIRS_READING}

    def __init__(self, margin: float = 0.2, squared: bool = False, negative_pairs: str = "consecutive") -> None:
        super().__init__(squared=squared)
        self.margin = margin
        self.negative_pairs = check_negative_pairs(negative_pairs)  # with LoOp: which pairs (k, l) the min spans

    def from_similarity(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positive, negative = self.pairs(labels)
        distance = self.distance(similarity)
        hardest_positive = masked_max(distance, positive, dim=1)  # [B]
        hardest_negative = masked_min(distance, negative, dim=1)
        pair_positive = torch.maximum(hardest_positive.unsqueeze(1), hardest_positive.unsqueeze(0))
        pair_negative = torch.minimum(hardest_negative.unsqueeze(1), hardest_negative.unsqueeze(0))
        losses = torch.relu(pair_positive + self.margin - pair_negative)
        kept = positive & anchors_with_triplets(positive, negative).unsqueeze(1)
        with torch.no_grad():
            s_ap = masked_min(similarity, positive, dim=1)
            s_an = masked_max(similarity, negative, dim=1)
            pair_s_ap = torch.minimum(s_ap.unsqueeze(1), s_ap.unsqueeze(0))
            pair_s_an = torch.maximum(s_an.unsqueeze(1), s_an.unsqueeze(0))
        self.last_stats = triplet_stats(pair_s_ap, pair_s_an, losses, kept)
        return mean_over(losses, kept)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """LoOp section 3.3.2: the hardest batch positive of i or j, the hardest negative of the pair (i, j)
        against the pairs of other classes, averaged over the positive pairs."""
        # The hardest positive is the least similar one: max_k d_ik = d(min_k s_ik).
        least_similar = torch.where(terms.same_class(), terms.gram, math.inf).amin(dim=1)
        hardest_positive = self.distance(least_similar)
        pair_positive = torch.maximum(hardest_positive[terms.pairs.first], hardest_positive[terms.pairs.second])
        pair_negative, valid = terms.nearest_negative(self.squared)
        hinge = torch.relu(pair_positive + self.margin - pair_negative)
        return torch.where(valid, hinge, torch.zeros_like(hinge)).sum() / len(terms.pairs)
