"""Data sets with their official splits, the embedded emoji set, sampler, transforms, label noise."""

from retrieval.data import builtin, emoji, official  # noqa: F401  (registers the loaders)
from retrieval.data.catalog import DATASETS, load_dataset
from retrieval.data.dataset import (
    BadImageError,
    BadImageLog,
    BadSample,
    CatchBadSamples,
    ImageDataset,
    LoadedBatch,
    collate_dropping_bad,
    default_data_dir,
    limit_per_class,
    open_image,
)
from retrieval.data.emoji import prepare_emoji
from retrieval.data.noise import FASHION_MNIST_ASYMMETRIC, asymmetric_transitions, inject_label_noise
from retrieval.data.sampler import ClassBalancedBatchSampler, DistributedClassBalancedBatchSampler, WithSampleSeeds
from retrieval.data.transforms import build_transforms, preprocess_eval

__all__ = [
    "BadImageError",
    "BadImageLog",
    "BadSample",
    "CatchBadSamples",
    "ClassBalancedBatchSampler",
    "DATASETS",
    "DistributedClassBalancedBatchSampler",
    "FASHION_MNIST_ASYMMETRIC",
    "asymmetric_transitions",
    "ImageDataset",
    "LoadedBatch",
    "WithSampleSeeds",
    "build_transforms",
    "collate_dropping_bad",
    "default_data_dir",
    "inject_label_noise",
    "limit_per_class",
    "load_dataset",
    "open_image",
    "prepare_emoji",
    "preprocess_eval",
]
