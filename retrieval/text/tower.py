"""``TextTower``: a sentence encoder and a linear projection into an image model's embedding space, L2-normalised
(LiT's text tower: Zhai et al., CVPR 2022, the image tower locked). What ``retrieval text train`` trains and
exports; ``text_onnx.TextEmbedder`` runs the export."""

from __future__ import annotations

import torch
from torch import nn

from retrieval.text.encoder import SentenceEncoder


class TextTower(nn.Module):
    """Token ids and mask [B, L] -> L2-normalised embeddings [B, dim] in the image model's space."""

    def __init__(self, encoder: SentenceEncoder, dim: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.projection = nn.Linear(encoder.width, int(dim))

    @property
    def dim(self) -> int:
        return self.projection.out_features

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.projection(self.encoder(input_ids, attention_mask)), dim=-1)

    @torch.no_grad()
    def fit_projection(self, sentences: torch.Tensor, targets: torch.Tensor, ridge: float = 1e-2) -> None:
        """Start the projection at the ridge regression of ``targets`` [n, dim] on sentence features [n, width]
        (the closed-form linear map, the baseline LiT's training then improves on). Any number of rows, repeated
        ones too: the ridge term keeps the system positive definite (no rows: the zero map)."""
        if not ridge > 0:
            raise ValueError(f"ridge must be positive, got {ridge}")
        x = torch.cat([sentences.double(), torch.ones(len(sentences), 1, dtype=torch.float64)], dim=1)
        gram = x.T @ x + ridge * max(len(x), 1) * torch.eye(x.shape[1], dtype=torch.float64)
        weights = torch.linalg.solve(gram, x.T @ targets.double())  # [width + 1, dim]
        self.projection.weight.copy_(weights[:-1].T.float())
        self.projection.bias.copy_(weights[-1].float())
