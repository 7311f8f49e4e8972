"""A base loss fed by a hard-negative method: what ``build(name, negatives=method)`` returns."""

from __future__ import annotations

import torch
from torch import nn

from retrieval.distances import zero_loss
from retrieval.losses.base import PairLoss
from retrieval.negatives.base import HardNegativeMethod
from retrieval.utils.reads import Stat


class HardNegativeLoss(nn.Module):
    """``loss.from_pair_terms(method.pair_terms(embeddings, labels))``; ``last_stats`` are the method's
    (``synthetic_negative_share``: the share of synthetic points among the hardest negatives used)."""

    def __init__(self, loss: PairLoss, method: HardNegativeMethod) -> None:
        super().__init__()
        self.loss = loss
        self.method = method
        self.last_stats: dict[str, Stat] = {}

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        terms = self.method.pair_terms(embeddings, labels, self.loss.cosine_similarity, self.loss.positive_rows,
                                       self.loss.negative_pairs)
        self.last_stats = terms.stats
        if terms.hardest is None:  # one class only: nothing to push apart
            return zero_loss(embeddings)
        return self.loss.from_pair_terms(terms)
