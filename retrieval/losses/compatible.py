"""Backward-compatible training's influence term (Shen, Xiong, Xia & Soatto, "Towards Backward-Compatible
Representation Learning", CVPR 2020), read for pair losses.

BCT trains the new model on its loss plus an influence loss: the old model's classifier applied to the new
embeddings (their eq. 4), which keeps new embeddings where the old space put their class, so that new queries can
search a gallery the old model embedded. Our losses are not all classifiers, so the influence here is the pair
loss itself across the two models: the batch's new embeddings are the anchors (queries) and the frozen old model's
embeddings of the same images are the gallery, ``loss.query_gallery(new, y, old, y)``; image i's own old embedding
is one of its positives (it is not "itself": it is where the old model put it). The value reported and used is that
cross-model loss minus the same loss of the old embeddings against themselves (a constant of the step), so that the
term is zero when the new model equals the old one and measures how much worse new-against-old pairs are than the
old model's own; the gradient is the cross-model loss's, which pulls each new embedding toward its class's old
embeddings and away from the others'.
"""

from __future__ import annotations

import torch
from torch import nn

from retrieval.errors import ParameterError


class CompatibilityInfluence(nn.Module):
    """``weight`` x (L(new vs old) - L(old vs old)) with L a pair loss that has the query x gallery form."""

    def __init__(self, loss: nn.Module, weight: float = 1.0) -> None:
        super().__init__()
        if not getattr(loss, "rectangular", False) or not hasattr(loss, "query_gallery"):
            raise ParameterError("loss", f"{type(loss).__name__} has no query x gallery form; the influence term "
                                         "needs one (e.g. ms, contrastive, triplet)")
        if not float(weight) > 0:
            raise ParameterError("weight", f"must be > 0, got {weight}")
        self.loss, self.weight = loss, float(weight)

    def forward(self, new: torch.Tensor, labels: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """The weighted influence of one batch: ``new`` [B, d] (with gradient), ``old`` [B, d] the old model's
        embeddings of the same images (no gradient), ``labels`` [B]."""
        if old.shape != new.shape:
            raise ParameterError("old", f"must be the old model's embeddings of the same {tuple(new.shape)} batch, got "
                                        f"shape {tuple(old.shape)}")
        old = old.detach().to(new.dtype)
        cross = self.loss.query_gallery(new, labels, old, labels)
        with torch.no_grad():
            own = self.loss.query_gallery(old, labels, old, labels)
        return self.weight * (cross - own)
