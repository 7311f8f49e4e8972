"""Training without labels, the positives refreshed each epoch (--pseudo-labels clusters | mutual): before an epoch the
train images are embedded by the model as it stands, grouped (``retrieval.pseudo_labels``), and the groups become
the labels the sampler and the loss see; an image left out of every group stays a class of one, its own views.

The sampler is rebuilt with the new labels and the epoch's length of the first (the learning-rate schedule counts
on it). The epoch's labels are kept in the run folder: a run resumed inside an epoch trains on the labels the epoch
started with (the weights it resumes with would group the images otherwise), one resumed between epochs groups them
from the weights it resumes with, as the uninterrupted run did."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from retrieval.metrics import knn
from retrieval.pseudo_labels import (
    MAX_CLUSTER_IMAGES,
    cluster_pseudo_labels,
    mutual_neighbour_pseudo_labels,
    pseudo_label_stability,
    pseudo_label_summary,
)
from retrieval.train.config import TrainConfig
from retrieval.train.console import warn_line
from retrieval.train.distributed import DistContext
from retrieval.train.state import TrainData, TrainParts
from retrieval.utils.io import atomic_write


def clusters(embeddings: np.ndarray, seed: int = 0) -> np.ndarray:
    """SpCL's clusters, with its k1 = 30 (and k2 = 6) lowered on a small set, where 30 neighbours would join most
    of the images into one k-reciprocal set. Past ``MAX_CLUSTER_IMAGES`` (the dense distance's bound) a seeded
    sample is clustered and every other image joins the cluster of its nearest sampled image, or stays alone where
    that image is alone."""
    n = len(embeddings)
    sample = np.sort(np.random.default_rng(seed).permutation(n)[:MAX_CLUSTER_IMAGES]) if n > MAX_CLUSTER_IMAGES \
        else np.arange(n)
    k1 = min(30, max(4, len(sample) // 10))
    grouped = cluster_pseudo_labels(embeddings[sample], k1=k1, k2=min(6, max(1, k1 // 5)))
    if len(sample) == n:
        return grouped
    sizes = np.bincount(grouped)
    labels = np.arange(n, dtype=np.int64) + n  # alone, apart from every cluster id
    labels[sample] = grouped
    rest = np.setdiff1d(np.arange(n), sample)
    _, nearest = knn(embeddings[rest], embeddings[sample], k=1, metric="cosine")
    nearest = nearest[:, 0]
    joined = sizes[grouped[nearest]] > 1  # the nearest sampled image is in a cluster
    labels[rest[joined]] = grouped[nearest[joined]]
    return labels


GROUPERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "clusters": clusters,
    "mutual": mutual_neighbour_pseudo_labels,
}
PSEUDO_LABELS_KEY = "pseudo_labels"  # an epoch row's figures of the labels it trained on
PSEUDO_LABELS_FILE = "pseudo_labels.npz"  # in the run folder: the labels of the epoch under way, for a resume


class PseudoLabelling:
    """Regroups the train images before each epoch and hands the labels to the sampler, the features and the data."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, parts: TrainParts, data: TrainData,
                 eval_model: Callable[[], torch.nn.Module], out: Path) -> None:
        self.cfg, self.ctx, self.parts, self.data = cfg, ctx, parts, data
        self.eval_model = eval_model
        self.group = GROUPERS[cfg.pseudo_labels]
        self.batches_per_epoch = len(parts.sampler)  # kept: the schedule was made for it
        self.previous: np.ndarray | None = None
        self.saved = out / PSEUDO_LABELS_FILE
        # the label-free check's images: never grouped nor trained on, their label -1 (the sampler skips them)
        self.held_out = np.asarray(getattr(data.check_images, "indices", []), dtype=np.int64)

    def refresh(self, epoch: int, mid_epoch: bool = False) -> dict[str, Any]:
        """The labels epoch ``epoch`` trains on: grouped by the model's current embeddings, or (``mid_epoch``: a run
        resumed inside the epoch) the ones it started with, as saved; returns their figures."""
        saved = self._load()
        if saved is not None and int(saved["epoch"]) == epoch - 1:
            self.previous = saved["labels"]  # a run resumed between epochs: the stability is measured against them
        if mid_epoch and saved is not None and int(saved["epoch"]) == epoch:
            self._apply(saved["labels"])
            self.previous = saved["labels"]
            return {PSEUDO_LABELS_KEY: json.loads(str(saved["figures"]))}  # as the epoch's row had them
        figures = self._regroup()
        if self.ctx.is_main:  # what a resume inside this epoch trains on
            buffer = io.BytesIO()
            np.savez(buffer, epoch=epoch, labels=self.previous, figures=json.dumps(figures[PSEUDO_LABELS_KEY]))
            atomic_write(self.saved, buffer.getvalue())
        return figures

    def _load(self) -> dict[str, np.ndarray] | None:
        if not self.saved.is_file():
            return None
        with np.load(self.saved) as saved:
            return {key: saved[key] for key in ("epoch", "labels", "figures")}

    @torch.no_grad()
    def _regroup(self) -> dict[str, Any]:
        """Group the train images by the model's current embeddings; returns the figures of the new labels."""
        model = self.eval_model()
        was_training = model.training
        embeddings, rows = self.parts.features.train_embeddings(model)
        model.train(was_training)
        trained = ~np.isin(rows, self.held_out)
        embeddings, rows = embeddings[trained], rows[trained]
        grouped = self.ctx.from_main(self.group(embeddings) if self.ctx.is_main else None)
        first_free = int(grouped.max()) + 1 if len(grouped) else 0
        labels = np.arange(len(self.data.train_labels), dtype=np.int64) + first_free
        labels[rows] = grouped  # an image that could not be read stays a class of its own
        labels = self._held_out(labels)
        figures = pseudo_label_summary(labels[rows])
        needed, formed = self.parts.sampler.classes_per_batch, int(labels.max()) + 1
        if formed < needed:  # one group swallowed the rest: a batch could not hold its classes
            labels = self.previous if self.previous is not None else \
                self._held_out(np.arange(len(labels), dtype=np.int64))
            figures["kept_previous"] = True
            if self.ctx.is_main:
                warn_line(too_few_groups(self.cfg, figures, needed, formed, previous=self.previous is not None,
                                         alone=int(labels.max()) + 1 == int((labels >= 0).sum())))
        self._apply(labels)
        if self.previous is not None:
            figures["stability"] = pseudo_label_stability(self.previous[rows], labels[rows])
        self.previous = labels
        return {PSEUDO_LABELS_KEY: figures}

    def _held_out(self, labels: np.ndarray) -> np.ndarray:
        """``labels`` with the check's images at -1 and the others renumbered 0..C-1."""
        labels = labels.copy()
        labels[self.held_out] = -1
        kept = labels >= 0
        labels[kept] = _contiguous(labels[kept])
        return labels

    def _apply(self, labels: np.ndarray) -> None:
        """The labels into the data, the dataset the workers read, the cached features and a new sampler."""
        data, parts = self.data, self.parts
        data.train_labels = labels
        if hasattr(data.train_set, "labels"):
            data.train_set.labels = labels
        if hasattr(parts.features, "labels"):
            parts.features.labels = torch.from_numpy(labels)
        old = parts.sampler
        kwargs = dict(drop_small=False, seed=old.seed, batches_per_epoch=self.batches_per_epoch, repeat_small=True)
        if hasattr(old, "rank"):
            kwargs.update(rank=old.rank, world_size=old.world_size)
        parts.sampler = type(old)(labels, old.classes_per_batch, old.samples_per_class, **kwargs)


def too_few_groups(cfg: TrainConfig, figures: dict[str, Any], needed: int, formed: int, previous: bool,
                   alone: bool) -> str:
    """The warning of an epoch whose groups (``formed`` classes, singles included) cannot fill a batch of ``needed``
    classes: what it trains on instead (``alone``: each image its own class), and the --batch-size that would take
    the groups."""
    line = (f"--pseudo-labels {cfg.pseudo_labels}: the images formed {figures['clusters']} group(s) and "
            f"{figures['singletons']} single image(s), fewer classes than the {needed} a batch holds; this epoch "
            "trains on " + ("the previous labels" if previous else "each image's own views"))
    if cfg.freeze_backbone and alone:  # cached features are not augmented: an image's views are one vector
        line += ", one cached feature each (nothing to learn from)"
    if formed >= 2:
        line += f"; --batch-size {formed * cfg.per_class} or less would take the groups"
    return line


def _contiguous(labels: np.ndarray) -> np.ndarray:
    """``labels`` renumbered 0..C-1 in order of first appearance."""
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse].astype(np.int64)
