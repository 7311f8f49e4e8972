"""Where the trainer's inputs come from: cached backbone features (frozen backbone) or images (fine-tuning).

``CachedFeatures`` and ``ImagePipeline`` hold everything that differs between ``--freeze-backbone`` and fine-tuning:
the model's trainable part and train mode, the batches of an epoch, the forward pass, the embedded evaluation split,
the train embeddings of the linear probe and the train sample of the hard-triplet fraction. The trainer picks one
with ``feature_source(cfg)`` and never asks ``freeze_backbone`` again.

With ``--freeze-backbone`` and ``--compatible-with`` an old model that cannot read the cached features (an ONNX file,
another backbone: ``OldModel.embeds_once``), ``CachedFeatures`` also holds the old model's embeddings of the train
and evaluation images (``OldModel.embed_once`` in ``train/compatible.py``: computed once with the old model's own
preprocessing, cached here keyed like the features plus the old model and the image list), and each batch's rows
carry them behind the features' columns.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from retrieval.data import BadImageLog, WithSampleSeeds, build_transforms
from retrieval.data.augment import Augmentation
from retrieval.data.device_decode import DeviceAugment, EncodedImages, collate_encoded, decoded_batches
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.data.transforms import ScaleAndNormalise
from retrieval.distributed import embed_sharded
from retrieval.inference import Embedded, embed_samples, make_loader
from retrieval.metrics.evaluation import EvalSets, embed_eval_rows, eval_arrays
from retrieval.models import Embedder
from retrieval.train.config import TrainConfig
from retrieval.train.feature_cache import cached_features, dataset_key, validation_cache_key

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
        """(embeddings, labels) of the validation split's images that load (held out of train)."""

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
    trains and runs.

    With ``old`` (the old model's cached embeddings, ``OldEmbeddings`` of ``train/compatible.py``), each batch's
    inputs are [B, F + d_old]: row i's features, then the old embedding of the same train image (``forward`` gives
    the head the first F columns, ``OldModel.forward`` takes the last d_old), so the old embeddings stay aligned with
    the batch however the sampler draws it and however the step splits it (--chunks, --nproc)."""

    SAMPLE_SIZE = 2000  # train images of the hard-triplet fraction's sample

    def __init__(self, train: Embedded, query: Embedded, gallery: Embedded | None, labels: np.ndarray,
                 device: torch.device, val: Embedded | None = None, old: Any = None,
                 old_model: nn.Module | None = None) -> None:
        self.train_features = torch.from_numpy(train.embeddings).to(device)
        self.feature_dim = int(self.train_features.shape[1])  # the head reads these columns of a batch
        self.train_feature_indices = train.indices  # the train images that loaded, one per feature row
        # feature row of each train image, -1 where it could not be read (batches then leave it out)
        self.train_feature_row = np.full(len(labels), -1, dtype=np.int64)
        self.train_feature_row[train.indices] = np.arange(len(train.indices))
        self.labels = torch.from_numpy(labels)
        self.eval_features = (query, gallery)
        self.val_features = val
        self.device = device
        # --compatible-with an old model that embedded each image once: its embedding of each feature row's image
        self.old_model = old_model
        self.train_old: torch.Tensor | None = None
        self.old_eval: EvalEmbeddings | None = None
        if old is not None:
            aligned, unread = old.train_rows(train.indices, len(labels))
            self.train_feature_row[unread] = -1  # read by the backbone, not by the old model: left out, as unreadable
            self.train_old = torch.from_numpy(aligned).to(device)
            self.old_eval = old.eval_rows(query, gallery)

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
              embedding: Embedding, val_set: Dataset | None = None, old_model: nn.Module | None = None
              ) -> CachedFeatures:
        """Read the features of the train, validation and evaluation images from the cache, or compute and cache
        them; with ``old_model`` (--compatible-with) that embeds each image once, its embeddings of the train and
        evaluation images too."""
        args = dict(cache_dir=cfg.feature_cache, device=embedding.device, batch_size=embedding.batch_size,
                    workers=embedding.workers, amp=embedding.amp, bad_images=embedding.bad_images,
                    progress=embedding.progress)
        # the train split less its validation part is another set of images: its own cache entry
        held_out = None if val_set is None else validation_cache_key(train_set, val_set, cfg.val_fraction, cfg.seed)
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
        old = None
        if old_model is not None and old_model.embeds_once:  # its embeddings of the same images, cached with them
            old = old_model.embed_once(cfg, model, train_set, eval_sets, held_out, args)
        return cls(train, query, gallery, labels, embedding.device, val, old, old_model)

    def train_mode(self, model: Embedder) -> None:
        model.train()
        model.backbone.eval()

    def batches(self, sampler, epoch: int, start: int) -> Iterator[Batch]:
        sampler.set_epoch(epoch, start)
        for indices in sampler:
            idx = np.asarray(indices, dtype=np.int64)
            rows = self.train_feature_row[idx]
            ok = rows >= 0
            taken = torch.from_numpy(rows[ok])
            inputs = self.train_features[taken]
            if self.train_old is not None:  # each row's old embedding rides behind its features
                inputs = torch.cat([inputs, self.train_old[taken]], dim=1)
            yield inputs, self.labels[torch.from_numpy(idx[ok])], int(np.count_nonzero(~ok))

    def forward(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model.head(inputs[:, :self.feature_dim])  # the features (an old embedding may follow them)

    def _head(self, model: Embedder, features: np.ndarray | torch.Tensor) -> np.ndarray:
        if isinstance(features, np.ndarray):
            features = torch.from_numpy(features).to(self.device)
        return model.head(features).float().cpu().numpy()

    @torch.no_grad()
    def embed_eval(self, model: Embedder) -> EvalEmbeddings:
        if self.old_eval is not None and model is self.old_model:  # the old model's, embedded once and cached
            return self.old_eval
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
              embedding: Embedding, val_set: Dataset | None = None, old_model: nn.Module | None = None
              ) -> ImagePipeline:
        """The images are read batch by batch (``labels`` are the train set's own; ``old_model`` embeds each batch
        as it comes, in the step)."""
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
