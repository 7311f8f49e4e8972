"""Evaluate an embedder on a dataset split: embeddings -> retrieval metrics (used by train and the CLI)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, Subset

from retrieval.data.dataset import BadImageLog
from retrieval.distributed import embed_sharded
from retrieval.errors import ParameterError
from retrieval.records.run_config import RunConfig
from retrieval.rerank import RerankConfig


@dataclass
class EvalSets:
    """Query set and optional separate gallery (In-shop); gallery None = leave-one-out on the query set."""

    query: Dataset
    gallery: Dataset | None = None
    labelled: bool = True  # False: images without labels (training without labels), measured by label-free figures

    @property
    def num_images(self) -> int:
        """Images in the query and gallery sets together."""
        return len(self.query) + (len(self.gallery) if self.gallery is not None else 0)


def checkpoint_dataset(train_config: RunConfig, dataset: str | None, data: str | None,
                       dataset_kwargs: dict[str, Any] | None = None) -> tuple[str, str | None, dict[str, Any]]:
    """(dataset, data, dataset_kwargs): what was given, else what the checkpoint was trained on (its data set's
    options only where the data set is the one it was trained on: another's loader does not take them)."""
    trained = train_config.dataset
    dataset = dataset or trained
    if not dataset:
        raise ParameterError("dataset", "is required: the checkpoint does not record its data set")
    data = data if data is not None else train_config.data
    recorded = (train_config.dataset_kwargs or {}) if dataset == trained else {}
    return dataset, data, {**recorded, **(dataset_kwargs or {})}


def load_eval_sets(dataset: str, root: str | None, split: str, transform, limit: int | None = None,
                   subset_seed: int = 0, **dataset_kwargs: Any) -> EvalSets:
    """The evaluation split (with In-shop's gallery), a ``subset_seed``-ed subset of ``limit`` images where it has
    more; ``dataset_kwargs`` go to the loader (a data set's own ``seed=`` among them)."""
    from retrieval.data import load_dataset

    query = load_dataset(dataset, root, split=split, transform=transform, **dataset_kwargs)
    gallery = None
    if split == "query":  # In-shop: queries are searched against the separate gallery split
        gallery = load_dataset(dataset, root, split="gallery", transform=transform, **dataset_kwargs)
    if limit is not None and len(query) > limit:
        query = seeded_subset(query, limit, subset_seed)
    return EvalSets(query, gallery)


def seeded_subset(dataset: Dataset, size: int, seed: int = 0) -> Subset:
    order = np.random.default_rng(seed).permutation(len(dataset))[:size]
    return Subset(dataset, np.sort(order).tolist())


def metrics_device(device: torch.device | str | None) -> torch.device | None:
    """Where the kNN metrics of embeddings made on ``device`` run: that GPU when it is CUDA, else None (the CPU)."""
    if device is None:
        return None
    device = torch.device(device)
    return device if device.type == "cuda" else None


def evaluate_embeddings(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray | None = None,
                        gallery_labels: np.ndarray | None = None, ks=(1, 2, 4, 8),
                        with_clustering: bool = True, device: torch.device | str | None = None) -> dict[str, float]:
    """Recall@K, MAP@R, R-precision (and NMI, F1 with ``with_clustering``); ``device``: where the kNN runs
    (``retrieval.metrics.evaluate``: None or "cpu", or a CUDA GPU, with the same results)."""
    from retrieval.metrics.ranking import evaluate

    names = ["recall", "map@r", "r_precision"]
    if with_clustering:
        names += ["nmi", "f1"]
    return evaluate(query, query_labels, gallery, gallery_labels, ks=ks, metrics=names, device=device)


def reranked_metrics(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray | None,
                     gallery_labels: np.ndarray | None, config: RerankConfig, ks=(1, 2, 4, 8),
                     device: torch.device | str | None = None) -> dict[str, Any]:
    """The kNN metrics (Recall@K, MAP@R, R-precision) with each query's shortlist re-ranked as a search re-ranks
    it (``retrieval.rerank.rerank_lists`` over its top ``config.candidates``, the rest in their order): a block
    ``{method, title, paper, params, metrics}``. Leave-one-out (gallery None) leaves the query out of its own
    shortlist, as a search from a gallery image does (``exclude_self``). ``device``: where the kNN runs, as in
    ``evaluate_embeddings`` (the re-ranking itself is NumPy on the CPU). The sizes ``config`` leaves unset follow
    the gallery's labels, as a search of an index of these images sets them (``retrieval.rerank.defaults``)."""
    from retrieval.metrics.ranking import evaluate
    from retrieval.rerank import gallery_filled, neighbourhood_from_labels, rerank_lists

    config, defaults = gallery_filled(config, lambda: neighbourhood_from_labels(
        query_labels if gallery_labels is None else gallery_labels))

    def unit(vectors: np.ndarray) -> np.ndarray:
        vectors = np.asarray(vectors, dtype=np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    queries = unit(query)
    stored = queries if gallery is None else unit(gallery)

    def reorder(rows: np.ndarray, lists: np.ndarray) -> np.ndarray:
        return rerank_lists(queries[rows], lists, lambda wanted: stored[wanted], config)[0]

    metrics = evaluate(query, query_labels, gallery, gallery_labels, ks=ks, metrics=["recall", "map@r", "r_precision"],
                       reorder=reorder if config.active else None, min_depth=config.candidates if config.active else 0,
                       device=device)
    return {**config.describe(defaults), "metrics": metrics}


# the sizes ``choose_rerank`` tries for each one left unset: the papers' values and smaller (small classes)
RERANK_CHOICES = {"k": (1, 2, 3, 5, 10), "k1": (3, 5, 8, 12, 20), "k2": (1, 3, 6)}


def choose_rerank(embeddings: np.ndarray, labels: np.ndarray, config: RerankConfig,
                  device: torch.device | str | None = None) -> tuple[RerankConfig, list[dict[str, Any]]]:
    """The neighbourhood sizes ``config`` leaves unset, chosen on a labelled set (validation classes) by its
    leave-one-out MAP@R: each combination of ``RERANK_CHOICES`` (k2 at most k1) is measured, the best kept (a tie:
    the first, the smaller). Returns the chosen config and a row per combination tried, ``{"params", "map@r",
    "recall@1"}``, best first, with a row ``{"params": None, ...}`` for no re-ranking."""
    import itertools

    unset = config.unset()
    plain = leave_one_out_metrics(embeddings, labels, device=device)
    rows = [{"params": None, "map@r": plain["map@r"], "recall@1": plain["recall@1"]}]
    best: tuple[float, RerankConfig] | None = None
    for values in itertools.product(*(RERANK_CHOICES[name] for name in unset)):
        tried = dataclasses.replace(config, **dict(zip(unset, values, strict=True)))
        if tried.method == "kreciprocal" and tried.resolved().k2 > tried.resolved().k1:
            continue
        metrics = reranked_metrics(embeddings, labels, None, None, tried, ks=(1,), device=device)["metrics"]
        rows.append({"params": tried.params(), "map@r": metrics["map@r"], "recall@1": metrics["recall@1"]})
        if best is None or metrics["map@r"] > best[0]:
            best = (metrics["map@r"], tried)
    rows.sort(key=lambda row: -row["map@r"])
    return (config if best is None else best[1]), rows


def leave_one_out_metrics(embeddings: np.ndarray, labels: np.ndarray,
                          device: torch.device | str | None = None) -> dict[str, float]:
    """Recall@K (K = 1, 2, 4, 8 where the set is large enough), MAP@R and R-precision, each image a query
    against all others: the metrics of a validation or out-of-domain set, without the costly clustering;
    ``device`` as in ``evaluate_embeddings``."""
    ks = tuple(k for k in (1, 2, 4, 8) if k < len(labels)) or (1,)
    return evaluate_embeddings(embeddings, labels, ks=ks, with_clustering=False, device=device)


def embed_eval_rows(model: nn.Module, sets: EvalSets, device: torch.device | str, batch_size: int = 128,
                    workers: int | None = None, amp: bool = False, progress: bool = True,
                    bad_images: BadImageLog | None = None):
    """(query, gallery or None) as ``Embedded``: the embeddings, labels and dataset position of every image that
    loads. Under torch.distributed each rank embeds its part and every rank gets all rows, each image once
    (``retrieval.distributed.embed_sharded``; in one process it is ``embed_samples``)."""

    def rows(dataset: Dataset, desc: str):
        return embed_sharded(model, dataset, batch_size, device, workers, amp, desc, progress, bad_images)

    query = rows(sets.query, "embed query")
    return query, (rows(sets.gallery, "embed gallery") if sets.gallery is not None else None)


def eval_arrays(query, gallery) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(query, query_labels, gallery, gallery_labels) of the ``Embedded`` query and gallery (or None)."""
    if gallery is None:
        return query.embeddings, query.labels, None, None
    return query.embeddings, query.labels, gallery.embeddings, gallery.labels


def dataset_image(dataset: Dataset, index: int):
    """The PIL image (no transform) of sample ``index`` of an ``ImageDataset`` or of a ``Subset`` of one."""
    while isinstance(dataset, Subset):
        dataset, index = dataset.dataset, int(dataset.indices[index])
    return dataset.load_image(index)


def row_loader(dataset: Dataset, rows: np.ndarray):
    """``load(row)``: the PIL image of embedding row ``row``, whose dataset position is ``rows[row]``."""
    return lambda row: dataset_image(dataset, int(rows[row]))


def probe_test_labels(test_labels: np.ndarray, test_set: Dataset, train_set: Dataset) -> tuple[np.ndarray, np.ndarray]:
    """(rows kept, labels): the test rows' labels as the train split numbers the same class names, for a classifier
    fitted on the train split (each split numbers its own classes: a class with no test image shifts the test's
    numbers). Rows of a class the train split lacks are left out; where no class is shared, the labels as they are."""
    def names_of(dataset: Dataset) -> list[str]:
        while isinstance(dataset, Subset):
            dataset = dataset.dataset
        return list(dataset.class_names)

    index = {name: i for i, name in enumerate(names_of(train_set))}
    lookup = np.array([index.get(name, -1) for name in names_of(test_set)], dtype=np.int64)
    mapped = lookup[np.asarray(test_labels, dtype=np.int64)]
    keep = mapped >= 0
    if not keep.any():
        return np.ones(len(mapped), dtype=bool), np.asarray(test_labels)
    return keep, mapped[keep]


def present_class_names(dataset: Dataset) -> list[str]:
    """The names of the classes that have at least one sample in ``dataset`` (an ``ImageDataset`` or a
    ``Subset`` of one), in label order."""
    indices = None
    while isinstance(dataset, Subset):
        indices = np.asarray(dataset.indices) if indices is None else np.asarray(dataset.indices)[indices]
        dataset = dataset.dataset
    labels = np.asarray(dataset.labels) if indices is None else np.asarray(dataset.labels)[indices]
    return [dataset.class_names[label] for label in np.unique(labels)]


def class_names(dataset: Dataset) -> list[str]:
    """The class names of an ``ImageDataset`` (or of the one under a ``Subset``), indexed by label."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return list(dataset.class_names)


# --- evaluation beyond the training domain (--eval-extra) -----------------------------------------------------
EXTRA_SPLIT_SEED = 0  # every run splits an extra set the same way, so runs compare on the same images
EXTRA_LAYOUT = "a registered data set name (NAME or NAME:SPLIT, default split test) or an image folder (folder/CLASS/*)"


@dataclass
class ExtraSet:
    """An out-of-domain set: ``test`` is reported at every evaluation, ``val`` (the other images of the same
    classes) chooses WiSE-FT's mixing weight without looking at ``test``."""

    name: str
    source: str  # the folder (resolved) or NAME:SPLIT it was read from
    val: Dataset
    test: Dataset


def extra_set_name(spec: str) -> str:
    """The name an extra set is reported under: the data set (and split) or the folder's name."""
    from pathlib import Path

    path = Path(spec).expanduser()
    name = path.name or str(path) if path.is_dir() else spec
    return name.replace(": ", " ")  # the app names a set's rows "SET: metric"


def load_extra_set(spec: str, transform, limit: int | None = None) -> ExtraSet:
    """An ``--eval-extra`` set, split per class into alternating halves (val, test), at most ``limit`` images in all.

    ``spec`` is a folder of class sub-folders, or a registered data set ``NAME`` / ``NAME:SPLIT`` (default split
    ``test``). Classes with fewer than 4 images are left out: each half needs 2 for leave-one-out Recall@1. The
    limit takes the same number of images from every class, at least 4 (so a set of many classes may exceed it)."""
    from pathlib import Path

    from retrieval.data import load_dataset
    from retrieval.data.catalog import DATASETS
    from retrieval.data.dataset import ImageDataset
    from retrieval.data.official import scan_class_folders

    path = Path(spec).expanduser()
    if path.is_dir():
        samples, names = scan_class_folders(path)
        dataset = ImageDataset.from_class_names(samples, names, transform)
        source = str(path.resolve())
    else:
        name, _, split = spec.partition(":")
        if name not in DATASETS.names():
            raise ParameterError("spec", f"{spec!r}: no such folder and no registered data set {name!r}; give "
                                         f"{EXTRA_LAYOUT}; data sets: {', '.join(DATASETS.names())}")
        try:
            dataset = load_dataset(name, None, split=split or "test", transform=transform)
        except (FileNotFoundError, ValueError) as exc:
            raise ParameterError("spec", f"{spec!r}: {exc}. A registered set given by name is read from its own "
                                         "place (fashion-mnist, digits, emoji are); for another, give its image "
                                         "folder") from None
        source = f"{name}:{split or 'test'}"
    labels = np.asarray(dataset.labels)
    rng = np.random.default_rng(EXTRA_SPLIT_SEED)
    per_class = {c: rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)}
    per_class = {c: idx for c, idx in per_class.items() if len(idx) >= 4}
    if len(per_class) < 2:
        raise ParameterError("spec", f"{spec!r}: needs at least 2 classes with 4 or more images each "
                                     f"(found {len(per_class)}); give {EXTRA_LAYOUT}")
    if limit is not None:  # the same number of images from every class, as far as the limit allows
        keep = max(4, limit // len(per_class))
        per_class = {c: idx[:keep] for c, idx in per_class.items()}
    val = np.sort(np.concatenate([idx[0::2] for idx in per_class.values()]))
    test = np.sort(np.concatenate([idx[1::2] for idx in per_class.values()]))
    return ExtraSet(extra_set_name(spec), source, dataset.subset(val.tolist()), dataset.subset(test.tolist()))

