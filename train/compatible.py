"""``--compatible-with OLD``: the frozen old model a new one is trained to stay comparable with (BCT), and the
model hashes the new model then declares itself compatible with (``retrieval export`` writes them into the ONNX
metadata, where ``retrieval index upgrade``, search and serve read them).

OLD is a checkpoint of ours or an exported ONNX file. It embeds each training batch as the new model sees it: the
batch's pixels, taken back from the new model's normalisation and resized to the old model's input size and
normalisation where they differ. With ``--freeze-backbone`` the new model trains on cached backbone features, so
OLD must be a checkpoint of the same frozen pretrained backbone: its head then embeds those features.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.errors import ParameterError
from retrieval.losses.compatible import CompatibilityInfluence

INFLUENCE_FALLBACK = "ms"  # the influence's pair loss when the training loss has no query x gallery form


class OldModel(nn.Module):
    """Embeds a batch with the frozen old model: ``forward(inputs)`` -> float32 [B, d_old], no gradient."""

    def __init__(self, path: str | Path, new: ModelPreprocessing, features: bool = False,
                 device: torch.device | str = "cpu") -> None:
        """``new``: the new model's preprocessing, which the batches are normalised with."""
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"the old model {self.path} does not exist (a checkpoint .pt or an .onnx file)")
        self.new, self.features = new, features
        self.onnx = None
        if self.path.suffix == ".onnx":
            if features:
                raise ParameterError("path", "an ONNX model embeds images, but with a frozen backbone the batches "
                                             "are cached features: give the old run's checkpoint instead")
            from retrieval.onnx_runtime import OnnxEmbedder

            self.onnx = OnnxEmbedder(self.path, providers="cpu")
            self.preprocessing = self.onnx.preprocessing
            self.hashes = sorted({self.onnx.model_hash, self.onnx.source_model_hash})
            return
        from retrieval.models.embedder import load_embedder
        from retrieval.onnx_runtime import embedder_model_hash

        self.model = load_embedder(self.path).to(device).eval()
        for parameter in self.model.parameters():
            parameter.requires_grad_(False)
        self.preprocessing = self.model.preprocessing
        self.hashes = [embedder_model_hash(self.model)]
        if features and self.preprocessing.backbone != new.backbone:
            raise ParameterError("path", f"was trained on backbone {self.preprocessing.backbone}, this run's frozen "
                                         f"backbone is {new.backbone}: with --freeze-backbone the "
                                         "old model's head must read the same cached features")

    @property
    def eval_model(self) -> nn.Module:
        """What embeds the evaluation split as the old model did: its Embedder on cached features (the feature
        source runs its head), else this module (the pixels adapted to the old model)."""
        return self.model if self.features else self

    @property
    def embedding_dim(self) -> int:
        return int(self.preprocessing.embedding_dim)  # type: ignore[arg-type]  (a model's files record it)

    def train(self, mode: bool = True) -> OldModel:
        return super().train(False)  # frozen: BatchNorm and dropout stay in eval mode

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.features:
            return self.model.head(inputs).float()
        pixels = self._as_old_input(inputs.float())
        if self.onnx is not None:
            return torch.from_numpy(np.asarray(self.onnx.embed_batch(pixels.cpu().numpy()))).to(inputs.device).float()
        return self.model(pixels).float()

    def _as_old_input(self, inputs: torch.Tensor) -> torch.Tensor:
        """The new model's normalised batch as the old model's input (size and normalisation)."""
        new, old = self.new, self.preprocessing
        if (new.mean, new.std, new.input_size) == (old.mean, old.std, old.input_size):
            return inputs
        shape = (1, 3, 1, 1)
        pixels = inputs * torch.tensor(new.std, device=inputs.device).view(shape) + \
            torch.tensor(new.mean, device=inputs.device).view(shape)
        size = old.input_size
        if pixels.shape[-1] != size:
            pixels = functional.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)
        return (pixels - torch.tensor(old.mean, device=inputs.device).view(shape)) / \
            torch.tensor(old.std, device=inputs.device).view(shape)


def build_influence(loss_name: str, loss_kwargs: Mapping[str, Any], weight: float, device: torch.device | str
                    ) -> tuple[CompatibilityInfluence, str]:
    """The influence term on the training loss where it has the query x gallery form, else on ``ms``; with the
    name of the loss it uses."""
    from retrieval import losses

    loss = losses.build(loss_name, **dict(loss_kwargs)) if not losses.needs_classes(loss_name) else None
    name = loss_name
    if loss is None or not getattr(loss, "rectangular", False):
        loss, name = losses.build(INFLUENCE_FALLBACK), INFLUENCE_FALLBACK
    return CompatibilityInfluence(loss, weight).to(device), name
