"""N-pair-style losses on raw (not L2-normalised) features: N-pair, angular, and N-pair + angular.

symm section 4.2: "N-pair and angular loss use non-l2-normalized features", so S_ij = x_i^T x_j here and
the norm is kept in check by the penalty ``l2_reg * mean_i |x_i|^2`` (= l2_reg * mean diag(S)), on by default:
symm section 3.1 relies on it ("N-pair and angular loss regularize the norm ... (Sohn 2016; Wang et al. 2017)").
The default lambda = 0.002 is the N-pair reference implementation's (TensorFlow ``npairs_loss(reg_lambda=0.002)``,
which adds 0.25 * lambda * (mean |anchor|^2 + mean |positive|^2), i.e. lambda / 2 * mean |x|^2 when every sample is
both); Sohn 2016 (not in docs' paper set) states the regulariser, not a number we could check. ``l2_reg=0`` turns
it off (the previous default).

The papers build batches of N pairs (one positive per anchor). Eq. 7 and 9 of symm are written over all
positive pairs P and all negatives k with l_k != l_i, which is how we generalise to more than 2 samples per
class: every ordered positive pair (i, j) is a tuple, its negatives are all samples of the other classes.
With exactly 2 per class this is the paper's batch (|P| = N, one positive per anchor).
"""

from __future__ import annotations

import math

import torch

from retrieval.distances import dot_similarity_matrix, gram_matrix, label_masks, masked_logsumexp
from retrieval.losses.base import PER_CLASS_HINT, AnchorPairs, PairLoss
from retrieval.negatives.base import PairTerms
from retrieval.negatives.symm import ANGULAR_POSITIVE_SUMS
from retrieval.utils.reads import require

# lambda of the embedding-norm regulariser (Sohn 2016's N-pair; TensorFlow npairs_loss reg_lambda default)
DEFAULT_L2_REG = 0.002
ANGULAR_SQUARE_ONLY = ("angular's negative term 4 tan^2 a (x_i + x_j).x_k (symm eq. 9) reads the similarity of the "
                       "positive j with every negative k, for a gallery row j its own row of similarities")


class DotPairLoss(PairLoss):
    """Base of the N-pair family: dot-product similarities, a positive per anchor, an L2 norm penalty."""

    cosine_similarity = False
    readings = {
        "l2_reg": "Sohn 2016's norm regulariser l2_reg * mean |x|^2 on the raw features, default 0.002 (the N-pair "
                  "reference implementation's lambda; symm section 3.1 relies on it); 0 turns it off",
    }

    def __init__(self, l2_reg: float = DEFAULT_L2_REG) -> None:
        super().__init__()
        self.l2_reg = l2_reg

    def similarity(self, embeddings: torch.Tensor, gallery: torch.Tensor | None = None) -> torch.Tensor:
        """S_ij = x_i . y_j, raw inner products."""
        if gallery is None:
            return gram_matrix(embeddings)  # = dot_similarity_matrix(embeddings), cheaper backward
        return dot_similarity_matrix(embeddings, gallery)

    def self_similarity(self, embeddings: torch.Tensor) -> torch.Tensor:
        """[B] |x_i|^2."""
        return (embeddings * embeddings).sum(dim=1)

    def check_batch(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        self.check_shapes(embeddings, labels)
        has_positive = label_masks(labels)[0].any(dim=1)

        def lonely_anchors() -> ValueError:  # on failure only: the count is read then
            lonely = int((~has_positive).sum())
            if lonely == len(labels):
                return self.no_positive_pair()
            return ValueError(f"{type(self).__name__} needs a positive for every anchor (N-pair tuples), but {lonely} "
                              f"sample(s) have no other sample of their class in the batch; {PER_CLASS_HINT}")

        require(has_positive.all(), lonely_anchors)

    def norm_penalty(self, self_similarity: torch.Tensor) -> torch.Tensor:
        """l2_reg * mean squared norm of the anchors, from their s_ii = |x_i|^2 (the dot-product diagonal)."""
        return self.l2_reg * self_similarity.mean()

    def pair_losses(
        self, similarity: torch.Tensor, anchor: torch.Tensor, other: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        """The loss [|P|] of each positive pair (anchor[t], other[t]); negative is the [B, M] label mask."""
        raise NotImplementedError

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        """The mean over the positive pairs (anchor i, gallery j) of their loss, plus the anchors' norm penalty."""
        with torch.no_grad():  # raw features: the norm is worth watching
            self.last_stats = {"mean_norm": pairs.self_similarity.clamp_min(0).sqrt().mean()}
        # Only the positive pairs carry a loss: index them, O(|P| M) work, never a [B, M, M] cube.
        anchor, other = pairs.positive.nonzero(as_tuple=True)
        losses = self.pair_losses(pairs.similarity, anchor, other, pairs.negative)
        mean = losses.sum() / max(len(losses), 1)  # 0 (still on the graph) when the batch has no pair
        return mean + self.norm_penalty(pairs.self_similarity)


def npair_losses(
    similarity: torch.Tensor, anchor: torch.Tensor, other: torch.Tensor, negative: torch.Tensor
) -> torch.Tensor:
    """[t]: log(1 + sum_{k: l_k != l_i} exp(S_ik - S_ij)) (symm eq. 7) for the pair (i, j) = (anchor[t],
    other[t]).

    = log(1 + exp(LSE_{k in N_i} S_ik - S_ij)): the sum over k does not depend on j, so one masked
    log-sum-exp per anchor, O(B^2) in all.
    """
    lse = masked_logsumexp(similarity, negative, dim=1)  # [B]
    # an anchor without negatives: sum over k is empty, log(1 + 0) = 0
    lse = torch.where(negative.any(dim=1), lse, torch.full_like(lse, -math.inf))
    logits = lse[anchor] - similarity[anchor, other]
    return torch.logaddexp(logits, torch.zeros_like(logits))  # log(1 + exp(.)), exact (no softplus cut-off)


def angular_losses(
    similarity: torch.Tensor,
    anchor: torch.Tensor,
    other: torch.Tensor,
    negative: torch.Tensor,
    alpha_degrees: float,
) -> torch.Tensor:
    """[t]: log(1 + sum_{k: l_k != l_i} exp(f^n_ijk - f^p_ij)) (symm eq. 9) for the pair (i, j) =
    (anchor[t], other[t]), with f^p_ij = 2 (1 + tan^2 alpha) S_ij and f^n_ijk = 4 tan^2 alpha (S_ik + S_jk).

    One [|P|, B] row of negatives per pair.
    """
    tan2 = math.tan(math.radians(alpha_degrees)) ** 2
    f_positive = 2.0 * (1.0 + tan2) * similarity[anchor, other]  # [|P|]
    f_negative = 4.0 * tan2 * (similarity[anchor] + similarity[other])  # [|P|, B]
    logits = f_negative - f_positive.unsqueeze(1)
    # for a positive pair l_i == l_j, so "k negative to i" is also "k negative to j".
    return masked_logsumexp(logits, negative[anchor], dim=1, add_one=True)


class NPairLoss(DotPairLoss):
    """Multi-class N-pair loss, symm eq. 7:
    1/|P| sum_{(i,j) in P} log[1 + sum_{k: l_k != l_i} exp(S_ik - S_ij)] + l2_reg * mean |x|^2.
    Default l2_reg = 0.002 (``DEFAULT_L2_REG``; 0 turns the norm penalty off)."""

    paper_equation = "symm eq. 7 (Sohn 2016); + Symm: symm eq. 8"

    normalized_embeddings = False  # N-pair keeps the raw norms (its l2_reg regularises them)

    def pair_losses(
        self, similarity: torch.Tensor, anchor: torch.Tensor, other: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        return npair_losses(similarity, anchor, other, negative)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """Symm eq. 8: mean over positive pairs of log(1 + sum_(k,l) exp(S_(ij)(kl) - S_ij)), S_(ij)(kl) the
        hardest negative inner product of the two pairs."""
        logits = terms.negative_similarity() - terms.positive_similarity().unsqueeze(1)
        loss = masked_logsumexp(logits, terms.negative, dim=1, add_one=True).mean()
        return loss + self.norm_penalty(torch.diagonal(terms.gram)) if self.l2_reg else loss


def _check_angle(alpha: float) -> float:
    if not 0.0 < alpha < 90.0:
        raise ValueError(f"angular alpha is an angle in degrees in (0, 90), got {alpha}")
    return alpha


class AngularLoss(DotPairLoss):
    """Angular loss, symm eq. 9, alpha in degrees. Default alpha = 30 (the DCDL paper's value for L_Ang;
    the symm paper gives none)."""

    paper_equation = "symm eq. 9 (Wang et al. 2017); + Symm: symm eq. 10"

    # f^n = 4 tan^2 a (x_p + x_q).x_r: the negative side compares sums of two points of the positive pair
    positive_rows = ANGULAR_POSITIVE_SUMS
    rectangular = False
    square_only = ANGULAR_SQUARE_ONLY

    def __init__(self, alpha: float = 30.0, l2_reg: float = DEFAULT_L2_REG) -> None:
        super().__init__(l2_reg=l2_reg)
        self.alpha = _check_angle(alpha)

    def pair_losses(
        self, similarity: torch.Tensor, anchor: torch.Tensor, other: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        return angular_losses(similarity, anchor, other, negative, self.alpha)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """Symm eq. 10: f^p = 2 (1 + tan^2 a) S_ij and f^n the hardest 4 tan^2 a (x_p + x_q).x_r of 12 triplets,
        (p, q) one of the three pairs congruent to (x_i, x_j), r one of the four points of the other pair."""
        tan_sq = math.tan(math.radians(self.alpha)) ** 2
        f_negative = 4.0 * tan_sq * terms.negative_similarity()  # the factor is positive: applied after the max
        f_positive = 2.0 * (1.0 + tan_sq) * terms.positive_similarity()
        logits = f_negative - f_positive.unsqueeze(1)
        loss = masked_logsumexp(logits, terms.negative, dim=1, add_one=True).mean()
        return loss + self.norm_penalty(torch.diagonal(terms.gram)) if self.l2_reg else loss


class AngularNPairLoss(DotPairLoss):
    """N-pair + lambda_ang * angular (dcdl eq. 4): lambda_ang = 2, alpha = 45 degrees (DCDL section 4);
    the L2 penalty is added once."""

    paper_equation = "dcdl eq. 4 (N-pair + lambda_ang * angular)"
    rectangular = False
    square_only = ANGULAR_SQUARE_ONLY

    def __init__(self, alpha: float = 45.0, lambda_ang: float = 2.0, l2_reg: float = DEFAULT_L2_REG) -> None:
        super().__init__(l2_reg=l2_reg)
        self.alpha = _check_angle(alpha)
        self.lambda_ang = lambda_ang

    def pair_losses(
        self, similarity: torch.Tensor, anchor: torch.Tensor, other: torch.Tensor, negative: torch.Tensor
    ) -> torch.Tensor:
        npair = npair_losses(similarity, anchor, other, negative)
        angular = angular_losses(similarity, anchor, other, negative, self.alpha)
        return npair + self.lambda_ang * angular  # eq. 4
