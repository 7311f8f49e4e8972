"""Image transforms from a model config (``input_size``, ``mean``, ``std``, ``background``).

The eval pipeline is also a plain function, ``preprocess_eval``, so that indexing, serving and the
ONNX export all prepare images exactly as evaluation does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2

from retrieval.data.decode import DEFAULT_BACKGROUND, FlattenAlpha

RESIZE_RATIO = 1.14  # resize to 1.14 x crop size, then crop (the usual 256 -> 224)


def _input_size(model_config: Mapping[str, Any]) -> int:
    size = model_config.get("input_size")
    if isinstance(size, (tuple, list)):  # timm style (3, H, W)
        if len(size) != 3 or size[1] != size[2]:
            raise ValueError(f"input_size must be an int or a square (3, S, S), got {size}")
        size = size[-1]
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"model_config['input_size'] must be a positive int, got {size!r}")
    return size


def _normalize(model_config: Mapping[str, Any]) -> v2.Normalize:
    mean, std = model_config.get("mean"), model_config.get("std")
    if mean is None or std is None or len(mean) != 3 or len(std) != 3:
        raise ValueError("model_config needs 'mean' and 'std', each 3 numbers (per RGB channel)")
    return v2.Normalize(mean=[float(m) for m in mean], std=[float(s) for s in std])


def background_of(model_config: Mapping[str, Any]) -> FlattenAlpha:
    """The step that composites transparent pixels onto the model's background (white for older models)."""
    return FlattenAlpha(model_config.get("background") or DEFAULT_BACKGROUND)


def build_transforms(model_config: Mapping[str, Any], train: bool) -> v2.Compose:
    """PIL image (RGB or RGBA) -> float32 tensor [3, S, S], normalised; random crop and flip when ``train``."""
    size = _input_size(model_config)
    resize = v2.Resize(int(size * RESIZE_RATIO), antialias=True)
    if train:
        geometry = [resize, v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()]
    else:
        geometry = [resize, v2.CenterCrop(size)]
    return v2.Compose(
        [
            background_of(model_config), *geometry, v2.ToImage(), v2.ToDtype(torch.float32, scale=True),
            _normalize(model_config),
        ]
    )


def preprocess_eval(image: Image.Image, model_config: Mapping[str, Any]) -> torch.Tensor:
    """The evaluation preprocessing of one image: flatten transparency, resize, centre crop, scale, normalise."""
    return build_transforms(model_config, train=False)(image)
