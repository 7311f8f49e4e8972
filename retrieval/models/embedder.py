"""The embedder: backbone features -> linear head -> optional L2 normalisation; and, for a model trained
compatible with an old one of another embedding size, a projection of its embedding into the old space."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from retrieval.data.preprocessing import DEFAULT_BACKGROUND, ModelPreprocessing
from retrieval.data.resize_modes import CROP, RESIZE_MODES
from retrieval.distances import l2_normalize
from retrieval.errors import ParameterError, parameters_named
from retrieval.models.backbones import BACKBONES, backbone_names, create_backbone
from retrieval.models.checkpoint import load_checkpoint
from retrieval.records.model_config import ModelConfig


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

    @torch.no_grad()
    def start_at_principal_axes(self, features: np.ndarray, seed: int = 0) -> None:
        """Start as the centred projection onto the top principal axes of ``features`` [N, F] (the backbone's
        features of the images to adapt to): of the linear maps to this size, the one that keeps most of their
        geometry, so training without labels starts near the pretrained neighbours instead of a random map's.
        Axes beyond the features' rank are completed with orthonormal ones drawn from ``seed``."""
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.linear.in_features or not np.isfinite(x).all():
            raise ValueError(f"features must be finite [N, {self.linear.in_features}], got shape {x.shape}")
        mean = x.mean(axis=0)
        _, singular, axes = np.linalg.svd(x - mean, full_matrices=False)
        dim = self.linear.out_features
        axes = axes[singular > singular.max(initial=0.0) * 1e-9][:dim]
        if len(axes) < dim:  # complete the basis: random directions orthogonal to the principal ones
            rng = np.random.default_rng(seed)
            extra = rng.standard_normal((dim - len(axes), x.shape[1]))
            extra -= extra @ axes.T @ axes if len(axes) else 0.0
            if len(extra) <= x.shape[1] - len(axes):  # room for them all to be orthonormal
                extra = np.linalg.qr(extra.T)[0].T
            axes = np.vstack([axes, extra / np.linalg.norm(extra, axis=1, keepdims=True)])
        weight = torch.from_numpy(axes).to(self.linear.weight)
        self.linear.weight.copy_(weight)
        self.linear.bias.copy_(-(weight @ torch.from_numpy(mean).to(weight)))


class FeatureHead(nn.Module):
    """The backbone's pooled features as the embedding, L2-normalised: a pretrained backbone used as it is."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return l2_normalize(features)


class CompatibleProjection(nn.Module):
    """``P``: the model's own embedding [B, d] -> L2-normalised [B, d_old] in an old model's space.

    A model trained ``--compatible-with`` an old one of another embedding size learns it jointly: the influence
    term compares its output with the old embeddings, the model's own loss stays on the native embedding. Linear
    without bias, so that it maps directions to directions (the output is normalised)."""

    def __init__(self, embedding_dim: int, compatible_dim: int, seed: int | None = None) -> None:
        """``seed``: its initial weights drawn from a generator of their own (the run's random stream untouched)."""
        super().__init__()
        if embedding_dim < 1 or compatible_dim < 1:
            raise ValueError(f"a projection needs sizes >= 1, got {embedding_dim} -> {compatible_dim}")
        self.linear = nn.Linear(embedding_dim, compatible_dim, bias=False)
        # (semi-)orthogonal: an isometry onto (or from) a subspace, so the projected batch starts with the angles
        # of the native one instead of a random linear map's distortion; the influence then only has to rotate it
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        nn.init.orthogonal_(self.linear.weight, generator=generator)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return l2_normalize(self.linear(embeddings))


class Embedder(nn.Module):
    """``Embedder(x) = head(backbone(x))``; ``config`` is everything needed to rebuild it (a frozen record: a change
    is ``model.config = model.config.with_fields({...})``).

    ``compatible`` (None unless ``add_compatible`` made it): the projection of the embedding into an old model's
    space of another size; ``config.compatible_dim`` records its size."""

    compatible: CompatibleProjection | None
    config: ModelConfig

    def __init__(self, backbone: nn.Module, head: EmbeddingHead, config: ModelConfig) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.config = config
        self.compatible = None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))

    def add_compatible(self, compatible_dim: int, seed: int | None = None) -> CompatibleProjection:
        """Give the model a projection of its embedding into an old space of ``compatible_dim`` dimensions (on the
        head's device); its size goes into ``config`` so that ``load_embedder`` rebuilds it."""
        weight = self.head.linear.weight
        self.compatible = CompatibleProjection(int(self.config.embedding_dim), int(compatible_dim), seed).to(
            device=weight.device, dtype=weight.dtype)
        self.config = self.config.with_fields({"compatible_dim": int(compatible_dim)})
        return self.compatible

    def embed_both(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the native embedding [B, d], its projection into the old space [B, d_old]): the exported outputs."""
        if self.compatible is None:
            raise ValueError("this model has no projection into an old space (it was not trained compatible with "
                             "an old model of another embedding size)")
        embeddings = self(images)
        return embeddings, self.compatible(embeddings)

    def train(self, mode: bool = True) -> Embedder:
        super().train(mode)
        if self.config.freeze_bn:
            # Frozen BatchNorm: running statistics and affine parameters stay as pretrained, which is what
            # small P x N metric-learning batches need.
            for module in self.backbone.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.eval()
        return self

    @property
    def preprocessing(self) -> ModelPreprocessing:
        """The model's preprocessing and embedding, read from ``config``: the one place a PyTorch model's (and so a
        checkpoint's) config becomes a ``ModelPreprocessing``. Read on each use: training sets the config's input
        size, background and resize mode after the model is made (``train/building.py``)."""
        return ModelPreprocessing.from_config(self.config)


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
    config = ModelConfig.from_json({
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
    })
    return Embedder(spec.module, head, config)


PRETRAINED_HEAD = "features"  # config.head of a backbone used as it is (no trained head)


def create_pretrained_embedder(backbone: str, image_size: int | None = None, resize: str = CROP,
                               offline: bool = False) -> Embedder:
    """A pretrained ``backbone`` as an embedder with no training: its pooled features, L2-normalised
    (d = the backbone's feature size), at ``image_size`` pixels (default: the backbone's own input size), each image
    made square by ``resize`` (crop or pad: ``retrieval.data.eval_preprocess``)."""
    if image_size is not None and not 32 <= int(image_size) <= 1024:
        raise ParameterError("image_size", f"must be in [32, 1024] pixels, got {image_size}")
    if resize not in RESIZE_MODES:
        raise ParameterError("resize", f"must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
    if not backbone.startswith("timm:") and backbone not in BACKBONES.names():
        raise ParameterError("backbone", f"is unknown: {backbone!r}; choose one of {', '.join(backbone_names())}")
    spec = create_backbone(backbone, pretrained=True, offline=offline)
    config = ModelConfig.from_json({
        "backbone": backbone,
        "embedding_dim": int(spec.feature_dim),
        "normalize": True,
        "freeze_bn": False,
        "feature_dim": int(spec.feature_dim),
        "input_size": int(image_size or spec.input_size),
        "mean": [float(v) for v in spec.mean],
        "std": [float(v) for v in spec.std],
        "background": list(DEFAULT_BACKGROUND),
        "resize": resize,
        "pretrained": True,
        "head": PRETRAINED_HEAD,
    })
    return Embedder(spec.module, FeatureHead(), config).eval()


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
        cfg.value_of("backbone"), cfg.value_of("embedding_dim"), pretrained=False, normalize=cfg.value_of("normalize"),
        freeze_bn=cfg.value_of("freeze_bn"),
    )
    model.config = model.config.with_fields(cfg.to_json())  # input size, normalisation and provenance as trained
    if cfg.compatible_dim:
        model.add_compatible(int(cfg.compatible_dim))
    model.load_state_dict(ckpt.state_dict)
    return model.eval()


@torch.no_grad()
def in_compatible_space(model: nn.Module, embeddings: np.ndarray) -> np.ndarray | None:
    """``model``'s embeddings [n, d] taken into the old space through its projection, float32 [n, d_old]: what
    its queries are compared with an old gallery as; None for a model without one (they are in it already)."""
    projection = getattr(model, "compatible", None)
    if projection is None:
        return None
    weight = projection.linear.weight
    rows = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(weight.device, weight.dtype)
    return projection(rows).float().cpu().numpy()
