"""Evaluate an embedder on a dataset split: embeddings -> retrieval metrics (used by train and the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from retrieval.data.dataset import BadImageLog
from retrieval.distributed import embed_sharded


@dataclass
class EvalSets:
    """Query set and optional separate gallery (In-shop); gallery None = leave-one-out on the query set."""

    query: Dataset
    gallery: Dataset | None = None

    @property
    def num_images(self) -> int:
        """Images in the query and gallery sets together."""
        return len(self.query) + (len(self.gallery) if self.gallery is not None else 0)


def checkpoint_dataset(train_config: dict[str, Any], dataset: str | None, data: str | None,
                       dataset_kwargs: dict[str, Any] | None = None) -> tuple[str, str | None, dict[str, Any]]:
    """(dataset, data, dataset_kwargs): what was given, else what the checkpoint was trained on."""
    dataset = dataset or train_config.get("dataset")
    if not dataset:
        raise ValueError("--dataset is required: the checkpoint does not record its data set")
    data = data if data is not None else train_config.get("data")
    return dataset, data, {**train_config.get("dataset_kwargs", {}), **(dataset_kwargs or {})}


def load_eval_sets(dataset: str, root: str | None, split: str, transform, limit: int | None = None,
                   seed: int = 0, **dataset_kwargs: Any) -> EvalSets:
    from retrieval.data import load_dataset

    query = load_dataset(dataset, root, split=split, transform=transform, **dataset_kwargs)
    gallery = None
    if split == "query":  # In-shop: queries are searched against the separate gallery split
        gallery = load_dataset(dataset, root, split="gallery", transform=transform, **dataset_kwargs)
    if limit is not None and len(query) > limit:
        query = seeded_subset(query, limit, seed)
    return EvalSets(query, gallery)


def seeded_subset(dataset: Dataset, size: int, seed: int = 0) -> Subset:
    order = np.random.default_rng(seed).permutation(len(dataset))[:size]
    return Subset(dataset, np.sort(order).tolist())


def evaluate_embeddings(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray | None = None,
                        gallery_labels: np.ndarray | None = None, ks=(1, 2, 4, 8),
                        with_clustering: bool = True) -> dict[str, float]:
    from retrieval.metrics import evaluate

    names = ["recall", "map@r", "r_precision"]
    if with_clustering:
        names += ["nmi", "f1"]
    return evaluate(query, query_labels, gallery, gallery_labels, ks=ks, metrics=names)


def embed_eval_sets(model: nn.Module, sets: EvalSets, device: torch.device | str, batch_size: int = 128,
                    workers: int | None = None, amp: bool = False, progress: bool = True,
                    bad_images: BadImageLog | None = None):
    """(query, query_labels, gallery, gallery_labels) embeddings; an unreadable image loses its row and label.

    Under torch.distributed each rank embeds its part and every rank gets all rows, each image once
    (``retrieval.distributed.embed_sharded``; in one process it is ``embed_samples``)."""

    def rows(dataset: Dataset, desc: str) -> tuple[np.ndarray, np.ndarray]:
        result = embed_sharded(model, dataset, batch_size, device, workers, amp, desc, progress, bad_images)
        return result.embeddings, result.labels

    q, ql = rows(sets.query, "embed query")
    if sets.gallery is None:
        return q, ql, None, None
    g, gl = rows(sets.gallery, "embed gallery")
    return q, ql, g, gl
