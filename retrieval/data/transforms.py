"""Image transforms from a model config (``input_size``, ``mean``, ``std``, ``background``).

Training augments with torchvision; evaluation is ``eval_preprocess.EvalPreprocess`` (PIL and NumPy, no torch)
returned as a tensor here, and also the plain function ``preprocess_eval``, so that indexing, serving and the
ONNX export all prepare images exactly as evaluation does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from PIL import Image
from torchvision.transforms import v2

from retrieval.data.decode import DEFAULT_BACKGROUND, FlattenAlpha
from retrieval.data.eval_preprocess import RESIZE_RATIO, EvalPreprocess, input_size, mean_and_std


def _normalize(model_config: Mapping[str, Any]) -> v2.Normalize:
    mean, std = mean_and_std(model_config)
    return v2.Normalize(mean=mean, std=std)


class EvalTransform:
    """The evaluation preprocessing as a tensor: ``EvalPreprocess`` (the one definition), then ``from_numpy``."""

    def __init__(self, model_config: Mapping[str, Any]) -> None:
        self.preprocess = EvalPreprocess(model_config)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.preprocess(image))

    def __repr__(self) -> str:
        return f"EvalTransform({self.preprocess!r})"


def background_of(model_config: Mapping[str, Any]) -> FlattenAlpha:
    """The step that composites transparent pixels onto the model's background (white for older models)."""
    return FlattenAlpha(model_config.get("background") or DEFAULT_BACKGROUND)


def build_transforms(model_config: Mapping[str, Any], train: bool) -> v2.Compose | EvalTransform:
    """PIL image (RGB or RGBA) -> float32 tensor [3, S, S], normalised; random crop and flip when ``train``."""
    if not train:
        return EvalTransform(model_config)
    size = input_size(model_config)
    return v2.Compose(
        [
            background_of(model_config), v2.Resize(int(size * RESIZE_RATIO), antialias=True),
            v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True), _normalize(model_config),
        ]
    )


def preprocess_eval(image: Image.Image, model_config: Mapping[str, Any]) -> torch.Tensor:
    """The evaluation preprocessing of one image: flatten transparency, resize, centre crop, scale, normalise."""
    return EvalTransform(model_config)(image)
