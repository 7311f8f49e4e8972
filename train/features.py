"""Where the trainer's inputs come from: cached backbone features (frozen backbone) or images (fine-tuning).

``CachedFeatures`` and ``ImagePipeline`` hold everything that differs between ``--freeze-backbone`` and fine-tuning:
the model's trainable part and train mode, the batches of an epoch, the forward pass, the embedded evaluation split,
the train embeddings of the linear probe and the train sample of the hard-triplet fraction. The trainer picks one
with ``feature_source(cfg)`` and never asks ``freeze_backbone`` again.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from retrieval.data import BadImageLog, BadSample, WithSampleSeeds, build_transforms
from retrieval.data.augment import Augmentation
from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.data.device_decode import DeviceAugment, EncodedImages, collate_encoded, decoded_batches
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.data.resize_modes import CROP
from retrieval.data.transforms import ScaleAndNormalise
from retrieval.distributed import embed_sharded, every_rank, rank_and_world
from retrieval.inference import Embedded, embed_samples, make_loader
from retrieval.metrics.evaluation import EvalSets, embed_eval_rows, eval_arrays, present_class_names
from retrieval.models import Embedder
from retrieval.train.config import TrainConfig
from retrieval.utils.io import atomic_write

Batch = tuple[torch.Tensor, torch.Tensor, int]  # (inputs, labels, images of the batch that could not be read)
EvalEmbeddings = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


@dataclasses.dataclass
class Embedding:
    """How a source embeds a whole split: device, batch size, workers, autocast, progress bars, unreadable images."""

    device: torch.device
    batch_size: int
    workers: int | None
    amp: bool
    progress: bool
    bad_images: BadImageLog


class FeatureSource(Protocol):
    """The inputs of one training run and how the model turns them into embeddings."""

    def train_mode(self, model: Embedder) -> None:
        """Put the model in training mode (the parts that train)."""

    def batches(self, sampler, epoch: int, start: int) -> Iterator[Batch]:
        """The batches of ``epoch`` from the sampler's batch ``start`` on."""

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        """Embeddings [B, D] of one batch of inputs."""

    def embed_eval(self, model: Embedder) -> EvalEmbeddings:
        """(query, query_labels, gallery, gallery_labels) embeddings of the evaluation split."""

    def eval_indices(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The dataset position of each row ``embed_eval`` returned (query, gallery or None)."""

    def embed_val(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings, labels) of the validation split's images that load (the held-out train classes)."""

    def train_embeddings(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        """(embeddings [n, D], train image index of each row) of every train image that loads, without augmentation."""

    def train_sample(self, model: Embedder, seed: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(embeddings, train image index of each row) of a fixed train subset; None when too costly to embed."""

    def embed_train_subset(self, model: Embedder, subset: Dataset, head: bool = True) -> Embedded:
        """The train images of ``subset`` (the train set, or a ``Subset`` of it), unaugmented, by ``model`` (its
        backbone's pooled features where ``head`` is False); ``indices``: each row's position in ``subset``."""

    def close(self) -> None:
        """Training is over: let go of what only the epochs needed (data workers)."""


def normalises_on_arrival(device: torch.device | None) -> bool:
    """Whether the train workers hand over uint8 pixels for ``device`` to scale and normalise: on a GPU, where that
    is free and the batches crossing from the workers and to the GPU are a quarter of the bytes. On the CPU the
    workers do it, in parallel, instead of the training process."""
    return device is not None and device.type == "cuda"


def feature_source_class(cfg: TrainConfig) -> type[CachedFeatures] | type[ImagePipeline]:
    """The feature source a configuration trains from: the one place that reads ``freeze_backbone``."""
    return CachedFeatures if cfg.freeze_backbone else ImagePipeline


class CachedFeatures:
    """--freeze-backbone: the backbone's features of every image, computed once (and cached on disk); only the head
    trains and runs."""

    SAMPLE_SIZE = 2000  # train images of the hard-triplet fraction's sample

    def __init__(self, train: Embedded, query: Embedded, gallery: Embedded | None, labels: np.ndarray,
                 device: torch.device, val: Embedded | None = None) -> None:
        self.train_features = torch.from_numpy(train.embeddings).to(device)
        self.train_feature_indices = train.indices  # the train images that loaded, one per feature row
        # feature row of each train image, -1 where it could not be read (batches then leave it out)
        self.train_feature_row = np.full(len(labels), -1, dtype=np.int64)
        self.train_feature_row[train.indices] = np.arange(len(train.indices))
        self.labels = torch.from_numpy(labels)
        self.eval_features = (query, gallery)
        self.val_features = val
        self.device = device

    @staticmethod
    def prepare_model(model: Embedder) -> None:
        """Freeze the backbone: its features are computed once."""
        for p in model.backbone.parameters():
            p.requires_grad_(False)

    @staticmethod
    def train_transform(preprocessing: ModelPreprocessing, augmentation: Augmentation,
                        device: torch.device | None = None):
        """The features are cached once, so the train images are not augmented (``augmentation`` is unused:
        ``TrainConfig.validate`` refuses one that would augment; ``device`` is unused too)."""
        return build_transforms(preprocessing, train=False)

    @classmethod
    def build(cls, cfg: TrainConfig, model: Embedder, train_set: Dataset, labels: np.ndarray, eval_sets: EvalSets,
              embedding: Embedding, val_set: Dataset | None = None) -> CachedFeatures:
        """Read the features of the train, validation and evaluation images from the cache, or compute and cache
        them."""
        args = dict(cache_dir=cfg.feature_cache, device=embedding.device, batch_size=embedding.batch_size,
                    workers=embedding.workers, amp=embedding.amp, bad_images=embedding.bad_images,
                    progress=embedding.progress)
        # the train split less the validation classes is another set of images: its own cache entry
        held_out = None if val_set is None else present_class_names(val_set)
        # without labels the train split is other images (a folder read at any depth) or other labels (each image its
        # own class): its own cache entry, so that --eval-split train reads the labelled one
        train = cached_features(model.backbone, train_set,
                                dataset_key(cfg, model, "train", held_out, unlabelled=cfg.labels == "none"),
                                desc="features train", **args)
        val = None
        if val_set is not None:
            val = cached_features(model.backbone, val_set, dataset_key(cfg, model, "val", held_out),
                                  desc="features val", **args)
        query = cached_features(model.backbone, eval_sets.query, dataset_key(cfg, model, cfg.eval_split),
                                desc="features query", **args)
        gallery = None
        if eval_sets.gallery is not None:
            gallery = cached_features(model.backbone, eval_sets.gallery, dataset_key(cfg, model, "gallery"),
                                      desc="features gallery", **args)
        return cls(train, query, gallery, labels, embedding.device, val)

    def train_mode(self, model: Embedder) -> None:
        model.train()
        model.backbone.eval()

    def batches(self, sampler, epoch: int, start: int) -> Iterator[Batch]:
        sampler.set_epoch(epoch, start)
        for indices in sampler:
            idx = np.asarray(indices, dtype=np.int64)
            rows = self.train_feature_row[idx]
            ok = rows >= 0
            yield (self.train_features[torch.from_numpy(rows[ok])], self.labels[torch.from_numpy(idx[ok])],
                   int(np.count_nonzero(~ok)))

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model.head(inputs)

    def _head(self, model: Embedder, features: np.ndarray | torch.Tensor) -> np.ndarray:
        if isinstance(features, np.ndarray):
            features = torch.from_numpy(features).to(self.device)
        return model.head(features).float().cpu().numpy()

    @torch.no_grad()
    def embed_eval(self, model: Embedder) -> EvalEmbeddings:
        model.head.eval()
        query, gallery = self.eval_features
        if gallery is None:
            return self._head(model, query.embeddings), query.labels, None, None
        return (self._head(model, query.embeddings), query.labels, self._head(model, gallery.embeddings),
                gallery.labels)

    def eval_indices(self) -> tuple[np.ndarray, np.ndarray | None]:
        query, gallery = self.eval_features
        return query.indices, gallery.indices if gallery is not None else None

    @torch.no_grad()
    def embed_val(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        model.head.eval()
        return self._head(model, self.val_features.embeddings), self.val_features.labels

    @torch.no_grad()
    def train_embeddings(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        model.head.eval()
        return self._head(model, self.train_features), self.train_feature_indices

    @torch.no_grad()
    def train_sample(self, model: Embedder, seed: int) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.train_feature_indices)  # the train images that could be read
        idx = np.sort(np.random.default_rng(seed).permutation(n)[: min(n, self.SAMPLE_SIZE)])
        model.head.eval()
        return self._head(model, self.train_features[torch.from_numpy(idx)]), self.train_feature_indices[idx]

    @torch.no_grad()
    def embed_train_subset(self, model: Embedder, subset: Dataset, head: bool = True) -> Embedded:
        """The train images of ``subset`` (the train set, or a ``Subset`` of it by train position) from the cached
        features: through ``model``'s head, or the backbone's features themselves (``head`` False); each row labelled
        by its train position, ``indices`` its position in ``subset``."""
        positions = np.asarray(subset.indices if isinstance(subset, Subset) else np.arange(len(subset)),
                               dtype=np.int64)
        rows = self.train_feature_row[positions]
        loaded = np.flatnonzero(rows >= 0)
        features = self.train_features[torch.from_numpy(rows[loaded])]
        if head:
            model.head.eval()
            embeddings = self._head(model, features)
        else:
            embeddings = features.float().cpu().numpy()
        return Embedded(embeddings, positions[loaded], loaded.astype(np.int64), [])

    def close(self) -> None:
        pass  # nothing outlives an epoch


class ImagePipeline:
    """Fine-tuning: augmented train images through the whole model; the evaluation split embedded image by image."""

    def __init__(self, cfg: TrainConfig, train_set: Dataset, eval_sets: EvalSets, embedding: Embedding,
                 preprocessing: ModelPreprocessing, val_set: Dataset | None = None) -> None:
        self._eval_indices: tuple[np.ndarray, np.ndarray | None] = (np.zeros(0, np.int64), None)
        self.cfg = cfg
        self.train_set = train_set
        self.eval_sets = eval_sets
        self.val_set = val_set
        self.embedding = embedding
        self.on_device: DeviceAugment | None = None  # --decode-on device: the workers hand over JPEG bytes
        self.on_arrival: ScaleAndNormalise | None = None  # the workers hand over uint8 pixels (train_transform)
        self._train_loader: DataLoader | None = None
        if cfg.decode_on == "workers" and normalises_on_arrival(embedding.device):
            self.on_arrival = ScaleAndNormalise(preprocessing, embedding.device)
        if cfg.decode_on == "device":
            augmentation = cfg.augmentation()
            self.on_device = DeviceAugment(preprocessing, augmentation, embedding.device, dataset=train_set)
            self.encoded = EncodedImages(train_set, preprocessing, augmentation)

    @staticmethod
    def prepare_model(model: Embedder) -> None:
        """Every part of the model trains."""

    @staticmethod
    def train_transform(preprocessing: ModelPreprocessing, augmentation: Augmentation,
                        device: torch.device | None = None):
        """The augmenting train pipeline; uint8 pixels where the ``device`` scales and normalises them."""
        return build_transforms(preprocessing, train=True, augmentation=augmentation,
                                normalise=not normalises_on_arrival(device))

    @classmethod
    def build(cls, cfg: TrainConfig, model: Embedder, train_set: Dataset, labels: np.ndarray, eval_sets: EvalSets,
              embedding: Embedding, val_set: Dataset | None = None) -> ImagePipeline:
        """The images are read batch by batch (``labels`` are the train set's own)."""
        return cls(cfg, train_set, eval_sets, embedding, model.preprocessing, val_set)

    def train_mode(self, model: Embedder) -> None:
        model.train()

    def batches(self, sampler, epoch: int, start: int) -> Iterator[Batch]:
        sampler.set_epoch(epoch, start)
        try:
            yield from self._epoch(self._loader(sampler))
        except BaseException:  # an epoch left half-way (GeneratorExit too): the next starts from new workers
            self.close()
            raise

    def _epoch(self, loader: DataLoader) -> Iterator[Batch]:
        run = self.embedding
        if self.on_device is None:
            for batch in loader:
                run.bad_images.add(batch.bad)
                inputs = batch.inputs
                if self.on_arrival is not None and inputs is not None:
                    if inputs.dtype != torch.uint8:  # normalised twice otherwise
                        raise TypeError(f"the train images arrive as {inputs.dtype}, not uint8 pixels: build the "
                                        "train set's transform with ImagePipeline.train_transform(preprocessing, "
                                        "augmentation, device)")
                    inputs = self.on_arrival(inputs.to(run.device, non_blocking=True))
                yield inputs, batch.labels, len(batch.bad)
            return
        for batch, done in decoded_batches(loader, self.on_device):
            run.bad_images.add(batch.bad)
            if done is None:
                yield None, None, len(batch.bad)
                continue
            images, labels, failed = done  # failed: JPEG files damaged past their header
            run.bad_images.add(failed)
            yield images, labels, len(batch.bad) + len(failed)

    def _loader(self, sampler) -> DataLoader:
        """The train loader, made once: its workers live from epoch to epoch (the sampler is read at each epoch's
        start), so an epoch does not wait for new workers to start."""
        if self._train_loader is None or self._train_loader.batch_sampler.sampler is not sampler:
            run = self.embedding
            # per-sample seeds: augmentation does not depend on the workers or on where a run resumed; the own
            # generator keeps the DataLoader from drawing on the global RNG that the checkpoints save
            dataset, collate = (self.train_set, {}) if self.on_device is None else \
                (self.encoded, {"collate_fn": collate_encoded})
            self._train_loader = make_loader(
                dataset, None, run.workers, run.device, batch_sampler=WithSampleSeeds(sampler),
                generator=torch.Generator().manual_seed(self.cfg.seed * 1000), persistent=True, **collate)
        return self._train_loader

    def close(self) -> None:
        self._train_loader = None  # its workers stop

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs)

    @torch.no_grad()
    def embed_eval(self, model: Embedder) -> EvalEmbeddings:
        run = self.embedding
        query, gallery = embed_eval_rows(model, self.eval_sets, run.device, run.batch_size, run.workers, run.amp,
                                         run.progress, bad_images=run.bad_images)
        self._eval_indices = (query.indices, gallery.indices if gallery is not None else None)
        return eval_arrays(query, gallery)

    def eval_indices(self) -> tuple[np.ndarray, np.ndarray | None]:
        return self._eval_indices

    @torch.no_grad()
    def embed_val(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        run = self.embedding
        embedded = embed_sharded(model, self.val_set, run.batch_size, run.device, run.workers, run.amp, "embed val",
                                 run.progress, run.bad_images)
        return embedded.embeddings, embedded.labels

    @torch.no_grad()
    def train_embeddings(self, model: Embedder) -> tuple[np.ndarray, np.ndarray]:
        run = self.embedding
        plain = copy.copy(self.train_set)  # the run's train images (less any validation classes), unaugmented
        plain.transform = build_transforms(model.preprocessing, train=False)
        embedded = embed_samples(model, plain, run.batch_size, run.device, run.workers, run.amp, desc="embed train",
                                 progress=run.progress, bad_images=run.bad_images)
        return embedded.embeddings, embedded.indices

    def train_sample(self, model: Embedder, seed: int) -> None:
        return None  # embedding train images again every epoch costs as much as the evaluation

    @torch.no_grad()
    def embed_train_subset(self, model: Embedder, subset: Dataset, head: bool = True) -> Embedded:
        run = self.embedding
        return embed_sharded(model if head else model.backbone, subset, run.batch_size, run.device, run.workers,
                             run.amp, "embed images" if head else "embed images (pretrained)", run.progress,
                             run.bad_images)


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
