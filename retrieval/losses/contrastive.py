"""Contrastive loss: the cosine form of the unified paper (eq. 5) and the distance form with two margins."""

from __future__ import annotations

import torch

from retrieval.losses.base import AnchorPairs, DistancePairLoss
from retrieval.utils.reads import share

CONTRASTIVE_FORMS = ("cosine", "distance")


class ContrastiveLoss(DistancePairLoss):
    """Contrastive loss, summed over the pairs of each anchor and averaged over the m anchors.

    ``form="cosine"`` (unified eq. 5): l_ij = (1 - I_ij) [s_ij - lambda]_+ - I_ij s_ij with ``threshold``
    lambda (default 0.5; the paper gives no value). Its weights (eq. 6) are 1/m on every positive pair and
    on the negative pairs with s_ij > lambda.

    ``form="distance"`` (Hadsell et al., with separate margins as in pytorch-metric-learning):
    l_ij = I_ij [d_ij - pos_margin]_+ + (1 - I_ij) [neg_margin - d_ij]_+ on Euclidean distances of the
    L2-normalised embeddings (d^2 = 2 - 2 s), ``squared=True`` for squared distances.
    """

    paper_equation = "unified eq. 5 (form=cosine); Hadsell et al. 2006 (form=distance)"

    def __init__(
        self,
        form: str = "cosine",
        threshold: float = 0.5,
        pos_margin: float = 0.0,
        neg_margin: float = 1.0,
        squared: bool = False,
    ) -> None:
        super().__init__(squared=squared)
        if form not in CONTRASTIVE_FORMS:
            raise ValueError(f"contrastive form must be one of {CONTRASTIVE_FORMS}, got {form!r}")
        self.form = form
        self.threshold = threshold
        self.pos_margin = pos_margin
        self.neg_margin = neg_margin

    def pair_losses(self, similarity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss if the pair is positive, loss if it is negative), both shaped like ``similarity``."""
        if self.form == "cosine":
            return -similarity, torch.relu(similarity - self.threshold)  # eq. 5
        distance = self.distance(similarity)
        return torch.relu(distance - self.pos_margin), torch.relu(self.neg_margin - distance)

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        """Eq. 5 summed over each anchor's gallery pairs, averaged over the anchors."""
        similarity, positive, negative = pairs.similarity, pairs.positive, pairs.negative
        positive_loss, negative_loss = self.pair_losses(similarity)
        zeros = torch.zeros_like(similarity)
        per_pair = torch.where(positive, positive_loss, zeros) + torch.where(negative, negative_loss, zeros)
        with torch.no_grad():
            active_negative = (negative & (negative_loss > 0)).sum()
            self.last_stats = {
                "active_negative_fraction": share(active_negative, negative.sum()),
            }
        return per_pair.sum() / similarity.shape[0]
