"""What a training run says to people as it goes, in lines above any progress bar: the backbone choice a run without
labels took by default, the class split, a long CPU run's estimate, each epoch's line, warnings, and the advice for an
epoch that waited for its batches. The trainer decides when (and on which rank) each is said; nothing here writes a
file.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from retrieval.reports import VALIDATION_HOLDS
from retrieval.train.checkpointing import VALIDATION
from retrieval.train.config import TrainConfig
from retrieval.train.state import INPUT_BOUND_SHARE


def epoch_line(row: dict[str, Any]) -> str:
    """An epoch's row for people: its loss, the evaluation's headline metrics, its speed and its wait for batches."""
    parts = [f"loss {row['loss']:.4f}"]
    parts += [f"validation {key} {row[VALIDATION][key]:.4f}" for key in ("recall@1", "map@r")
              if key in row.get(VALIDATION, {})]
    parts += [f"test {key} {row[key]:.4f}" for key in ("recall@1", "map@r") if key in row]
    parts.append(f"{row['images_per_s']:,.0f} images/s")
    parts.append(f"{row['data_wait_s'] / max(row['epoch_time_s'], 1e-9):.0%} of the time waiting for batches")
    return f"epoch {row['epoch']}: " + ", ".join(parts)


# --pseudo-labels, for people: where an image's positives come from
POSITIVES = {"instance": "each image's augmented views", "clusters": "the images of its cluster, regrouped each epoch",
             "mutual": "its mutual neighbours' component, regrouped each epoch"}


def split_line(split: dict[str, Any], recorded: Path) -> str:
    """The run's class split for people: classes and images per split, and the file that lists them."""
    if split.get("labels") == "none":
        evaluated = split.get("test", {}).get("images", 0)
        measured = (f"measured on {evaluated:,} labelled images ({split['test']['classes']:,} classes)"
                    if split.get("test_labelled") else f"measured without labels on {evaluated:,} of them")
        positives = POSITIVES.get(split.get("pseudo_labels"), "each image's augmented views")
        return (f"data: {split['train']['images']:,} images without labels (positives: {positives}); {measured}; "
                f"recorded in {recorded} (class_split)")
    named = {"train": "train", "validation": "validation (held out of train)", "test": "test", "gallery": "gallery"}
    if "validation" in split:
        held = VALIDATION_HOLDS.get(split["validation"].get("held_out"), "held out of train")
        named["validation"] = f"validation ({held})"
    parts = [f"{label} {split[part]['classes']:,} classes, {split[part]['images']:,} images"
             for part, label in named.items() if part in split]
    shared = split.get("shared_train_test_classes", 0)
    overlap = f"{shared:,} classes in both train and test" if shared else "no class in both train and test"
    protocol = f"\n  {split['protocol']}" if split.get("protocol") else ""
    return f"data: {'; '.join(parts)} ({overlap}); the split is recorded in {recorded} (class_split){protocol}"


def faster_choice(cfg: TrainConfig) -> str:
    """The options that train a head on the frozen backbone's cached features instead of this run's backbone."""
    needs = cfg.needs_backbone_training()
    instead = " --pseudo-labels clusters" if "--pseudo-labels instance" in needs else ""
    rest = [flag for flag in needs if flag != "--pseudo-labels instance"]
    return f"--freeze-backbone{instead}" + (f" (leaving out {', '.join(rest)})" if rest else "")


def backbone_choice_line(cfg: TrainConfig, device_type: str) -> str | None:
    """A run's first line where the default settled --freeze-backbone (``TrainConfig.settle_freeze_backbone``): which
    it took and why, and how to get the other; None for a labelled run, whose default is unchanged."""
    if cfg.labels != "none":
        return None
    if cfg.freeze_backbone:
        return ("--labels none on a CPU: training a head on the frozen backbone's cached features, seconds to minutes "
                "for a few hundred images (fine-tuning the whole backbone runs it forward and backward at every "
                "step: ten times as long or more); --no-freeze-backbone fine-tunes the whole backbone "
                "(docs/UNLABELLED.md)")
    needs = cfg.needs_backbone_training()
    if device_type == "cpu":
        return (f"--labels none on a CPU: fine-tuning the whole backbone, as {', '.join(needs)} "
                f"need{'s' if len(needs) == 1 else ''} it; slow on a CPU (the estimate follows the first step); "
                f"{faster_choice(cfg)} trains a head on its cached features in minutes")
    return (f"--labels none on {device_type}: fine-tuning the whole backbone; --freeze-backbone trains only a head on "
            "its cached features")


LONG_RUN_S = 120.0  # a CPU run that trains the backbone and is estimated to take longer says so, and what is faster


@dataclass
class RunEstimate:
    """A run that fine-tunes the backbone on a CPU, timed before and at its first step: how long all of it takes, and
    how long a head on the frozen backbone's cached features would (the features computed once instead)."""

    epochs: int  # epochs to run
    steps: int  # optimizer steps an epoch
    evaluations: int  # evaluations after an epoch
    images: int  # train images: a pseudo-labelling pass embeds them all, caching the features would once
    image_s: float | None = None  # one image through the backbone without gradients (measured at the start)
    eval_s: float | None = None  # one evaluation (the one before training)
    regroup_s: float | None = None  # one pseudo-labelling pass (None without: --pseudo-labels instance)
    step_s: float | None = None  # the first step: forward, backward, optimizer

    def whole_s(self) -> float:
        """Every step, pseudo-labelling pass and evaluation still to come."""
        return (self.epochs * self.steps * (self.step_s or 0.0) + self.epochs * (self.regroup_s or 0.0)
                + self.evaluations * (self.eval_s or 0.0))

    def frozen_s(self) -> float | None:
        """The train images embedded once (and the evaluation's, as the first evaluation embeds them); the head's
        steps, the regroupings and the evaluations on cached features cost next to nothing. None: not measured."""
        cache = self.images * self.image_s if self.image_s is not None else self.regroup_s
        return None if cache is None else cache + (self.eval_s or 0.0)

    def line(self, faster: str) -> str:
        """The estimate for people, with ``faster`` (the options of the head on cached features) and its time."""
        parts = [f"{self.epochs} epochs x {self.steps} steps x ~{_duration(self.step_s or 0.0)}"]
        if self.regroup_s:
            parts.append(f"+ {self.epochs} pseudo-labellings x ~{_duration(self.regroup_s)}")
        if self.eval_s and self.evaluations:
            parts.append(f"+ {self.evaluations} evaluations x ~{_duration(self.eval_s)}")
        line = f"estimate: about {_duration(self.whole_s())} on this CPU ({', '.join(parts)})"
        frozen = self.frozen_s()
        return line + (f"; {faster}: about {_duration(frozen)}" if frozen is not None else "")


def estimate_line(estimate: RunEstimate, faster: str) -> str | None:
    """The estimate's line where the run is long (``LONG_RUN_S`` or more), else None."""
    return estimate.line(faster) if estimate.whole_s() >= LONG_RUN_S else None


def _duration(seconds: float) -> str:
    """``38 s``, ``12 min``, ``3.4 h``: as precise as an estimate is."""
    if seconds < 90:
        return f"{seconds:.2g} s" if seconds < 10 else f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def warn_line(message: str) -> None:
    """One warning line on stderr, above any progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)



def hint_input_bound(row: dict[str, Any], cfg: TrainConfig, workers: int, device: torch.device) -> bool:
    """Say what speeds up an epoch that waited for its batches (``INPUT_BOUND_SHARE`` of its time or more);
    returns whether it was said (the trainer says it once a run)."""
    share = row["data_wait_s"] / max(row["epoch_time_s"], 1e-9)
    if share < INPUT_BOUND_SHARE or row["data_wait_s"] < 1.0:  # not a second's start-up of a short epoch
        return False
    remedies = [f"more --workers (now {workers})"]
    if cfg.decode_on == "workers" and device.type == "cuda":
        remedies.append("decoding on the GPU (--decode-on device)")
    if not cfg.freeze_backbone:
        remedies.append("image files stored near the training size (a large photo costs most of its decoding)")
    tqdm.write(f"epoch {row['epoch']} waited for its batches {share:.0%} of its time "
               f"({row['data_wait_s']:.1f} s of {row['epoch_time_s']:.1f} s): the input limits training speed, "
               f"not the model; try {', '.join(remedies)}")
    return True
