"""``TextTower``: a sentence encoder and a linear projection into an image model's embedding space, L2-normalised
(LiT's text tower: Zhai et al., CVPR 2022, the image tower locked). What ``retrieval text train`` trains and
exports; ``text_onnx.TextEmbedder`` runs the export."""

from __future__ import annotations

import torch
from torch import nn

from retrieval.text.encoder import SentenceEncoder


class ClassBridge(nn.Module):
    """Sentence features [B, width] -> the image-space vectors of the classes whose names they are nearest [B, dim]:
    each class's cosine is its best text's (``text_features_t``: the class texts' unit features, transposed;
    ``class_index`` [C, M]: each class's texts, repeated to M), and the ``top`` classes' rows (``rows`` [C, dim],
    unit) are weighed by the softmax of their cosines over ``temperature`` (``top`` None: every class, a smooth map
    whose export agrees with PyTorch wherever two classes tie at the cut). A query in words no class text holds
    ("kitty", "veggies") finds the classes the sentence encoder puts near it, and their rows."""

    def __init__(self, text_features_t: torch.Tensor, class_index: torch.Tensor, rows: torch.Tensor,
                 temperature: float = 0.1, top: int | None = None) -> None:
        super().__init__()
        top = len(rows) if top is None else int(top)
        if not temperature > 0 or not 1 <= top <= len(rows) or class_index.shape[0] != len(rows):
            raise ValueError(f"a class bridge needs a temperature > 0, 1 <= top <= {len(rows)} classes and one row "
                             f"of text indices per class, got {temperature}, {top}, {tuple(class_index.shape)}")
        self.register_buffer("text_features_t", text_features_t.float())
        self.register_buffer("class_index", class_index.long())
        self.register_buffer("rows", rows.float())
        self.temperature, self.top = float(temperature), int(top)

    @classmethod
    def of_texts(cls, features: torch.Tensor, owner: torch.Tensor, rows: torch.Tensor, temperature: float = 0.1,
                 top: int | None = None) -> ClassBridge:
        """The bridge of class texts' sentence features [T, width] and each one's class (``owner`` [T]) onto the
        classes' unit ``rows`` [C, dim]; every class needs a text."""
        classes = len(rows)
        members = [torch.nonzero(owner == c).flatten() for c in range(classes)]
        if any(len(m) == 0 for m in members):
            raise ValueError("every class needs at least one text")
        width = max(len(m) for m in members)
        index = torch.stack([m[torch.arange(width) % len(m)] for m in members])  # repeats leave the max as it is
        unit = nn.functional.normalize(features.float(), dim=-1)
        return cls(unit.T.contiguous(), index, nn.functional.normalize(rows.float(), dim=-1), temperature, top)

    def forward(self, sentence: torch.Tensor) -> torch.Tensor:
        cosines = nn.functional.normalize(sentence, dim=-1) @ self.text_features_t  # [B, T]
        per_class = cosines[:, self.class_index].amax(dim=-1)  # [B, C]
        if self.top >= len(self.rows):
            return torch.softmax(per_class / self.temperature, dim=-1) @ self.rows
        best = per_class.topk(self.top, dim=-1)
        weights = torch.softmax(best.values / self.temperature, dim=-1)
        return (weights.unsqueeze(-1) * self.rows[best.indices]).sum(dim=1)


class TextTower(nn.Module):
    """Token ids and mask [B, L] -> L2-normalised embeddings [B, dim] in the image model's space: the projection's,
    or with a class ``bridge`` (a zero-shot tower's), the normalised sum of the projection's and the bridge's."""

    def __init__(self, encoder: SentenceEncoder, dim: int, bridge: ClassBridge | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.projection = nn.Linear(encoder.width, int(dim))
        self.bridge = bridge

    @property
    def dim(self) -> int:
        return self.projection.out_features

    def from_features(self, sentence: torch.Tensor) -> torch.Tensor:
        """The embeddings [B, dim] of sentence features [B, width] (the encoder's output)."""
        mapped = nn.functional.normalize(self.projection(sentence), dim=-1)
        if self.bridge is None:
            return mapped
        return nn.functional.normalize(mapped + nn.functional.normalize(self.bridge(sentence), dim=-1), dim=-1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.from_features(self.encoder(input_ids, attention_mask))

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
