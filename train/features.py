"""--freeze-backbone: compute backbone features once, cache them on disk, train only the head."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from retrieval.inference import embed_dataset


def default_cache_dir() -> Path:
    base = os.environ.get("RETRIEVAL_CACHE_DIR") or Path.home() / ".cache" / "retrieval"
    return Path(base) / "features"


def cached_features(
    backbone: nn.Module,
    dataset: Dataset,
    key: dict,
    cache_dir: str | Path | None,
    device: torch.device,
    batch_size: int,
    workers: int | None,
    amp: bool,
    desc: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Backbone features [n, F] and labels, read from the cache when ``key`` matches an earlier run."""
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir / f"{digest}.npz"
    if path.is_file():
        with np.load(path) as data:
            return data["features"], data["labels"]
    features, labels = embed_dataset(backbone, dataset, batch_size, device, workers, amp, desc=desc)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, features=features, labels=labels)
    os.replace(tmp, path)
    (cache_dir / f"{digest}.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
    return features, labels
