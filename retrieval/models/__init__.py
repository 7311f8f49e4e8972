"""Backbones and the embedder (``create_embedder``, ``load_embedder``)."""

from retrieval.models.backbones import (
    BACKBONES,
    Backbone,
    PretrainedWeightsMissing,
    backbone_names,
    create_backbone,
    efficientnet_lite0_classifier,
    register_backbone,
)
from retrieval.models.embedder import (
    CHECKPOINT_FORMAT,
    Embedder,
    EmbeddingHead,
    config_hash,
    create_embedder,
    load_checkpoint,
    load_embedder,
)

__all__ = [
    "BACKBONES", "Backbone", "CHECKPOINT_FORMAT", "Embedder", "EmbeddingHead", "PretrainedWeightsMissing",
    "backbone_names", "config_hash", "create_backbone", "create_embedder", "efficientnet_lite0_classifier",
    "load_checkpoint", "load_embedder", "register_backbone",
]
