"""Lifted-structure losses: the smooth form (symm eq. 5), the hinge/min form (loop eq. 16) and the
generalised form on similarities (unified eq. 9)."""

from __future__ import annotations

import torch

from retrieval.distances import masked_logsumexp
from retrieval.losses.base import (
    AnchorPairs,
    DistancePairLoss,
    PairLoss,
    anchors_with_triplets,
    masked_min,
    mean_over,
)
from retrieval.negatives.base import NEGATIVE_PAIRS_READING, PairTerms
from retrieval.negatives.pairs import check_negative_pairs
from retrieval.utils.reads import active_fraction


def _pairs_with_negatives(positive: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Positive pairs (i, j) whose class has at least one negative in the batch."""
    return positive & anchors_with_triplets(positive, negative).unsqueeze(1)


class LiftedStructureLoss(DistancePairLoss):
    """Lifted structure loss (symm eq. 5, Oh Song et al. 2016) on Euclidean distances of unit vectors:

    1/(2|P|) sum_{(i,j) in P} [ log{ sum_{k: l_k != l_i} exp(m - D_ik) + sum_{k: l_k != l_j} exp(m - D_jk) }
                                + D_ij ]_+^2,

    P the positive pairs (the term is symmetric in i, j, so ordered or unordered pairs give the same mean).
    Default margin m = 1 (Oh Song et al.). Pairs of a class with no negative in the batch contribute 0.
    """

    paper_equation = "symm eq. 5 (Oh Song et al. 2016); + Symm: symm eq. 6"
    rectangular = False
    square_only = ("the term of a positive pair (i, j) sums the negatives of j as well as those of i (symm eq. 5), "
                   "which for a gallery row j is its own row of similarities")

    def __init__(self, margin: float = 1.0, squared: bool = False) -> None:
        super().__init__(squared=squared)
        self.margin = margin

    def from_similarity(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positive, negative = self.pairs(labels)
        distance = self.distance(similarity)
        # log sum_{k in N_i} exp(m - D_ik) per anchor; N_i == N_j for a positive pair, so the two sums of
        # eq. 5 combine with a logaddexp of the two anchors' terms.
        per_anchor = masked_logsumexp(self.margin - distance, negative, dim=1)
        pair_negative = torch.logaddexp(per_anchor.unsqueeze(1), per_anchor.unsqueeze(0))
        losses = torch.relu(pair_negative + distance).pow(2)
        kept = _pairs_with_negatives(positive, negative)
        self.last_stats = {"active_pair_fraction": active_fraction(losses, kept)}
        return 0.5 * mean_over(losses, kept)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """Symm eq. 6: [log sum_(k,l) exp(m - D_(ij)(kl)) + D_ij]_+^2 averaged over the positive pairs, D_(ij)(kl)
        the hardest negative of the two pairs."""
        negatives = masked_logsumexp(self.margin - terms.negative_distance(self.squared), terms.negative, dim=1)
        per_pair = torch.relu(negatives + self.distance(terms.positive_similarity())).pow(2)
        valid = terms.negative.any(dim=1)
        return torch.where(valid, per_pair, torch.zeros_like(per_pair)).sum() / len(terms.pairs)


class LiftedMinLoss(DistancePairLoss):
    """Lifted structure in the hinge/min form of loop eq. 16:

    1/|P| sum_{(i,j) in P} [ d_ij + m - min( min_{c_k != c_i} d_ik, min_{c_l != c_j} d_jl ) ]_+.

    Default margin m = 1 (Oh Song et al.; the LoOp paper does not state its value).
    """

    paper_equation = "loop eq. 16 (hinge/min form); + LoOp: loop section 3.3.3"
    rectangular = False
    square_only = ("the term of a positive pair (i, j) takes the nearest negative of j as well as of i (loop eq. 16), "
                   "which for a gallery row j is its own row of similarities")
    readings = {"negative_pairs": NEGATIVE_PAIRS_READING}

    def __init__(self, margin: float = 1.0, squared: bool = False, negative_pairs: str = "consecutive") -> None:
        super().__init__(squared=squared)
        self.margin = margin
        self.negative_pairs = check_negative_pairs(negative_pairs)  # with LoOp: which pairs (k, l) the min spans

    def from_similarity(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positive, negative = self.pairs(labels)
        distance = self.distance(similarity)
        nearest_negative = masked_min(distance, negative, dim=1)
        pair_negative = torch.minimum(nearest_negative.unsqueeze(1), nearest_negative.unsqueeze(0))
        losses = torch.relu(distance + self.margin - pair_negative)  # eq. 16
        kept = _pairs_with_negatives(positive, negative)
        self.last_stats = {"active_pair_fraction": active_fraction(losses, kept)}
        return mean_over(losses, kept)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """LoOp section 3.3.3: [d_ij + m - min_(k,l) d_(ij)(kl)]_+ averaged over the positive pairs."""
        nearest_negative, valid = terms.nearest_negative(self.squared)
        hinge = torch.relu(self.distance(terms.positive_similarity()) + self.margin - nearest_negative)
        return torch.where(valid, hinge, torch.zeros_like(hinge)).sum() / len(terms.pairs)


class GeneralizedLiftedLoss(PairLoss):
    """Generalised lifted structure (Hermans et al.) on cosine similarities, unified eq. 9, read as

    (1/m) sum_i [ log sum_{k in P_i} exp(-s_ik) + log sum_{k in N_i} exp(lambda + s_ik) ]_+.

    The printed eq. 9 has ``- log sum_{N_i} exp(lambda - s_ik)``, whose gradient would weight negatives by
    softmax(-s), contradicting the paper's own weights (eq. 11: softmax(s) over N_i) and Hermans et al.'s
    distance form (log sum exp(D_ip) + log sum exp(m - D_in) with D = -s). We implement the form that
    yields eq. 10-11. Default lambda = 1 (the paper gives none). Anchors without a positive or a negative
    contribute 0.
    """

    paper_equation = "unified eq. 9 (Hermans et al.)"

    def __init__(self, margin: float = 1.0) -> None:
        super().__init__()
        self.margin = margin

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        similarity, positive, negative = pairs.similarity, pairs.positive, pairs.negative
        positive_part = masked_logsumexp(-similarity, positive, dim=1)
        negative_part = masked_logsumexp(self.margin + similarity, negative, dim=1)
        losses = torch.relu(positive_part + negative_part)  # eq. 9 (sign-corrected, see docstring)
        valid = anchors_with_triplets(positive, negative)
        self.last_stats = {"active_anchor_fraction": active_fraction(losses, valid)}
        return torch.where(valid, losses, torch.zeros_like(losses)).sum() / similarity.shape[0]
