"""What a training run says to people as it goes, in lines above any progress bar: the class split, each epoch's
line, warnings, and the advice for an epoch that waited for its batches. The trainer decides when (and on which
rank) each is said; nothing here writes a file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

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
    parts = [f"{label} {split[part]['classes']:,} classes, {split[part]['images']:,} images"
             for part, label in named.items() if part in split]
    shared = split.get("shared_train_test_classes", 0)
    overlap = f"{shared:,} classes in both train and test" if shared else "no class in both train and test"
    return f"data: {'; '.join(parts)} ({overlap}); the split is recorded in {recorded} (class_split)"


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
