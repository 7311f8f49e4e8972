"""Soft pair-weighting losses of the unified paper: binomial deviance, RAW, RAW + VTHM (multi-similarity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrieval.distances import masked_logsumexp
from retrieval.losses.base import AnchorPairs, PairLoss
from retrieval.losses.miners import vthm, vthm_negatives, vthm_positives
from retrieval.negatives.base import PairTerms
from retrieval.utils.reads import share

PAIR_MINERS = (None, "none", "vthm")


class MinedPairLoss(PairLoss):
    """A weighted pair loss (alpha, beta, gamma of unified eq. 12/17) whose P_i, N_i are optionally the
    VTHM-mined pairs (unified Table 1)."""

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        miner: str | None = None,
        vthm_margin: float = 0.1,
    ) -> None:
        super().__init__()
        if miner not in PAIR_MINERS:
            raise ValueError(f"miner must be one of {PAIR_MINERS}, got {miner!r}")
        self.alpha, self.beta, self.gamma = alpha, beta, gamma
        self.miner = None if miner == "none" else miner
        self.vthm_margin = vthm_margin

    def mined_pairs(self, pairs: AnchorPairs) -> tuple[torch.Tensor, torch.Tensor]:
        """(P_i, N_i) masks: every pair, or the VTHM-mined ones (each anchor mines its own row)."""
        positive, negative = pairs.positive, pairs.negative
        if self.miner == "vthm":
            kept_positive, kept_negative = vthm(pairs.similarity.detach(), positive, negative, self.vthm_margin)
        else:
            kept_positive, kept_negative = positive, negative
        self.last_stats = {
            "positive_pairs_kept": share(kept_positive.sum(), positive.sum()),
            "negative_pairs_kept": share(kept_negative.sum(), negative.sum()),
        }
        return kept_positive, kept_negative


class BinomialDevianceLoss(MinedPairLoss):
    """Binomial deviance, unified eq. 12, averaged over the m anchors (the paper sums; 1/m keeps the scale
    independent of the batch size):

    (1/m) sum_i { 1/|P_i| sum_{P_i} log(1 + exp(alpha (gamma - s_ik)))
                + 1/|N_i| sum_{N_i} log(1 + exp(beta (s_ik - gamma))) }.

    Defaults alpha=2, beta=50, gamma=0.5 (section 6). ``miner="vthm"`` replaces P_i, N_i by the mined sets
    (Table 1, "Binomial+VTHM"); an empty set contributes 0.
    """

    paper_equation = "unified eq. 12"

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        similarity = pairs.similarity
        positive, negative = self.mined_pairs(pairs)
        positive_terms = F.softplus(self.alpha * (self.gamma - similarity))
        negative_terms = F.softplus(self.beta * (similarity - self.gamma))
        per_anchor = _row_mean(positive_terms, positive) + _row_mean(negative_terms, negative)
        return per_anchor.mean()


class VTHMLoss(MinedPairLoss):
    """"VTHM" of the unified paper's ablation (Table 1): equal weights on the VTHM-mined pairs, the contrastive
    loss of eq. 5 with the mined sets in place of its threshold,

    (1/m) sum_i { sum_{N~_i} s_ik - sum_{P~_i} s_ik },

    so every selected pair gets the weight 1/m (eq. 6 without the threshold). ``margin`` is VTHM's lambda.
    """

    paper_equation = 'unified Table 1, "VTHM" (equal weights on VTHM-mined pairs)'

    def __init__(self, margin: float = 0.1) -> None:
        super().__init__(miner="vthm", vthm_margin=margin)

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        similarity = pairs.similarity
        positive, negative = self.mined_pairs(pairs)
        zeros = torch.zeros_like(similarity)
        per_pair = torch.where(negative, similarity, zeros) - torch.where(positive, similarity, zeros)
        return per_pair.sum() / similarity.shape[0]


def _row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of each row over its mask; 0 for an empty row."""
    mask_f = mask.to(values.dtype)
    return (torch.where(mask, values, torch.zeros_like(values))).sum(dim=1) / mask_f.sum(dim=1).clamp_min(1.0)


class RAWLoss(MinedPairLoss):
    """Relative and absolute similarity weighting, unified eq. 17:

    (1/m) sum_i { 1/alpha log[1 + sum_{P~_i} exp(-alpha (s_ik - gamma))]
                + 1/beta  log[1 + sum_{N~_i} exp( beta (s_ik - gamma))] }.

    ``raw`` uses all pairs by default (Table 1, "RAW"); ``miner="vthm"`` gives RAW + VTHM (= ``ms``).

    With hard negatives (LoOp), ``positive_rule`` says what VTHM's positive rule s_ij < max s_in + eps compares
    with: "batch", the batch's negatives (LoOp section 3.3.4: the rule for hard positives "remains unchanged"),
    or "loop", the largest LoOp negative similarity of the anchor's pair.
    """

    paper_equation = "unified eq. 17; + LoOp: loop section 3.3.4"

    positive_rule = "batch"

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        positive, negative = self.mined_pairs(pairs)
        return self._raw(pairs.similarity, positive, pairs.similarity, negative)

    def from_pair_terms(self, terms: PairTerms) -> torch.Tensor:
        """Eq. 17 with hard negatives (LoOp section 3.3.4): anchor i of pair (i, j) has the batch positives
        s_ik and, as negatives, the hardest negative similarities of its pair against every pair of another
        class; VTHM (when mined) keeps them by the same rule as in the batch."""
        pairs = terms.pairs
        anchors = torch.cat([pairs.first, pairs.second])  # A = 2 Pp: the pairs' first points, then their second
        similarity = terms.gram[anchors]  # [A, B]
        same_class, other_class = terms.class_masks()
        positive = same_class[anchors]
        # [A, Q]: each pair's row for both its anchors (a repeat's backward sums the two; an index's scatters)
        negative_similarity = terms.negative_similarity().repeat(2, 1)
        negative = terms.negative.repeat(2, 1)
        if self.miner == "vthm":
            # each side mined once: the positive rule against the batch's own negatives (the unchanged rule) or
            # against LoOp's
            rule_negative, rule_similarity = ((other_class[anchors], None) if self.positive_rule == "batch"
                                              else (negative, negative_similarity))
            kept_positive = vthm_positives(similarity, positive, rule_negative, self.vthm_margin, rule_similarity)
            negative = vthm_negatives(similarity, positive, negative, self.vthm_margin, negative_similarity)
            positive = kept_positive
        return self._raw(similarity, positive, negative_similarity, negative)

    def _raw(
        self,
        similarity: torch.Tensor,
        positive: torch.Tensor,
        negative_similarity: torch.Tensor,
        negative: torch.Tensor,
    ) -> torch.Tensor:
        """Eq. 17, averaged over the anchors (rows): positives from ``similarity``, negatives from
        ``negative_similarity`` (the same matrix for batch negatives)."""
        positive_part = masked_logsumexp(-self.alpha * (similarity - self.gamma), positive, add_one=True)
        negative_part = masked_logsumexp(self.beta * (negative_similarity - self.gamma), negative, add_one=True)
        return (positive_part / self.alpha + negative_part / self.beta).mean()  # eq. 17


POSITIVE_RULES = ("batch", "loop")  # with LoOp: VTHM's positive rule against batch or LoOp negatives


class MultiSimilarityLoss(RAWLoss):
    """Multi-similarity loss = RAW (eq. 17) over the VTHM-mined pairs (section 5.1), the unified paper's full
    method: alpha=2, beta=50, gamma=0.5 (lambda in the MS paper), VTHM margin 0.1 (epsilon in the MS paper).

    Follows eq. 17 literally. The MS authors' code skips an anchor whose mined positive or negative set is
    empty; with VTHM both sets are empty together (a kept negative n means s_in > s_ip* - margin, so the
    hardest positive p* is kept, and vice versa), so the two agree.
    """

    paper_equation = "unified eq. 17 + VTHM (section 5.1) = MS; + LoOp: loop section 3.3.4"
    readings = {
        "positive_rule": (
            "with LoOp and VTHM, what the positive rule s_ij < max s_in + eps compares with: 'batch' = "
            "the batch's negatives (loop 3.3.4: the rule 'remains unchanged', default) or 'loop' = the "
            "largest LoOp negative similarity"
        ),
    }

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        margin: float = 0.1,
        miner: str | None = "vthm",
        positive_rule: str = "batch",
    ) -> None:
        super().__init__(alpha=alpha, beta=beta, gamma=gamma, miner=miner, vthm_margin=margin)
        if positive_rule not in POSITIVE_RULES:
            raise ValueError(f"positive_rule must be 'batch' (LoOp 3.3.4: the rule is unchanged, batch negatives) or "
                             f"'loop' (against the largest LoOp negative similarity), got {positive_rule!r}")
        self.positive_rule = positive_rule
