"""``ModelPreprocessing``: the one typed record of what a model needs to embed an image (its input size, resize mode,
background, mean and std, embedding size, and what of it hashes into the model's identity).

A model's files carry it as untyped data: a checkpoint's ``model_config`` dict, an ONNX file's metadata strings.
Each source is read into the record in one place (``Embedder.preprocessing`` for a PyTorch model and its
checkpoint, ``retrieval.onnx_runtime.parse_metadata`` for an exported file), and everything else takes the record.
``to_config`` gives back the keys as the files hold them, so the files written stay the same.

Light (Pillow through ``colour``, no torch or NumPy): the torch-free read side (the ONNX runtime, the index, the
server) imports it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from retrieval.data.colour import DEFAULT_BACKGROUND, parse_background
from retrieval.data.resize_modes import CROP, RESIZE_MODES
from retrieval.records.model_config import ModelConfig

__all__ = ["DEFAULT_BACKGROUND", "IDENTITY_KEYS", "RESIZE_RATIO", "ModelPreprocessing", "resized_size"]

RESIZE_RATIO = 1.14  # crop mode: resize the short side to 1.14 x the input size, then crop (the usual 256 -> 224)
# The model-config keys that change what an image becomes: part of a model's identity with its weights (``resize``
# joins them only for a model that does not crop, so that models from before the mode keep their hash).
IDENTITY_KEYS = ("backbone", "embedding_dim", "normalize", "input_size", "mean", "std", "background")


def resized_size(width: int, height: int, short_side: int) -> tuple[int, int]:
    """(width, height), PIL's order, with the short side at ``short_side`` and the long one scaled, truncated as
    torchvision's ``Resize(short_side)`` does; a (height, width) caller swaps at its call."""
    if width <= height:
        return short_side, int(short_side * height / width)
    return int(short_side * width / height), short_side


@dataclass(frozen=True)
class ModelPreprocessing:
    """What a model needs to embed an image, typed and checked when made (``ValueError`` naming the field).

    ``resize`` None: the model's files do not record a mode (models from before it), which crops (``resize_mode``);
    ``backbone``, ``embedding_dim`` and ``normalize`` None: a config that does not name them (they only enter the
    identity hash). Sequences given for ``mean``, ``std`` and ``background`` are kept as tuples."""

    input_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    background: tuple[int, int, int] = DEFAULT_BACKGROUND
    resize: str | None = None
    backbone: str | None = None
    embedding_dim: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        size = self.input_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"model_config['input_size'] must be a positive int, got {size!r}")
        mean, std = self.mean, self.std
        if mean is None or std is None or len(mean) != 3 or len(std) != 3:
            raise ValueError("model_config needs 'mean' and 'std', each 3 numbers (per RGB channel)")
        if not all(float(s) for s in std):
            raise ValueError(f"model_config['std'] must be non-zero, got {list(std)}")
        if self.resize is not None and self.resize not in RESIZE_MODES:
            raise ValueError(f"model_config['resize'] must be one of {', '.join(RESIZE_MODES)}, got {self.resize!r}")
        # frozen: the checked values are set once, here
        object.__setattr__(self, "mean", tuple(float(m) for m in mean))
        object.__setattr__(self, "std", tuple(float(s) for s in std))
        object.__setattr__(self, "background", parse_background(self.background))

    @classmethod
    def from_config(cls, config: ModelConfig | Mapping[str, Any]) -> ModelPreprocessing:
        """The preprocessing of a model's config (``Embedder.config``, a checkpoint's ``model_config``; a dict is
        read as a ``ModelConfig``); the keys that are not preprocessing are left in the config."""
        config = ModelConfig.of(config)
        size = config.input_size
        if isinstance(size, (tuple, list)):  # timm style (3, H, W)
            if len(size) != 3 or size[1] != size[2]:
                raise ValueError(f"input_size must be an int or a square (3, S, S), got {size}")
            size = size[-1]
        backbone, dim, normalize = config.backbone, config.embedding_dim, config.normalize
        return cls(
            input_size=size,  # type: ignore[arg-type]  (checked when made)
            mean=config.mean,  # type: ignore[arg-type]
            std=config.std,  # type: ignore[arg-type]
            background=config.background or DEFAULT_BACKGROUND,  # type: ignore[arg-type]
            resize=config.resize or None,
            backbone=None if backbone is None else str(backbone),
            embedding_dim=None if dim is None else int(dim),
            normalize=None if normalize is None else bool(normalize),
        )

    def to_config(self) -> dict[str, Any]:
        """The record's keys as a model config holds them (lists, floats, ints); the fields that are None (not
        recorded) are left out."""
        values = {
            "backbone": self.backbone,
            "embedding_dim": self.embedding_dim,
            "normalize": self.normalize,
            "input_size": self.input_size,
            "mean": list(self.mean),
            "std": list(self.std),
            "background": list(self.background),
            "resize": self.resize,
        }
        return {key: value for key, value in values.items() if value is not None}

    @property
    def resize_mode(self) -> str:
        """How an image of any shape becomes the square input: ``crop`` (also where no mode is recorded) or
        ``pad``."""
        return self.resize or CROP

    @property
    def short_side(self) -> int:
        """The crop mode's short side before the centre crop: ``RESIZE_RATIO`` x the input size."""
        return int(self.input_size * RESIZE_RATIO)

    def identity(self) -> dict[str, Any]:
        """The values of ``IDENTITY_KEYS`` (None where not recorded) and, for a model that does not crop, its mode:
        what the model's hash covers beside its weights."""
        config = self.to_config()
        relevant = {key: config.get(key) for key in IDENTITY_KEYS}
        if self.resize_mode != CROP:  # a letterboxing model embeds other pixels; a cropping one keeps its hash
            relevant["resize"] = self.resize_mode
        return relevant

    def identity_digest(self) -> Any:
        """A sha256 object fed with ``identity()``, for the model hash to add the weights to."""
        return hashlib.sha256(json.dumps(self.identity(), sort_keys=True).encode())
