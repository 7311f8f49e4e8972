"""The weight view of a pair-based loss (unified paper, Theorem 3.1).

For a loss H(S, y) of the cosine-similarity matrix S, eq. 2-4 write its gradient as
sum_i (sum_{k in N_i} w_ik s_ik - sum_{j in P_i} w_ij s_ij): the weight of a pair is dH/ds with the sign
flipped on positive pairs, so that a loss that pulls positives together and pushes negatives apart gives
w >= 0. We differentiate with respect to S as an unconstrained [B, B] matrix (s_ij and s_ji are separate
variables), so W[i, j] is the weight that anchor i gives to pair (i, j), including the loss's
normalisation (e.g. the 1/m of a mean over anchors). The diagonal is not a pair and is set to 0.
"""

from __future__ import annotations

import torch
from torch import nn

from retrieval.distances import cosine_similarity_matrix, label_masks


def pair_weights(
    loss: nn.Module, embeddings: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, W): the cosine similarity matrix and W[i, j] = (1 - 2 I_ij) dL/dS_ij (eq. 4 without the 1/2,
    since S is not symmetrised here), both detached [B, B] tensors."""
    from_similarity = getattr(loss, "from_similarity", None)
    if from_similarity is None:
        raise TypeError(
            f"{type(loss).__name__} is not a pair-based loss (no from_similarity(S, labels)); "
            "pair_weights needs a loss written as a function of the similarity matrix"
        )
    if not getattr(loss, "cosine_similarity", False):
        raise TypeError(
            f"{type(loss).__name__} works on raw dot products, not cosine similarities, so it is not "
            "pair-based in the unified paper's sense (its value depends on the embedding norms); "
            "pair_weights cannot apply"
        )
    loss.check_batch(embeddings, labels)
    similarity = cosine_similarity_matrix(embeddings.detach()).clone().requires_grad_(True)
    value = from_similarity(similarity, labels)
    (gradient,) = torch.autograd.grad(value, similarity, allow_unused=True)
    if gradient is None:
        gradient = torch.zeros_like(similarity)
    positive, _ = label_masks(labels)
    weights = torch.where(positive, -gradient, gradient)
    weights = weights - torch.diag_embed(torch.diagonal(weights))
    return similarity.detach(), weights.detach()
