"""The trainer's state, declared: what ``Trainer.setup`` builds and what a checkpoint carries from run to run."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from retrieval.data import ClassBalancedBatchSampler
from retrieval.distributed import GlobalBatchObjective
from retrieval.metrics.evaluation import EvalSets, ExtraSet
from retrieval.models import Embedder
from retrieval.train.distributed import DataParallelStep
from retrieval.train.features import FeatureSource
from retrieval.train.robust import RobustFineTuning
from retrieval.utils.reads import Stat


@dataclass
class TrainData:
    """The run's data: train split (labels as trained, noise included), evaluation split, the true labels."""

    train_set: Dataset
    eval_sets: EvalSets
    train_labels: np.ndarray  # what the loss sees: with --label-noise, some are flipped
    clean_train_labels: np.ndarray  # the true classes, which the linear probe measures against
    noise_info: dict[str, Any] | None  # what --label-noise flipped (config.json), None without it
    val_set: Dataset | None = None  # --val-fraction: held out of train, where best.pt and WiSE-FT choose
    extra_sets: list[ExtraSet] = field(default_factory=list)  # --eval-extra: out-of-domain sets
    no_validation: str | None = None  # why there is no validation split (best.pt is then the last epoch)
    # --labels none: a seeded sample of the train images, unaugmented, where the label-free figures are measured
    unlabelled_sample: Dataset | None = None
    # --labels none with the label-free check: the images held out of training for it (a Subset by train position)
    check_images: Dataset | None = None
    validation_by: str | None = None  # what val_set holds out of train: "classes" or "images" (of every class)

    @property
    def selected_on(self) -> str:
        """What best.pt is chosen on: "validation" (held out of train), else nothing: "last" (the last epoch);
        without labels "kept" (the latest epoch that keeps --kept-floor of the pretrained neighbours). Never the
        test split."""
        if self.unlabelled_sample is not None:
            return "kept"
        return "validation" if self.val_set is not None else "last"

    @property
    def trained_class_names(self) -> list[str]:
        """The class names a checkpoint records: none without labels (each image was its own class)."""
        return [] if self.unlabelled_sample is not None else list(self.train_set.class_names)

    @property
    def num_classes(self) -> int:
        """Classes of the train labels (ids run from 0)."""
        return int(self.train_labels.max()) + 1


@dataclass
class TrainParts:
    """What trains: the model, its loss (and auxiliary head), the optimizer with its schedule, the batches."""

    model: Embedder
    loss_fn: nn.Module
    aux: nn.Module | None  # --aux-ce's classifier head, None without it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR  # stepped once per optimizer step
    scaler: torch.amp.GradScaler  # enabled for --amp fp16 only
    objective: GlobalBatchObjective
    sampler: ClassBalancedBatchSampler  # or its distributed variant: this rank's part of each global batch
    features: FeatureSource  # cached backbone features (frozen backbone) or images
    step: DataParallelStep  # the forward pass, through DDP when there are several processes
    robust: RobustFineTuning  # the weights fine-tuning started from, and what keeps the model near them
    old_model: nn.Module | None = None  # --compatible-with: the frozen old model that embeds each batch too

    @property
    def steps_per_epoch(self) -> int:
        """Batches of one epoch (the sampler's length)."""
        return len(self.sampler)


@dataclass
class RunRecord:
    """Where the run stands between epochs; a checkpoint keeps it, a resume restores it."""

    start_epoch: int = 0  # epochs complete when this process started
    best_recall: float = -1.0  # recall@1 of best.pt on the split it is chosen on (TrainData.selected_on)
    history: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl's rows
    baseline: dict[str, float] | None = None  # the metrics before training (--eval-before)
    reference: dict[str, Any] | None = None  # --eval-extra: the pretrained backbone at its own resolution


@dataclass
class EpochProgress:
    """Where an epoch stands and its running sums: a mid-epoch checkpoint keeps it so the epoch ends the same."""

    epoch: int
    batch: int = 0  # batches taken from the sampler
    steps: int = 0  # optimizer steps
    skipped_steps: int = 0  # non-finite loss, or fewer than 2 images left after unreadable ones were dropped
    bad_in_row: int = 0
    seen: int = 0  # images in the optimizer steps
    skipped_images: int = 0  # images of the epoch's batches that could not be read
    elapsed: float = 0.0
    data_wait: float = 0.0  # seconds of ``elapsed`` spent waiting for the next batch
    totals: dict[str, float] = field(default_factory=dict)
    stats: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value


# the trainer reads its steps' losses back from the device at most this often (and at each checkpoint and epoch end)
READ_BACK_SECONDS = 0.5


@dataclass
class StepValues:
    """An optimizer step's loss, logged terms (auxiliary head, distillation, L2-SP) and the loss's statistics
    (``last_stats``), still on the device."""

    step: int  # optimizer steps taken, this one included
    epoch: float  # where in training it was taken, in epochs
    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    stats: dict[str, Stat] = field(default_factory=dict)


# the keys of an epoch's row that measure time rather than training: runs that train the same differ only in them
TIMING_KEYS = frozenset({"images_per_s", "epoch_time_s", "data_wait_s"})
# an epoch that waited this share of its time for its batches is limited by its input pipeline
INPUT_BOUND_SHARE = 0.3


class WaitTimer(Iterator):
    """Iterates ``items`` and sums the seconds spent in their ``next`` (a loop's wait for its input) in ``waited``."""

    def __init__(self, items: Iterable, waited: float = 0.0) -> None:
        self._items = iter(items)
        self.waited = waited

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._items)
        finally:
            self.waited += time.perf_counter() - start


def rng_states() -> dict[str, Any]:
    """Every random generator the run draws from (torch, numpy, python, and CUDA's when there is one)."""
    rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_states(rng: dict[str, Any]) -> None:
    """Put back the generators ``rng_states`` saved (CUDA's only where there is a GPU)."""
    torch.set_rng_state(rng["torch"].cpu())
    np.random.set_state(rng["numpy"])
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([state.cpu() for state in rng["cuda"]])
