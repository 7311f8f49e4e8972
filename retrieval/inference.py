"""Batch inference helpers shared by training, evaluation and indexing."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was requested but no CUDA GPU is available; use --device cpu")
    return torch.device(device)


def default_workers() -> int:
    return min(4, max(0, (os.cpu_count() or 1) - 1))


def make_loader(dataset: Dataset, batch_size: int | None, workers: int | None = None,
                device: torch.device | None = None, **kwargs) -> DataLoader:
    """A DataLoader with worker count and pinned memory chosen for the device (batch_size None: batch_sampler)."""
    workers = default_workers() if workers is None else workers
    if batch_size is not None:
        kwargs["batch_size"] = batch_size
    return DataLoader(
        dataset, num_workers=workers, pin_memory=device is not None and device.type == "cuda", **kwargs,
    )


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
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``model`` over a dataset of (image, label); returns float32 outputs [n, d] and int64 labels [n]."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    loader = make_loader(dataset, batch_size, workers, device, shuffle=False)
    outputs, labels = [], []
    with tqdm(total=len(dataset), desc=desc, unit="img", disable=not progress, leave=False) as bar:
        for images, targets in loader:
            images = images.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp and device.type == "cuda"):
                out = model(images)
            outputs.append(out.float().cpu())
            labels.append(torch.as_tensor(targets))
            bar.update(len(images))
    model.train(was_training)
    if not outputs:
        raise ValueError("cannot embed an empty dataset")
    return torch.cat(outputs).numpy(), torch.cat(labels).numpy().astype(np.int64)
