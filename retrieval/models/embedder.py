"""The embedder: backbone features -> linear head -> optional L2 normalisation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.distances import l2_normalize
from retrieval.errors import ParameterError, parameters_named
from retrieval.models.backbones import create_backbone
from retrieval.models.checkpoint import load_checkpoint


class EmbeddingHead(nn.Module):
    """Linear projection of pooled features to ``embedding_dim``, L2-normalised unless told otherwise.

    Some losses (N-pair, and the Symm variant of it) need unnormalised features: ``normalize=False``.
    """

    def __init__(self, feature_dim: int, embedding_dim: int, normalize: bool = True) -> None:
        super().__init__()
        self.linear = nn.Linear(feature_dim, embedding_dim)
        self.normalize = normalize
        nn.init.kaiming_normal_(self.linear.weight, mode="fan_out")
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        out = self.linear(features)
        return l2_normalize(out) if self.normalize else out


class Embedder(nn.Module):
    """``Embedder(x) = head(backbone(x))``; ``config`` is everything needed to rebuild it (JSON-able)."""

    def __init__(self, backbone: nn.Module, head: EmbeddingHead, config: dict[str, Any]) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.config = config

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))

    def train(self, mode: bool = True) -> Embedder:
        super().train(mode)
        if self.config.get("freeze_bn"):
            # Frozen BatchNorm: running statistics and affine parameters stay as pretrained, which is what
            # small P x N metric-learning batches need.
            for module in self.backbone.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self


def create_embedder(
    backbone: str,
    embedding_dim: int = 512,
    pretrained: bool = False,
    normalize: bool = True,
    freeze_bn: bool = False,
    weights: str | os.PathLike | None = None,
    offline: bool = False,
) -> Embedder:
    """Build an embedder from a registered backbone name (or ``timm:<name>``).

    ``weights`` loads a local state dict into the backbone (a classifier's keys that do not belong to the
    backbone are ignored, missing backbone keys are an error). ``offline`` takes pretrained weights from local
    caches only (``retrieval.models.weights``; the environment's RETRIEVAL_OFFLINE / HF_HUB_OFFLINE do the same).
    """
    if embedding_dim < 1:
        raise ValueError(f"embedding_dim must be >= 1, got {embedding_dim}")
    spec = create_backbone(backbone, pretrained=pretrained and weights is None, offline=offline)
    if weights is not None:
        with parameters_named(path="weights"):
            load_backbone_weights(spec.module, weights)
    for module in spec.module.modules():
        if freeze_bn and isinstance(module, nn.modules.batchnorm._BatchNorm):
            for p in module.parameters():
                p.requires_grad_(False)
    head = EmbeddingHead(spec.feature_dim, embedding_dim, normalize)
    config = {
        "backbone": backbone,
        "embedding_dim": int(embedding_dim),
        "normalize": bool(normalize),
        "freeze_bn": bool(freeze_bn),
        "feature_dim": int(spec.feature_dim),
        "input_size": int(spec.input_size),
        "mean": [float(v) for v in spec.mean],
        "std": [float(v) for v in spec.std],
        "background": list(DEFAULT_BACKGROUND),  # transparent pixels are composited onto this colour
        "pretrained": bool(pretrained or weights is not None),
    }
    return Embedder(spec.module, head, config)


def load_backbone_weights(module: nn.Module, path: str | os.PathLike) -> None:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"`weights` file not found: {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    own = module.state_dict()
    # Accept files saved from the bare model (keys without our wrapper's prefixes) or from this module.
    remapped = {}
    for key, value in state.items():
        for candidate in (key, f"net.{key}", key.removeprefix("backbone.")):
            if candidate in own:
                remapped[candidate] = value
                break
    missing = [k for k in own if k not in remapped]
    if missing:
        raise ParameterError(
            "path", f"{path} does not fit this backbone: {len(missing)} parameters missing "
            f"(first: {missing[:3]}); was it saved from a different architecture?"
        )
    module.load_state_dict(remapped)


def load_embedder(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Embedder:
    """Rebuild an embedder from a checkpoint, without touching any pretrained-weights source."""
    ckpt = load_checkpoint(path, map_location)
    cfg = ckpt.model_config
    model = create_embedder(
        cfg["backbone"], cfg["embedding_dim"], pretrained=False, normalize=cfg["normalize"],
        freeze_bn=cfg["freeze_bn"],
    )
    model.config.update(cfg)  # input size, normalisation and provenance as trained
    model.load_state_dict(ckpt.state_dict)
    return model.eval()
