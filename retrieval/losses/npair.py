"""N-pair-style losses on raw (not L2-normalised) features: N-pair, angular, and N-pair + angular.

symm section 4.2: "N-pair and angular loss use non-l2-normalized features", so S_ij = x_i^T x_j here and
the norm is kept in check by an optional penalty ``l2_reg * mean_i |x_i|^2`` (= l2_reg * mean diag(S)).

The papers build batches of N pairs (one positive per anchor). Eq. 7 and 9 of symm are written over all
positive pairs P and all negatives k with l_k != l_i, which is how we generalise to more than 2 samples per
class: every ordered positive pair (i, j) is a tuple, its negatives are all samples of the other classes.
With exactly 2 per class this is the paper's batch (|P| = N, one positive per anchor).
"""

from __future__ import annotations

import math

import torch

from retrieval.distances import dot_similarity_matrix, label_masks, masked_logsumexp
from retrieval.losses import register_loss
from retrieval.losses.base import PER_CLASS_HINT, PairLoss, mean_over


class DotPairLoss(PairLoss):
    """Base of the N-pair family: dot-product similarities, a positive per anchor, optional L2 penalty."""

    cosine_similarity = False

    def __init__(self, l2_reg: float = 0.0) -> None:
        super().__init__()
        self.l2_reg = l2_reg

    def similarity(self, embeddings: torch.Tensor) -> torch.Tensor:
        return dot_similarity_matrix(embeddings)

    def check_batch(self, embeddings: torch.Tensor, labels: torch.Tensor) -> None:
        super().check_batch(embeddings, labels)
        positive, _ = label_masks(labels)
        lonely = int((~positive.any(dim=1)).sum())
        if lonely:
            raise ValueError(
                f"{type(self).__name__} needs a positive for every anchor (N-pair tuples), but {lonely} "
                f"sample(s) have no other sample of their class in the batch; {PER_CLASS_HINT}"
            )

    def norm_penalty(self, similarity: torch.Tensor) -> torch.Tensor:
        """l2_reg * mean squared norm of the embeddings, read off the diagonal of the dot-product matrix."""
        return self.l2_reg * torch.diagonal(similarity).mean()

    def tuple_losses(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The per-positive-pair loss [B, B] (only positive entries are used)."""
        raise NotImplementedError

    def from_similarity(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        positive, _ = self.pairs(labels)
        with torch.no_grad():  # raw features: the norm is worth watching
            self.last_stats = {"mean_norm": float(torch.diagonal(similarity).clamp_min(0).sqrt().mean())}
        return mean_over(self.tuple_losses(similarity, labels), positive) + self.norm_penalty(similarity)


def npair_losses(similarity: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """[i, j]: log(1 + sum_{k: l_k != l_i} exp(S_ik - S_ij)) (symm eq. 7), for every pair (i, j)."""
    logits = similarity.unsqueeze(1) - similarity.unsqueeze(2)  # [i, j, k] = S_ik - S_ij
    return masked_logsumexp(logits, negative.unsqueeze(1).expand_as(logits), dim=2, add_one=True)


def angular_losses(similarity: torch.Tensor, negative: torch.Tensor, alpha_degrees: float) -> torch.Tensor:
    """[i, j]: log(1 + sum_{k: l_k != l_i} exp(f^n_ijk - f^p_ij)) (symm eq. 9), with
    f^p_ij = 2 (1 + tan^2 alpha) S_ij and f^n_ijk = 4 tan^2 alpha (S_ik + S_jk)."""
    tan2 = math.tan(math.radians(alpha_degrees)) ** 2
    f_positive = 2.0 * (1.0 + tan2) * similarity  # [i, j]
    f_negative = 4.0 * tan2 * (similarity.unsqueeze(1) + similarity.unsqueeze(0))  # [i, j, k]
    logits = f_negative - f_positive.unsqueeze(2)
    # for a positive pair l_i == l_j, so "k negative to i" is also "k negative to j".
    return masked_logsumexp(logits, negative.unsqueeze(1).expand_as(logits), dim=2, add_one=True)


@register_loss("npair")
class NPairLoss(DotPairLoss):
    """Multi-class N-pair loss, symm eq. 7:
    1/|P| sum_{(i,j) in P} log[1 + sum_{k: l_k != l_i} exp(S_ik - S_ij)] + l2_reg * mean |x|^2.
    Default l2_reg = 0 (set e.g. 0.002 as in Sohn 2016 to bound the norms)."""

    def tuple_losses(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _, negative = self.pairs(labels)
        return npair_losses(similarity, negative)


def _check_angle(alpha: float) -> float:
    if not 0.0 < alpha < 90.0:
        raise ValueError(f"angular alpha is an angle in degrees in (0, 90), got {alpha}")
    return alpha


@register_loss("angular")
class AngularLoss(DotPairLoss):
    """Angular loss, symm eq. 9, alpha in degrees. Default alpha = 30 (the DCDL paper's value for L_Ang;
    the symm paper gives none)."""

    def __init__(self, alpha: float = 30.0, l2_reg: float = 0.0) -> None:
        super().__init__(l2_reg=l2_reg)
        self.alpha = _check_angle(alpha)

    def tuple_losses(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _, negative = self.pairs(labels)
        return angular_losses(similarity, negative, self.alpha)


@register_loss("angular_npair")
class AngularNPairLoss(DotPairLoss):
    """N-pair + lambda_ang * angular (dcdl eq. 4): lambda_ang = 2, alpha = 45 degrees (DCDL section 4);
    the L2 penalty is added once."""

    def __init__(self, alpha: float = 45.0, lambda_ang: float = 2.0, l2_reg: float = 0.0) -> None:
        super().__init__(l2_reg=l2_reg)
        self.alpha = _check_angle(alpha)
        self.lambda_ang = lambda_ang

    def tuple_losses(self, similarity: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        _, negative = self.pairs(labels)
        npair = npair_losses(similarity, negative)
        return npair + self.lambda_ang * angular_losses(similarity, negative, self.alpha)  # eq. 4
