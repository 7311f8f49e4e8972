"""A training run's config, typed: ``RunConfig``, its training options as a checkpoint's ``train_config`` holds them
(``TrainConfig.to_dict()``; ``config_hash`` names the run by them), and ``RunFolderConfig``, the run folder's
``config.json`` as report.json's ``config`` holds it too (those options under ``train``, the model's config under
``model``, the data and where the run ran). Fields are typed for the keys readers read and the run writes; every other
key is kept in ``extra`` (``json_object.KeptJson``), so the files written from a record are the ones the dict wrote.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from retrieval.records.json_object import FlatJson, KeptJson
from retrieval.records.model_config import ModelConfig


@dataclass(frozen=True, eq=False)
class RunConfig(FlatJson):
    """A run's training options; each field holds the key of its name (None: not held; ``holds`` tells a null from
    an absent key, which older checkpoints have); the other options are in ``extra``, all in ``keys_held``'s order."""

    WHAT: ClassVar[str] = "a run's training config"

    dataset: str | None = None  # the data set's registered name
    data: str | None = None  # its folder or manifest
    dataset_kwargs: Mapping[str, Any] | None = None  # the data set's own options
    eval_split: str | None = None
    val_fraction: float | None = None  # the share of train held out for validation (None: auto)
    seed: int | None = None
    per_class: int | None = None  # images per class in a batch (the validation split is carved to keep it)
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    keys_held: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class RunFolderConfig(FlatJson):
    """A run folder's config.json (report.json's ``config``): ``train`` (``RunConfig``), ``model``
    (``ModelConfig``) and what the run measured of its data and machine; other keys (config.json's
    ``class_split``) in ``extra``."""

    WHAT: ClassVar[str] = "a run's config"
    PARTS: ClassVar[Mapping[str, type[KeptJson]]] = {"train": RunConfig, "model": ModelConfig}

    train: RunConfig | None = None
    model: ModelConfig | None = None
    label_noise: Mapping[str, Any] | None = None  # what label noise flipped
    train_size: int | None = None
    num_train_classes: int | None = None
    steps_per_epoch: int | None = None
    device: str | None = None
    world_size: int | None = None
    amp: bool | None = None  # the steps ran under autocast
    torch: str | None = None  # torch's version
    tracking: Mapping[str, Any] | None = None  # where the run's tracking went
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    keys_held: tuple[str, ...] = ()
