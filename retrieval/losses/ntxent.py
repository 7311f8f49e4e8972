"""NT-Xent, SimCLR's contrastive loss (Chen, Kornblith, Norouzi & Hinton, "A Simple Framework for Contrastive
Learning of Visual Representations", ICML 2020, eq. 1), for any labelled batch.

SimCLR's batch holds two augmented views of each of N images, and eq. 1 is, for a positive pair (i, j),

    l(i, j) = -log( exp(s_ij / tau) / sum_{k != i} exp(s_ik / tau) ),    s = cosine similarity,

averaged over all 2N positive pairs, both (i, j) and (j, i). A label says which rows are views of one image (the
image's id); every other row is a negative. With any labels, as SupCon's L_out (Khosla et al., "Supervised
Contrastive Learning", NeurIPS 2020, eq. 2): every other row j with i's label is a positive of anchor i and gives
one term l(i, j) with the same denominator (all k != i, positives included), and the loss is the mean over all
(anchor, positive) terms, each weighing the same as eq. 1's pairs do (SupCon weighs anchor i's terms 1/|P(i)|: the
two agree when every label has the same number of rows). With exactly two views per image each anchor has one
positive, and this is eq. 1 exactly. An anchor without a positive adds no term (it is still a negative of the
others); a batch without any positive is 0, which the square call refuses as every pair loss does (nothing to learn).

The rectangular form (``query_gallery``) reads each anchor's own row only: k runs over every gallery row except the
query itself (``self_index``), so with a cross-batch memory the memory's rows are further negatives (and positives).
"""

from __future__ import annotations

import math

import torch

from retrieval.distances import masked_logsumexp
from retrieval.losses.base import AnchorPairs, PairLoss, masked_max
from retrieval.utils.reads import share

DEFAULT_TEMPERATURE = 0.1


class NTXentLoss(PairLoss):
    """NT-Xent (SimCLR eq. 1), the mean over (anchor, positive) terms: -log softmax_{k != i}(s_ik / tau) at k = j."""

    paper_equation = ("SimCLR eq. 1 (Chen et al., ICML 2020); more than one positive per anchor: SupCon's L_out, "
                      "eq. 2 (Khosla et al., NeurIPS 2020)")
    readings = {
        "temperature": "tau in exp(s / tau), > 0; default 0.1. SimCLR finds the best tau depends on the batch size "
                       "and training length: 0.1 is the value of its large-batch ImageNet setting (batch 4096), "
                       "0.5 the one commonly used for its CIFAR-10 runs (recalled from the paper and its reference "
                       "code, not checked here against the paper's tables)",
        "labels": "the rows that share a label are the views of one image; with exactly 2 per label this is "
                  "eq. 1, with more each other view is a positive (SupCon L_out), each giving one term",
    }

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE) -> None:
        super().__init__()
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
                math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"ntxent temperature must be a finite number > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        """Eq. 1 over every (anchor i, positive j) of the rows, averaged over those terms (0 when there is none)."""
        logits = pairs.similarity / self.temperature  # s_ik / tau
        others = pairs.positive | pairs.negative  # k != i: every gallery row but the anchor itself
        log_denominator = masked_logsumexp(logits, others, dim=1, keepdim=True)  # eq. 1: log sum_{k != i} exp
        terms = log_denominator - logits  # eq. 1: l(i, k) for every k; kept where k is a positive j
        kept = torch.where(pairs.positive, terms, torch.zeros_like(terms))  # where, not *: no 0 * inf
        count = pairs.positive.sum()
        with torch.no_grad():  # the share of anchors whose nearest other row is a positive
            has_positive = pairs.positive.any(dim=1)
            top1 = masked_max(pairs.similarity, pairs.positive, dim=1) >= masked_max(pairs.similarity, others, dim=1)
            self.last_stats = {
                "positive_pairs": count,
                "positive_top1": share((top1 & has_positive).sum(), has_positive.sum()),
            }
        return kept.sum() / count.clamp_min(1).to(kept.dtype)
