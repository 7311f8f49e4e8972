"""Backbones, the embedder (``create_embedder``, ``load_embedder``) and its checkpoint (``Checkpoint``).

- ``backbones``: the backbone registry (``BACKBONES``, ``register_backbone``): images -> pooled features.
- ``weights``: where a backbone's pretrained weights come from, online and offline.
- ``embedder``: ``Embedder``: backbone, head, optional L2 norm; the compatible projection into an old model's space.
- ``checkpoint``: the training checkpoint (``retrieval-checkpoint/1``), one definition for its writer and readers.
- ``ema``: an exponential moving average of a model's weights.
- ``layer_decay``: layer-wise learning-rate decay (LLRD).
- ``weight_space``: weight-space ensembling of a pretrained and a fine-tuned model (WiSE-FT).
"""

from retrieval.models.backbones import (
    BACKBONES,
    Backbone,
    PretrainedWeightsMissing,
    backbone_names,
    create_backbone,
    efficientnet_lite0_classifier,
    register_backbone,
)
from retrieval.models.checkpoint import (
    BEST_CHECKPOINT,
    CHECKPOINT_FORMAT,
    LAST_CHECKPOINT,
    Checkpoint,
    config_hash,
    load_checkpoint,
)
from retrieval.models.embedder import (
    CompatibleProjection,
    Embedder,
    EmbeddingHead,
    FeatureHead,
    create_embedder,
    create_pretrained_embedder,
    in_compatible_space,
    load_embedder,
)
from retrieval.models.weights import WeightsDownloadFailed, WeightsLocation, offline_scope, resolve_weights
from retrieval.reports import WISE_CHECKPOINT

__all__ = [
    "BACKBONES", "BEST_CHECKPOINT", "Backbone", "CHECKPOINT_FORMAT", "Checkpoint", "CompatibleProjection",
    "Embedder", "EmbeddingHead", "FeatureHead", "LAST_CHECKPOINT", "PretrainedWeightsMissing", "backbone_names",
    "config_hash", "create_backbone", "create_embedder", "create_pretrained_embedder",
    "efficientnet_lite0_classifier", "in_compatible_space", "load_checkpoint", "load_embedder", "register_backbone",
    "WISE_CHECKPOINT", "WeightsDownloadFailed", "WeightsLocation", "offline_scope", "resolve_weights",
]
