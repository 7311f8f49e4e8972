"""``ModelConfig``: the typed record of a model's config, everything needed to rebuild an embedder (``Embedder.config``;
a checkpoint's ``model_config``; an ONNX file's ``model_config`` metadata string). Made by ``create_embedder`` /
``create_pretrained_embedder``, completed by training (its preprocessing, ``compatible_dim``, ``compatible_with``,
``wise_alpha``) through ``with_fields``; its keys, order and values are kept (``json_object.KeptJson``), so the files
written from it are the ones the dict wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from retrieval.records.json_object import FlatJson


@dataclass(frozen=True, eq=False)
class ModelConfig(FlatJson):
    """A model's config; each field holds the key of its name (None: the config does not hold it); ``extra``: the
    keys this version does not know; ``keys_held``: every key, in order (what ``to_json`` writes back)."""

    WHAT: ClassVar[str] = "a model config"

    backbone: str | None = None  # a registered name or ``timm:<name>``
    embedding_dim: int | None = None
    normalize: bool | None = None  # the head L2-normalises its output
    freeze_bn: bool | None = None  # BatchNorm kept as pretrained while training
    feature_dim: int | None = None  # the backbone's pooled features
    input_size: int | list[int] | None = None  # pixels of the square input (timm's (3, S, S) read too)
    mean: list[float] | None = None
    std: list[float] | None = None
    background: list[int] | None = None  # what transparent pixels are composited onto
    pretrained: bool | None = None  # the backbone started from pretrained weights
    resize: str | None = None  # how an image becomes square (None: a model from before the modes, which crops)
    head: str | None = None  # "features": a pretrained backbone used as it is, no trained head
    compatible_dim: int | None = None  # the size of its projection into an old model's space
    compatible_with: list[str] | None = None  # the hashes of the old models it was trained compatible with
    wise_alpha: float | None = None  # a WiSE-FT mix: the share of the fine-tuned weights
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    keys_held: tuple[str, ...] = ()
