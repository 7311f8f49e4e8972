"""Where a run's head starts (``--head-start``): random (the papers' init), the principal axes of the train images'
backbone features, or the identity (the pretrained export itself). ``auto``: a head on a frozen backbone starts at
the baseline (identity where the sizes allow, else principal), so that best.pt moves away from the pretrained export
only where the validation split says training helps (docs/TRAINING.md, "Against the pretrained export"); a
fine-tuned backbone keeps the papers' random head; a run without labels starts at the principal axes."""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch.utils.data import Dataset

from retrieval.data import build_transforms
from retrieval.metrics.evaluation import seeded_subset
from retrieval.models import Embedder
from retrieval.train.config import TrainConfig
from retrieval.train.head_start_options import IDENTITY, PRINCIPAL, RANDOM

PRINCIPAL_IMAGES = 4096  # train images whose features set the principal axes where the backbone is not cached


def resolved_head_start(cfg: TrainConfig, feature_dim: int | None = None) -> str:
    """The head start ``cfg`` asks for, ``auto`` settled: random, principal or identity."""
    if cfg.head_start != "auto":
        return cfg.head_start
    if cfg.labels == "none":
        return PRINCIPAL
    if not cfg.freeze_backbone:
        return RANDOM
    # a frozen backbone with labels: identity, principal where the embedding is of another size than the features.
    # On the catalogue benchmark (3 seeds) random, principal and identity starts end within noise of each other at
    # one size; a start at the baseline adds that epoch 0 may be best.pt, and identity's epoch 0 is the pretrained
    # export itself
    if feature_dim is not None and cfg.embedding_dim != feature_dim:
        return PRINCIPAL  # identity needs the backbone's size
    return IDENTITY


def starts_at_baseline(cfg: TrainConfig) -> bool:
    """Whether the head starts at the pretrained backbone's geometry (not a random map): its start (epoch 0) may
    then be the model best.pt delivers, and WiSE-FT mixes toward that head."""
    return resolved_head_start(cfg) != RANDOM


def check_head_start(cfg: TrainConfig, feature_dim: int) -> None:
    """Refuse ``--head-start identity`` where the embedding is not the backbone's size, naming both and the fix."""
    if cfg.head_start == IDENTITY and cfg.embedding_dim != feature_dim:
        raise ValueError(f"--head-start identity starts the head as the pretrained export itself, so the embedding "
                         f"must have the backbone's {feature_dim} dimensions, and --embedding-dim is "
                         f"{cfg.embedding_dim}: give --embedding-dim {feature_dim}, or --head-start principal (the "
                         f"{cfg.embedding_dim} principal axes of the train images' features)")


@torch.no_grad()
def identity_weights(model: Embedder) -> dict[str, torch.Tensor]:
    """The head's weights as W = I, b = 0 (on the CPU): its embedding is the backbone's pooled features, normalised
    as the model normalises, exactly the pretrained export's where it L2-normalises."""
    head = copy.deepcopy(model.head).cpu()
    head.linear.weight.copy_(torch.eye(*head.linear.weight.shape))
    head.linear.bias.zero_()
    return head.state_dict()


def principal_weights(model: Embedder, features: np.ndarray, seed: int) -> dict[str, torch.Tensor]:
    """The head's weights started at the principal axes of ``features`` (on the CPU, to share among ranks)."""
    head = copy.deepcopy(model.head).cpu()
    head.start_at_principal_axes(features, seed)
    return head.state_dict()


def principal_images(train_set: Dataset, model: Embedder, seed: int) -> Dataset:
    """The train images whose backbone features set the principal axes: unaugmented (the evaluation's view), a
    seeded sample of ``PRINCIPAL_IMAGES`` where there are more."""
    plain = copy.copy(train_set)
    plain.transform = build_transforms(model.preprocessing, train=False)
    return seeded_subset(plain, PRINCIPAL_IMAGES, seed) if len(plain) > PRINCIPAL_IMAGES else plain
