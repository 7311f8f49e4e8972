"""The run's data (``TrainData``): the train split less its validation part, with any label noise, the
evaluation split and the out-of-domain sets, each with the transform the model wants."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch.utils.data import Dataset, Subset

from retrieval.data import ImageDataset, asymmetric_transitions, build_transforms, inject_label_noise, load_dataset
from retrieval.data.dataset import held_out_per_class
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.errors import parameters_named
from retrieval.metrics.evaluation import EvalSets, load_eval_sets, load_extra_set, present_class_names, seeded_subset
from retrieval.train.config import DEFAULT_VAL_FRACTION, DEFAULT_VAL_MIN_CLASSES, TrainConfig
from retrieval.train.state import TrainData

OWN_IMAGES = ("folder",)  # --labels none reads its --data as images only, at any depth
VAL_IMAGES_PER_CLASS = 2  # a validation class's images at least (each needs another to find), and left to train
UNLABELLED_EVAL_IMAGES = 2000  # without labels, the label-free figures are measured on this many of the images


def load_train_data(cfg: TrainConfig, preprocessing: ModelPreprocessing, train_transform: Callable) -> TrainData:
    """The train split (less its validation part, ``carve_validation``, with any --label-noise injected), the
    evaluation split, the validation split and the --eval-extra sets, as the model wants them."""
    eval_tf = build_transforms(preprocessing, train=False)
    if cfg.labels == "none":
        return load_unlabelled_data(cfg, eval_tf, train_transform)
    train_set = load_dataset(cfg.dataset, cfg.data, split="train", transform=train_transform, **cfg.dataset_kwargs)
    eval_sets = load_eval_sets(cfg.dataset, cfg.data, cfg.eval_split, eval_tf, cfg.eval_limit, cfg.seed,
                               **cfg.dataset_kwargs)
    carved = carve_validation(cfg.val_fraction, train_set, eval_sets.query, cfg.seed, cfg.per_class)
    train_set, val_set, no_validation = carved.train, carved.validation, carved.none_because
    if val_set is not None:
        val_set.transform = eval_tf
    with parameters_named(spec="eval_extra"):
        extra_sets = [load_extra_set(spec, eval_tf, cfg.eval_extra_limit) for spec in cfg.eval_extra]
    names = [extra.name for extra in extra_sets]
    if len(set(names)) < len(names):
        raise ValueError(f"--eval-extra: two sets have the same name ({names}); each set is reported under its "
                         "folder's name: give each set once, or rename one of the folders")
    labels = np.asarray(train_set.labels, dtype=np.int64)
    clean = labels.copy()
    noise_info = None
    if cfg.label_noise:
        mode, _, rate = cfg.label_noise.partition(":")
        transitions, chosen = None, {}
        if mode == "asymmetric":  # per data set, by class name (retrieval.data.noise)
            with parameters_named(table="label_noise_transitions"):
                transitions, chosen = asymmetric_transitions(cfg.dataset, train_set.class_names,
                                                             cfg.label_noise_transitions)
        labels, noise_info = inject_label_noise(
            labels, mode=mode, rate=float(rate), num_classes=len(train_set.class_names),
            transitions=transitions, seed=cfg.seed,
        )
        noise_info.update(chosen)
        train_set.labels = labels
    if cfg.wise_alpha == "auto" and val_set is None and not extra_sets:
        raise ValueError(f"--wise-alpha auto chooses on validation data and this run has none ({no_validation}): "
                         "give --val-fraction (e.g. 0.1) and/or --eval-extra, or a number")
    return TrainData(train_set, eval_sets, labels, clean, noise_info, val_set, extra_sets, no_validation,
                     validation_by=carved.by)


def load_unlabelled_data(cfg: TrainConfig, eval_tf: Callable, train_transform: Callable) -> TrainData:
    """--labels none: the images without their labels, each its own class; evaluated on --eval-data (labelled),
    else on a labelled data set's evaluation split (its labels never trained on), else without labels on a sample
    of the images themselves."""
    from retrieval.data.unlabelled import hide_labels, is_index_folder, load_labelled_sample
    from retrieval.index.formats.gallery_images import load_unlabelled

    own_images = cfg.dataset in OWN_IMAGES or (cfg.data is not None and is_index_folder(cfg.data))
    if own_images:
        with parameters_named(root="data"):
            train_set = load_unlabelled(cfg.data, train_transform)
    else:  # a labelled data set, its labels hidden from training (how adaptation is measured)
        train_set = hide_labels(load_dataset(cfg.dataset, cfg.data, split="train", transform=train_transform,
                                             **cfg.dataset_kwargs))
    images = copy.copy(train_set)
    images.transform = eval_tf
    checked = cfg.label_free_check and cfg.pseudo_labels != "instance"
    held = np.zeros(0, dtype=np.int64)
    if checked:  # held out of training: never in a batch
        from retrieval.train.label_free_check import held_out_positions

        held = held_out_positions(len(images), cfg.seed)
    limit = cfg.eval_limit or UNLABELLED_EVAL_IMAGES
    sample = label_free_sample(images, held, limit, cfg.seed)
    if cfg.eval_data:
        with parameters_named(root="eval_data"):
            eval_sets = EvalSets(load_labelled_sample(cfg.eval_data, eval_tf))
    elif not own_images:
        eval_sets = load_eval_sets(cfg.dataset, cfg.data, cfg.eval_split, eval_tf, cfg.eval_limit, cfg.seed,
                                   **cfg.dataset_kwargs)
    else:  # nothing labelled: the evaluation is the label-free figures of the sample
        eval_sets = EvalSets(sample, labelled=False)
    with parameters_named(spec="eval_extra"):
        extra_sets = [load_extra_set(spec, eval_tf, cfg.eval_extra_limit) for spec in cfg.eval_extra]
    labels = np.asarray(train_set.labels, dtype=np.int64)
    check_images = None
    if checked:
        check_images = Subset(images, held.tolist())
        labels[held] = -1
    return TrainData(train_set, eval_sets, labels, labels.copy(), None, None, extra_sets,
                     "training without labels: there are no classes to hold out", unlabelled_sample=sample,
                     check_images=check_images)


def label_free_sample(images: Dataset, held: np.ndarray, limit: int, seed: int) -> Dataset:
    """The images the label-free figures (the guard, WiSE-FT's choice) and the start's principal axes are measured
    on: at most ``limit``, seeded, never one of the label-free check's ``held`` out positions."""
    if not len(held):
        return seeded_subset(images, limit, seed) if len(images) > limit else images
    kept = np.setdiff1d(np.arange(len(images)), held)
    if len(kept) > limit:
        kept = np.sort(kept[np.random.default_rng(seed).permutation(len(kept))[:limit]])
    return Subset(images, kept.tolist())


@dataclass(frozen=True)
class CarvedValidation:
    """The train split less its validation part, the validation part (None: none could be carved, and why), and
    what it holds out: ``"classes"`` (whole train classes) or ``"images"`` (a share of each train class's images)."""

    train: ImageDataset
    validation: ImageDataset | None
    by: str | None
    none_because: str | None = None


def carve_validation(asked: float | None, train_set: ImageDataset, test_set: Dataset, seed: int,
                     per_class: int = VAL_IMAGES_PER_CLASS) -> CarvedValidation:
    """The validation split best.pt is chosen on, never a test image: whole train classes where the train split
    has classes enough (DEFAULT_VAL_MIN_CLASSES, or as many as ``asked`` needs) and shares none with the test;
    otherwise a seeded share of each train class's images, so that a small catalogue, or a test of the same
    classes (protocol=standard), still chooses without the test. ``asked`` None: DEFAULT_VAL_FRACTION; 0: none.
    ``per_class``: the images of a class a batch takes, which a class keeps to train on where it gives some."""
    if asked == 0:
        return CarvedValidation(train_set, None, None, "--val-fraction 0 turned it off")
    fraction = DEFAULT_VAL_FRACTION if asked is None else asked
    classes = present_class_names(train_set)
    shared = len(set(classes) & set(present_class_names(test_set)))
    enough = len(classes) >= DEFAULT_VAL_MIN_CLASSES if asked is None else \
        len(classes) - max(2, round(fraction * len(classes))) >= 2
    if enough and not shared:
        train, validation = hold_out_classes(train_set, fraction, seed)
        return CarvedValidation(train, validation, "classes")
    # by class name: a class keeps its validation images when classes are added or removed
    names = [train_set.class_names[label] for label in train_set.labels]
    keep = max(VAL_IMAGES_PER_CLASS, per_class)
    held = held_out_per_class(names, fraction, seed, at_least=VAL_IMAGES_PER_CLASS, keep=keep)
    if len(np.unique(train_set.labels[held])) < 2:
        return CarvedValidation(train_set, None, None, (
            f"too few images per class to hold some out: a class gives validation images where it has "
            f"{VAL_IMAGES_PER_CLASS + keep} or more ({VAL_IMAGES_PER_CLASS} to validate, {keep} left for a batch), and "
            "fewer than 2 classes do"))
    return CarvedValidation(train_set.subset(np.flatnonzero(~held)), train_set.subset(np.flatnonzero(held)), "images")


def hold_out_classes(dataset: ImageDataset, fraction: float, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, validation): a seeded ``fraction`` of the classes (at least 2) moves to the validation split."""
    classes = np.unique(dataset.labels)
    count = max(2, round(fraction * len(classes)))
    if len(classes) - count < 2:
        raise ValueError(f"--val-fraction {fraction}: the train split has {len(classes)} classes, too few to hold "
                         f"{count} out and train on the rest; lower it or leave it out")
    held = np.random.default_rng(seed).choice(classes, count, replace=False)
    is_val = np.isin(dataset.labels, held)
    return dataset.subset(np.flatnonzero(~is_val)), dataset.subset(np.flatnonzero(is_val))
