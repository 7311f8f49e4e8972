"""--freeze-backbone: compute backbone features once, cache them on disk, train only the head."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

from retrieval.data import BadImageLog, BadSample
from retrieval.distributed import embed_sharded, every_rank, rank_and_world
from retrieval.inference import Embedded


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
    bad_images: BadImageLog | None = None,
    progress: bool = True,
) -> Embedded:
    """Backbone features of the images that load, read from the cache when ``key`` matches an earlier run.

    The images that failed are cached too (as ``bad``) and go to ``bad_images`` on every read, so a run that reads
    the cache warns, skips or stops exactly as the run that wrote it. Under torch.distributed the ranks extract
    their parts of the data set, every rank gets the merged features and rank 0 writes the cache.
    """
    bad_images = BadImageLog("fail") if bad_images is None else bad_images
    cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = cache_dir / f"{digest}.npz"
    rank, _ = rank_and_world()
    if every_rank(path.is_file(), device):  # a rank that does not see the file yet makes all extract
        with np.load(path) as data:
            features, labels = data["features"], data["labels"]
            # caches written before bad images were skipped hold every image (a bad one stopped those runs)
            indices = data["indices"] if "indices" in data else np.arange(len(features), dtype=np.int64)
            bad = [BadSample(**r) for r in json.loads(str(data["bad"]))] if "bad" in data else []
        bad_images.add(bad)
        return Embedded(features, labels, indices, bad)
    result = embed_sharded(backbone, dataset, batch_size, device, workers, amp, desc, progress, bad_images)
    if rank != 0:
        return result
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, features=result.embeddings, labels=result.labels, indices=result.indices,
             bad=np.array(json.dumps([dataclasses.asdict(b) for b in result.bad])))
    os.replace(tmp, path)
    (cache_dir / f"{digest}.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
    return result
