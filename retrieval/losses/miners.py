"""Pair and triplet miners: boolean masks, no gradients, no Python loops.

Miners only select; the losses weight. Every miner works on a similarity (or distance) matrix and the
(positive, negative) label masks of ``retrieval.distances.label_masks``.
"""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def vthm(
    similarity: torch.Tensor,
    positive: torch.Tensor,
    negative: torch.Tensor,
    margin: float = 0.1,
    negative_similarity: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Valid-triplet hard mining (unified paper, section 5.1): masks of the kept positive and negative pairs.

    For anchor i with hardest positive p* = argmin_{P_i} s_ip and hardest negative n* = argmax_{N_i} s_in:
    a negative j is kept when s_ij > s_ip* - margin, a positive j when s_ij < s_in* + margin.
    An anchor without positives (or without negatives) has no valid triplet, so nothing of it is kept.
    ``negative_similarity`` (rows of anchors, columns the ``negative`` mask's) holds the negatives when they
    are not columns of ``similarity``, e.g. a hard-negative method's synthetic ones.
    """
    return (vthm_positives(similarity, positive, negative, margin, negative_similarity),
            vthm_negatives(similarity, positive, negative, margin, negative_similarity))


@torch.no_grad()
def vthm_positives(similarity: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, margin: float = 0.1,
                   negative_similarity: torch.Tensor | None = None) -> torch.Tensor:
    """``vthm``'s kept positives alone: s_ij < s_in* + margin."""
    if negative_similarity is None:
        negative_similarity = similarity
    # -inf where an anchor has no negative: then no comparison holds and nothing of it is kept
    hardest_negative = torch.where(negative, negative_similarity, -math.inf).amax(dim=1, keepdim=True)
    return positive & (similarity < hardest_negative + margin)


@torch.no_grad()
def vthm_negatives(similarity: torch.Tensor, positive: torch.Tensor, negative: torch.Tensor, margin: float = 0.1,
                   negative_similarity: torch.Tensor | None = None) -> torch.Tensor:
    """``vthm``'s kept negatives alone: s_ij > s_ip* - margin."""
    if negative_similarity is None:
        negative_similarity = similarity
    # +inf where an anchor has no positive: then no comparison holds and nothing of it is kept
    hardest_positive = torch.where(positive, similarity, math.inf).amin(dim=1, keepdim=True)
    return negative & (negative_similarity > hardest_positive - margin)
