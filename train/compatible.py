"""``--compatible-with OLD``: the frozen old model a new one is trained to stay comparable with (BCT), and the
model hashes the new model then declares itself compatible with (``retrieval export`` writes them into the ONNX
metadata, where ``retrieval index upgrade``, search and serve read them).

OLD is a checkpoint of ours or an exported ONNX file. Fine-tuning, it embeds each training batch as the new model
sees it: the batch's pixels, taken back from the new model's normalisation and resized to the old model's input size
and normalisation where they differ. With ``--freeze-backbone`` the new model trains on cached backbone features,
and OLD takes one of two ways, chosen here (``reads_features`` or ``embeds_once``):

- a checkpoint of the very backbone this run froze (the same weights and preprocessing: the old run's head trained
  on the same features) embeds the cached features with its head;
- any other (an ONNX file, as ``retrieval export --pretrained`` writes one; a checkpoint of another backbone or of a
  fine-tuned one, or of another input size or resize mode) embeds each train and evaluation image once, as it sees
  the image (its own preprocessing, ``images``), into the feature cache beside the features (``embed_once``:
  ``OldEmbeddings``, keyed as the features are plus its identity and the image list). ``CachedFeatures`` then puts
  each train image's old embedding behind its features' columns in the batches, and ``forward`` takes it from
  there: no old model runs during the steps.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset, Subset

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.inference import Embedded
from retrieval.losses.compatible import CompatibilityInfluence
from retrieval.train.feature_cache import cached_features, dataset_key

INFLUENCE_FALLBACK = "ms"  # the influence's pair loss when the training loss has no query x gallery form


class OldModel(nn.Module):
    """Embeds a batch with the frozen old model: ``forward(inputs)`` -> float32 [B, d_old], no gradient."""

    def __init__(self, path: str | Path, new: ModelPreprocessing, features: bool = False,
                 device: torch.device | str = "cpu", backbone: nn.Module | None = None) -> None:
        """``new``: the new model's preprocessing, which the batches are normalised with; ``features``: the batches
        are cached features of ``backbone``, this run's frozen backbone (--freeze-backbone)."""
        super().__init__()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"the old model {self.path} does not exist (a checkpoint .pt or an .onnx file)")
        self.new = new
        self.onnx = None
        self.model = None
        device = torch.device(device)
        if self.path.suffix == ".onnx":
            from retrieval.onnx_runtime import OnnxEmbedder

            self.onnx = OnnxEmbedder(self.path, providers="auto" if device.type == "cuda" else "cpu")
            self.preprocessing = self.onnx.preprocessing
            # every hash an index of it may record (hash_matches), and its PyTorch weights'
            self.hashes = sorted({*self.onnx.model_hashes, self.onnx.source_model_hash})
        else:
            from retrieval.models.embedder import load_embedder
            from retrieval.onnx_runtime import embedder_model_hash

            self.model = load_embedder(self.path).to(device).eval()
            for parameter in self.model.parameters():
                parameter.requires_grad_(False)
            self.preprocessing = self.model.preprocessing
            self.hashes = [embedder_model_hash(self.model)]
        # --freeze-backbone: the old head reads this run's cached features where they are its own backbone's, else
        # the old model embeds each image once and the feature source caches its embeddings (the module's docstring)
        self.reads_features = features and self.model is not None and backbone is not None and \
            reads_the_features(self.model, backbone, new)
        self.embeds_once = features and not self.reads_features

    @property
    def eval_model(self) -> nn.Module:
        """What embeds the evaluation split as the old model did: its Embedder on cached features (the feature
        source runs its head); this module, for the feature source to answer with the old embeddings it cached
        (``embeds_once``), or to embed the split's pixels adapted to the old model."""
        return self.model if self.reads_features else self

    @property
    def embedding_dim(self) -> int:
        return int(self.preprocessing.embedding_dim)  # type: ignore[arg-type]  (a model's files record it)

    def identity(self) -> dict[str, Any]:
        """What the old model's embeddings of an image depend on, for their cache key: its hashes (weights and
        graph) and its preprocessing."""
        return {"hashes": list(self.hashes), "preprocessing": self.preprocessing.to_config()}

    def images(self, dataset: Dataset) -> Dataset:
        """``dataset``'s images as the old model sees them: its own evaluation preprocessing (input size, resize
        mode, background, normalisation, read from its checkpoint or ONNX metadata), positions unchanged."""
        from retrieval.data import build_transforms

        return with_transform(dataset, build_transforms(self.preprocessing, train=False))

    @property
    def image_embedder(self) -> nn.Module:
        """The old model on batches of ``images``: [B, 3, S, S] in its own preprocessing -> [B, d_old]."""
        return self.model if self.onnx is None else OnnxOnImages(self.onnx)

    def embed_once(self, cfg: Any, model: nn.Module, train_set: Dataset, eval_sets: Any, held_out: Any,
                   cache: Mapping[str, Any]) -> OldEmbeddings:
        """``embeds_once``: the old model's embeddings of the train and evaluation images, read from the feature
        cache or embedded once (as it sees each image) and cached. The key is the features' key of the same split
        (``dataset_key``: the data set, the split, ``held_out``, ...) plus the old model's ``identity``, and, as for
        every cached split of image files, their list: another old model, another preprocessing or other images
        embed again.
        ``cache``: ``cached_features``' keywords (folder, device, batch size, workers, ...)."""
        embedder = self.image_embedder

        def embedded(dataset: Dataset, key: dict, name: str) -> Embedded:
            key = {**key, "old_model": self.identity()}  # cached_features adds the files' list
            return cached_features(embedder, self.images(dataset), key, desc=f"old model {name}", **cache)

        train = embedded(train_set, dataset_key(cfg, model, "train", held_out, unlabelled=cfg.labels == "none"),
                         "train")
        query = embedded(eval_sets.query, dataset_key(cfg, model, cfg.eval_split), "query")
        gallery = None
        if eval_sets.gallery is not None:
            gallery = embedded(eval_sets.gallery, dataset_key(cfg, model, "gallery"), "gallery")
        return OldEmbeddings(train, query, gallery)

    def train(self, mode: bool = True) -> OldModel:
        return super().train(False)  # frozen: BatchNorm and dropout stay in eval mode

    @torch.no_grad()
    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.embeds_once:  # the batch's cached features, each row followed by its image's old embedding
            d = self.embedding_dim
            if inputs.dim() != 2 or inputs.shape[1] <= d:
                raise ValueError(f"expected cached features followed by the old model's {d}-d embeddings, got a "
                                 f"batch of shape {tuple(inputs.shape)}")
            return inputs[:, -d:].float()
        if self.reads_features:
            return self.model.head(inputs).float()
        pixels = self._as_old_input(inputs.float())
        if self.onnx is not None:
            return torch.from_numpy(np.asarray(self.onnx.embed_batch(pixels.cpu().numpy()))).to(inputs.device).float()
        return self.model(pixels).float()

    def _as_old_input(self, inputs: torch.Tensor) -> torch.Tensor:
        """The new model's normalised batch as the old model's input (size and normalisation)."""
        new, old = self.new, self.preprocessing
        if (new.mean, new.std, new.input_size) == (old.mean, old.std, old.input_size):
            return inputs
        shape = (1, 3, 1, 1)
        pixels = inputs * torch.tensor(new.std, device=inputs.device).view(shape) + \
            torch.tensor(new.mean, device=inputs.device).view(shape)
        size = old.input_size
        if pixels.shape[-1] != size:
            pixels = functional.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True,
                                            align_corners=False)
        return (pixels - torch.tensor(old.mean, device=inputs.device).view(shape)) / \
            torch.tensor(old.std, device=inputs.device).view(shape)


@dataclasses.dataclass
class OldEmbeddings:
    """The old model's embeddings of the train and evaluation images (``OldModel.embed_once``), each ``Embedded``
    by dataset position (``indices``), as ``cached_features`` gives the backbone's features; ``train_rows`` and
    ``eval_rows`` line them up with the features' rows."""

    train: Embedded
    query: Embedded
    gallery: Embedded | None

    def train_rows(self, positions: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        """(the old embedding of the train image at each of ``positions`` (the feature rows' images, of a train
        set of ``size``), zeros where the old model could not read it; those positions)."""
        rows = rows_by_position(self.train, size)[positions]
        aligned = np.zeros((len(positions), self.train.embeddings.shape[1]), dtype=np.float32)
        aligned[rows >= 0] = self.train.embeddings[rows[rows >= 0]]
        return aligned, positions[rows < 0]

    def eval_rows(self, query: Embedded, gallery: Embedded | None) -> tuple:
        """(query, query labels, gallery, gallery labels) of the old model, row for row the features' ``query`` and
        ``gallery`` (the feature source's ``embed_eval``)."""
        return (_rows_of(query, self.query, "query"), query.labels,
                None if gallery is None else _rows_of(gallery, self.gallery, "gallery"),
                None if gallery is None else gallery.labels)


def rows_by_position(embedded: Embedded, size: int) -> np.ndarray:
    """The row of ``embedded`` that holds each of a data set's ``size`` positions, -1 where that image did not
    load."""
    rows = np.full(size, -1, dtype=np.int64)
    rows[embedded.indices] = np.arange(len(embedded.indices))
    return rows


def _rows_of(features: Embedded, old: Embedded, split: str) -> np.ndarray:
    """The old embedding of each of an evaluation split's feature rows' images (the same dataset position)."""
    size = int(max(features.indices.max(initial=-1), old.indices.max(initial=-1))) + 1
    rows = rows_by_position(old, size)[features.indices]
    if (rows < 0).any():
        first = int(features.indices[np.flatnonzero(rows < 0)[0]])
        raise ValueError(f"the old model (--compatible-with) could not read {int((rows < 0).sum())} image(s) of the "
                         f"{split} split that the backbone read (the first at position {first}): its cross-model "
                         "evaluation needs both models' embeddings of every image")
    return old.embeddings[rows]


class OnnxOnImages(nn.Module):
    """An ONNX embedder as a module over preprocessed batches (for ``embed_samples``): [B, 3, S, S] -> [B, d]."""

    def __init__(self, onnx: Any) -> None:
        super().__init__()
        self.onnx = onnx

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.onnx.embed_batch(pixels.float()))).to(pixels.device)


def reads_the_features(old: nn.Module, backbone: nn.Module, new: ModelPreprocessing) -> bool:
    """Whether the old checkpoint's head embeds this run's cached features exactly as the old model embeds the
    images: its backbone has the frozen backbone's weights (and buffers), and it prepares images the same way."""
    same = ("backbone", "input_size", "mean", "std", "background", "resize_mode")
    if any(getattr(old.preprocessing, name) != getattr(new, name) for name in same):
        return False
    old_state, frozen = old.backbone.state_dict(), backbone.state_dict()
    return old_state.keys() == frozen.keys() and all(
        old_state[name].shape == frozen[name].shape and torch.equal(old_state[name].cpu(), frozen[name].cpu())
        for name in old_state)


def with_transform(dataset: Dataset, transform: Any) -> Dataset:
    """A view of ``dataset`` (or of a ``Subset`` of one) whose images go through ``transform``; the same images at
    the same positions."""
    if isinstance(dataset, Subset):
        return Subset(with_transform(dataset.dataset, transform), dataset.indices)
    view = copy.copy(dataset)
    view.transform = transform
    return view


def build_influence(loss_name: str, loss_kwargs: Mapping[str, Any], weight: float, device: torch.device | str
                    ) -> tuple[CompatibilityInfluence, str]:
    """The influence term on the training loss where it has the query x gallery form, else on ``ms``; with the
    name of the loss it uses."""
    from retrieval import losses

    loss = losses.build(loss_name, **dict(loss_kwargs)) if not losses.needs_classes(loss_name) else None
    name = loss_name
    if loss is None or not getattr(loss, "rectangular", False):
        loss, name = losses.build(INFLUENCE_FALLBACK), INFLUENCE_FALLBACK
    return CompatibilityInfluence(loss, weight).to(device), name
