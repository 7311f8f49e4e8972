"""LiT's contrastive loss: the symmetric InfoNCE of CLIP (Radford et al., 2021) with a learned temperature, the image
embeddings fixed (Zhai et al., CVPR 2022, "LiT: Zero-Shot Transfer with Locked-image text Tuning").

For a batch of n (text, image) pairs with L2-normalised embeddings t_i and v_j, logits s_ij = exp(tau) t_i . v_j and

    L = 1/2n * sum_i [ -log softmax_j(s_ij)[i] - log softmax_j(s_ji)[i] ]

(text-to-image and image-to-text cross-entropies, each pair its row's and column's positive). tau is learned, its
exp clipped at 100 as CLIP does. Two captions of one image in a batch are each other's false negatives: the batches
hold one caption per image (``train/text_tower.py``)."""

from __future__ import annotations

import math

import torch
from torch import nn

MAX_SCALE = 100.0


class LiTLoss(nn.Module):
    """Symmetric InfoNCE over a batch's text [n, d] and image [n, d] embeddings, pair i the i-th of each."""

    def __init__(self, initial_scale: float = 10.0) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(math.log(initial_scale)))

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=MAX_SCALE)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        if text.shape != image.shape or text.ndim != 2:
            raise ValueError(f"text {tuple(text.shape)} and image {tuple(image.shape)} embeddings must be [n, d] alike")
        if len(text) < 2:  # no negative: nothing to contrast (finite, no gradient to the towers)
            return (text.sum() + image.sum() + self.log_scale) * 0.0
        logits = self.scale * text @ image.T
        labels = torch.arange(len(text), device=text.device)
        return 0.5 * (nn.functional.cross_entropy(logits, labels) + nn.functional.cross_entropy(logits.T, labels))
