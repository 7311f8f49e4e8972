"""The frozen-backbone feature cache: what a split's features depend on (``dataset_key``, with the validation split's
part in it), where they are kept, and ``cached_features``, which reads them or computes and writes them. A split of
image files is keyed by its image list too (each file's path, size and modification time), so that a folder that
changed is embedded again instead of read back misaligned with its labels."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from retrieval.data import BadImageLog, BadSample
from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.data.resize_modes import CROP
from retrieval.distributed import embed_sharded, every_rank, rank_and_world
from retrieval.inference import Embedded
from retrieval.metrics.evaluation import present_class_names
from retrieval.models import Embedder
from retrieval.train.config import DEFAULT_VAL_FRACTION, TrainConfig
from retrieval.utils.io import atomic_write


def dataset_samples(dataset: Dataset) -> list | None:
    """The samples (paths or in-memory images) of ``dataset`` in position order, through ``Subset``s; None for a
    data set that does not list them."""
    if isinstance(dataset, Subset):
        inner = dataset_samples(dataset.dataset)
        return None if inner is None else [inner[int(i)] for i in dataset.indices]
    samples = getattr(dataset, "samples", None)
    return None if samples is None else list(samples)


def image_list_digest(dataset: Dataset) -> str:
    """The images of ``dataset``, in order, as a digest: each file's absolute path, size and modification time, each
    in-memory image's pixels. A cache keyed by it is made again when the image list changes, or an image in it."""
    digest = hashlib.sha256()
    samples = dataset_samples(dataset)
    if samples is None:  # what can be known: how many
        digest.update(f"{type(dataset).__name__}:{len(dataset)}".encode())
        return digest.hexdigest()[:20]
    for sample in samples:
        if isinstance(sample, np.ndarray):
            digest.update(f"array:{sample.shape}:{sample.dtype}:".encode())
            digest.update(np.ascontiguousarray(sample).tobytes())
        else:
            path = os.path.abspath(os.fspath(sample))
            try:
                stat = os.stat(path)
                digest.update(f"file:{path}:{stat.st_size}:{stat.st_mtime_ns}\n".encode())
            except OSError:  # unreadable now: it fails the same way when read
                digest.update(f"missing:{path}\n".encode())
    return digest.hexdigest()[:20]



def validation_cache_key(train_set: Dataset, val_set: Dataset, fraction: float | None, seed: int) -> list[str]:
    """What tells one validation split from another in the feature cache's keys: its classes where it holds whole
    classes out; else the share and seed that chose its images (the data set's key names the images)."""
    held = present_class_names(val_set)
    if not set(held) & set(present_class_names(train_set)):
        return held
    return [f"images: {DEFAULT_VAL_FRACTION if fraction is None else fraction} of each class, seed {seed}"]


def dataset_key(cfg: TrainConfig, model: Embedder, split: str, held_out: list[str] | None = None,
                unlabelled: bool = False) -> dict:
    """What the backbone features of ``split`` depend on: the cache key; ``held_out``: the train classes the
    validation split took (train and val only); ``unlabelled``: the train images as --labels none reads them."""
    preprocessing = model.preprocessing
    return {
        "backbone": cfg.backbone, "pretrained": cfg.pretrained, "weights": cfg.weights,
        "input_size": preprocessing.input_size, "dataset": cfg.dataset,
        "data": str(Path(cfg.data).resolve()) if cfg.data else None, "dataset_kwargs": cfg.dataset_kwargs,
        "split": split, "eval_limit": cfg.eval_limit if split not in ("train", "val") else None,
        # features do not depend on the seed, only the seeded --eval-limit subset does: seeds share a cache
        "seed": cfg.seed if cfg.eval_limit and split not in ("train", "val") else None,
        # fp16 features differ
        "amp": bool(cfg.amp not in (False, "off") and torch.cuda.is_available() and cfg.device != "cpu"),
        # only transparent images depend on it; keys made before it was recorded stay valid for the default
        **({"background": list(preprocessing.background)}
           if preprocessing.background != DEFAULT_BACKGROUND else {}),
        # only where a validation split was carved: the keys of runs without one stay valid
        **({"held_out": held_out} if held_out is not None else {}),
        **({"labels": "none"} if unlabelled else {}),
        # a letterboxing model's features are of other pixels; cropping keys stay valid
        **({"resize": preprocessing.resize_mode} if preprocessing.resize_mode != CROP else {}),
    }


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
    if any(not isinstance(sample, np.ndarray) for sample in dataset_samples(dataset) or []):
        # files: a folder that gained, lost or changed an image is other images (the key names only the folder)
        key = {**key, "images": image_list_digest(dataset)}
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

    def write(tmp: Path) -> None:
        with tmp.open("wb") as handle:  # a file, not a name: np.savez would append ".npz" to the name
            np.savez(handle, features=result.embeddings, labels=result.labels, indices=result.indices,
                     bad=np.array(json.dumps([dataclasses.asdict(b) for b in result.bad])))

    atomic_write(path, write)
    (cache_dir / f"{digest}.json").write_text(json.dumps(key, indent=1, sort_keys=True, default=str))
    return result
