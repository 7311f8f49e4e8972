"""Auxiliary cross-entropy head (``retrieval train --aux-ce WEIGHT``).

The DCDL paper (section 1, contribution 3; Table 7 with MIC) combines metric losses with a "partially
global" cross-entropy on the training classes. This module is that head: a linear classifier on the
embeddings, trained jointly with the metric loss and thrown away after training (it is not part of the
Embedder, so it never reaches a checkpoint's model or the ONNX export). The trainer adds its parameters
to the optimiser.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from retrieval.distances import l2_normalize, zero_loss
from retrieval.errors import ParameterError
from retrieval.utils.reads import Stat, require_classes


class AuxiliaryCrossEntropy(nn.Module):
    """aux(embeddings [B, D], labels [B]) -> weight * CE(logits, labels).

    ``normalized=False``: logits = (W z + b) / temperature, a plain linear classifier (temperature 1).
    ``normalized=True``: logits = cos(z, w_c) / temperature, a cosine classifier with unit-norm class
    weights and embeddings (the scale of normalised-softmax heads; temperature 0.05 by default, since
    cosines in [-1, 1] give too flat a softmax otherwise).
    """

    def __init__(
        self,
        embedding_dim: int,
        num_classes: int,
        weight: float = 1.0,
        normalized: bool = False,
        temperature: float | None = None,
    ) -> None:
        super().__init__()
        if embedding_dim < 1 or num_classes < 2:
            raise ValueError(
                f"the auxiliary classifier needs embedding_dim >= 1 and num_classes >= 2, "
                f"got {embedding_dim} and {num_classes}"
            )
        if weight < 0:
            raise ParameterError("weight", f"must be >= 0, got {weight}")
        temperature = (0.05 if normalized else 1.0) if temperature is None else float(temperature)
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes
        self.weight = float(weight)
        self.normalized = normalized
        self.temperature = temperature
        self.classifier = nn.Linear(embedding_dim, num_classes, bias=not normalized)
        self.last_stats: dict[str, Stat] = {}

    def logits(self, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 2 or embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"expected embeddings [B, {self.embedding_dim}], got {tuple(embeddings.shape)}; build the "
                "head with the model's embedding_dim"
            )
        if self.normalized:
            return l2_normalize(embeddings) @ l2_normalize(self.classifier.weight).T / self.temperature
        return self.classifier(embeddings) / self.temperature

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.logits(embeddings)
        if labels.shape != embeddings.shape[:1]:
            raise ValueError(f"labels must be [B] = [{embeddings.shape[0]}], got {tuple(labels.shape)}")
        labels = require_classes(labels, self.num_classes, "head")
        if labels.numel() == 0:  # an empty batch has nothing to classify (cross_entropy would give NaN)
            return zero_loss(logits)
        ce = F.cross_entropy(logits, labels)
        with torch.no_grad():
            accuracy = (logits.argmax(1) == labels).float().mean()
        self.last_stats = {"aux_ce": ce.detach(), "aux_accuracy": accuracy}
        return self.weight * ce

    def extra_repr(self) -> str:
        return (
            f"embedding_dim={self.embedding_dim}, num_classes={self.num_classes}, weight={self.weight}, "
            f"normalized={self.normalized}, temperature={self.temperature}"
        )
