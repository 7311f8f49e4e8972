"""NCA-form triplet losses of the sct paper: NCA triplet with HN / SHN mining (eq. 1) and SCT (eq. 13).

The sct paper trains with 2 samples per class (one positive per anchor). With more per class we form one
triplet per ordered positive pair (a, p), with the negative mined for that pair, and average over those
triplets; with 2 per class this is exactly the paper's batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from retrieval.losses.base import AnchorPairs, PairLoss, check_pair_rows, masked_max
from retrieval.utils.reads import Stat, share

NCA_MINING = ("hard", "semihard")
SCT_RULES = ("paper", "paper_or_threshold")


def nca_triplet_term(s_ap: torch.Tensor, s_an: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """-log(exp(S_ap) / (exp(S_ap) + exp(S_an))) = softplus(S_an - S_ap) (sct eq. 1), logits / temperature."""
    return F.softplus((s_an - s_ap) / temperature)


def mine_triplets(
    similarity: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, mining: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(S_ap [|P|], S_an of the mined negative [|P|], kept [|P|]), one entry per ordered positive pair (a, p).

    hard (HN): the most similar negative of the anchor. semihard (SHN): the most similar negative that is
    less similar than the positive (S_an < S_ap); a pair without one is dropped.
    """
    anchor, other = positive.nonzero(as_tuple=True)
    s_ap = similarity[anchor, other]
    if mining == "hard":  # the same negative for every positive of an anchor: mine once per anchor, O(B^2)
        s_an = masked_max(similarity, negative, dim=1)[anchor]
        return s_ap, s_an, negative.any(dim=1)[anchor]
    # semihard depends on S_ap: one [|P|, B] row of candidates per pair, never a [B, B, B] cube
    check_pair_rows(len(anchor), similarity.shape[1], "semi-hard NCA triplet")
    s_anchor = similarity[anchor]
    candidates = negative[anchor] & (s_anchor.detach() < s_ap.detach().unsqueeze(1))
    return s_ap, masked_max(s_anchor, candidates, dim=1), candidates.any(dim=1)


@torch.no_grad()
def _nca_stats(
    s_ap: torch.Tensor, hardest_s_an: torch.Tensor, has_negative: torch.Tensor, kept: torch.Tensor
) -> dict[str, Stat]:
    """Mined triplets and the fraction of positive pairs whose anchor's hardest negative (HN mining's
    ``mine_triplets`` output) is more similar than the positive (SCT Figure 6): the same measure whatever the
    mining, so HN, SHN and SCT compare."""
    hard = (hardest_s_an > s_ap) & has_negative
    return {
        "triplets": kept.sum(),
        "hard_fraction": share(hard.sum(), has_negative.sum()),
    }


class NCATripletLoss(PairLoss):
    """NCA triplet loss (sct eq. 1) on cosine similarities, averaged over the mined triplets.

    ``mining="hard"`` is the paper's HN, ``"semihard"`` its SHN. ``temperature`` divides the logits
    (1.0 = eq. 1; the authors' code uses 0.1).
    """

    paper_equation = "sct eq. 1"

    def __init__(self, mining: str = "hard", temperature: float = 1.0) -> None:
        super().__init__()
        if mining not in NCA_MINING:
            raise ValueError(f"nca_triplet mining must be one of {NCA_MINING}, got {mining!r}")
        self.mining = mining
        self.temperature = temperature

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        similarity, positive, negative = pairs.similarity, pairs.positive, pairs.negative
        s_ap, s_an, kept = mine_triplets(similarity, positive, negative, self.mining)
        losses = nca_triplet_term(s_ap, s_an, self.temperature)
        if self.mining == "hard":
            hardest, has_negative = s_an, kept
        else:
            with torch.no_grad():  # for the statistics only
                _, hardest, has_negative = mine_triplets(similarity, positive, negative, "hard")
        self.last_stats = _nca_stats(s_ap, hardest, has_negative, kept)
        return torch.where(kept, losses, torch.zeros_like(losses)).sum() / kept.sum().clamp_min(1)


class SelectivelyContrastiveTripletLoss(PairLoss):
    """Selectively Contrastive Triplet loss (sct eq. 13) with hard-negative mining:

    L_SC = lambda * S_an            if S_an > S_ap   (hard triplet: only push the negative away)
         = -log softmax(S_ap, S_an)  otherwise       (the NCA term, eq. 1)

    averaged over the triplets (one per ordered positive pair, the anchor's most similar negative).
    lambda defaults to 1.0 (the paper's CUB/CARS value; 0.1 for SOP, In-shop, Hotels-50K).

    Deviation (opt-in): ``hard_rule="paper_or_threshold"`` follows the authors' later code rather than
    eq. 13: a triplet is also treated as hard when S_an > ``threshold`` (0.8), and the NCA term uses
    ``temperature`` (0.1 in their code). ``temperature=None`` means 1.0 for ``"paper"`` (eq. 13 has no
    temperature) and 0.1 for ``"paper_or_threshold"``.
    """

    paper_equation = "sct eq. 13"

    def __init__(
        self,
        lam: float = 1.0,
        hard_rule: str = "paper",
        threshold: float = 0.8,
        temperature: float | None = None,
    ) -> None:
        super().__init__()
        if hard_rule not in SCT_RULES:
            raise ValueError(f"sct hard_rule must be one of {SCT_RULES}, got {hard_rule!r}")
        self.lam = lam
        self.hard_rule = hard_rule
        self.threshold = threshold
        if temperature is None:
            temperature = 1.0 if hard_rule == "paper" else 0.1
        self.temperature = temperature

    def from_pairs(self, pairs: AnchorPairs) -> torch.Tensor:
        similarity, positive, negative = pairs.similarity, pairs.positive, pairs.negative
        s_ap, s_an, kept = mine_triplets(similarity, positive, negative, "hard")
        with torch.no_grad():
            hard = s_an > s_ap
            if self.hard_rule == "paper_or_threshold":
                hard = hard | (s_an > self.threshold)
        losses = torch.where(hard, self.lam * s_an, nca_triplet_term(s_ap, s_an, self.temperature))  # eq. 13
        self.last_stats = _nca_stats(s_ap, s_an, kept, kept)  # HN mining: s_an is already the hardest
        self.last_stats["contrastive_fraction"] = share((hard & kept).sum(), kept.sum())
        return torch.where(kept, losses, torch.zeros_like(losses)).sum() / kept.sum().clamp_min(1)
