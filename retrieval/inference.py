"""Batch inference helpers shared by training, evaluation and indexing."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from retrieval.data.dataset import BadImageLog, BadSample, CatchBadSamples, collate_dropping_bad
from retrieval.errors import ParameterError
from retrieval.utils.heap import kept_heap
from retrieval.utils.progress import progress_bar
from retrieval.utils.workers import default_workers


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ParameterError("device", f"{device} was requested but no CUDA GPU is available; use cpu")
    return torch.device(device)


def make_loader(dataset: Dataset, batch_size: int | None, workers: int | None = None,
                device: torch.device | None = None, persistent: bool = False, **kwargs) -> DataLoader:
    """A DataLoader of ``LoadedBatch``es: samples that fail to load are left out of each batch and listed in
    its ``.bad``; worker count and pinned memory are chosen for the device (batch_size None: batch_sampler);
    ``persistent``: the workers outlive an iteration (when there are any)."""
    workers = default_workers() if workers is None else workers
    kwargs["persistent_workers"] = persistent and workers > 0
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    kwargs.setdefault("collate_fn", collate_dropping_bad)
    return DataLoader(
        CatchBadSamples(dataset), num_workers=workers, pin_memory=device is not None and device.type == "cuda",
        **kwargs,
    )


@dataclass
class Embedded:
    """Outputs of a model over a dataset, without the samples that failed to load."""

    embeddings: np.ndarray  # float32 [n, d]
    labels: np.ndarray  # int64 [n]
    indices: np.ndarray  # int64 [n]: the dataset position of each row
    bad: list[BadSample]  # the samples left out


@torch.no_grad()
def embed_samples(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 128,
    device: torch.device | str = "cpu",
    workers: int | None = None,
    amp: bool = False,
    desc: str = "embed",
    progress: bool = True,
    bad_images: BadImageLog | None = None,
) -> Embedded:
    """Run ``model`` over a dataset of (image, label); unreadable images go to ``bad_images`` (None: stop on one)."""
    bad_images = BadImageLog("fail") if bad_images is None else bad_images
    device = torch.device(device)
    was_training = model.training
    model.eval()
    loader = make_loader(dataset, batch_size, workers, device, shuffle=False)
    outputs, labels, indices, bad = [], [], [], []
    with kept_heap(), progress_bar(total=len(dataset), desc=desc, unit="img", disable=not progress,
                                         leave=False) as bar:
        for batch in loader:
            bad_images.add(batch.bad)
            bad += batch.bad
            if batch.inputs is not None:
                images = batch.inputs.to(device, non_blocking=True)
                with torch.autocast(device.type, dtype=torch.float16, enabled=amp and device.type == "cuda"):
                    out = model(images)
                outputs.append(out.float().cpu())
                labels.append(torch.as_tensor(batch.labels))
                indices.append(batch.indices)
            bar.update(len(batch.indices) + len(batch.bad))
    model.train(was_training)
    if not outputs:
        if bad:
            raise ValueError(f"none of the {len(dataset)} images could be read (first: {bad[0].source}: "
                             f"{bad[0].reason}); check the data folder")
        raise ValueError("cannot embed an empty dataset")
    return Embedded(torch.cat(outputs).numpy(), torch.cat(labels).numpy().astype(np.int64),
                    torch.cat(indices).numpy().astype(np.int64), bad)


@torch.no_grad()
def embed_dataset(
    model: nn.Module,
    dataset: Dataset,
    batch_size: int = 128,
    device: torch.device | str = "cpu",
    workers: int | None = None,
    amp: bool = False,
    desc: str = "embed",
    progress: bool = True,
    bad_images: BadImageLog | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """float32 outputs [n, d] and int64 labels [n] of the images that load (``embed_samples``, rows only)."""
    result = embed_samples(model, dataset, batch_size, device, workers, amp, desc, progress, bad_images)
    return result.embeddings, result.labels
