"""Data sets with their official splits, the embedded emoji set, sampler, transforms, label noise.

The public names are imported on first use (PEP 562, ``retrieval.lazy``): ``retrieval.data.decode`` (PIL and
numpy) is read by processes that never need torch, such as the ONNX runtime in a Ray embedding actor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from retrieval.lazy import lazy_exports

if TYPE_CHECKING:
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
    )
    from retrieval.data.decode import open_image
    from retrieval.data.emoji import prepare_emoji
    from retrieval.data.noise import FASHION_MNIST_ASYMMETRIC, asymmetric_transitions, inject_label_noise
    from retrieval.data.sampler import (
        ClassBalancedBatchSampler,
        DistributedClassBalancedBatchSampler,
        WithSampleSeeds,
    )
    from retrieval.data.transforms import build_transforms, preprocess_eval

# public name -> the submodule that defines it
_SOURCES = {
    "catalog": ("DATASETS", "load_dataset"),
    "dataset": (
        "BadImageError",
        "BadImageLog",
        "BadSample",
        "CatchBadSamples",
        "ImageDataset",
        "LoadedBatch",
        "collate_dropping_bad",
        "default_data_dir",
        "limit_per_class",
    ),
    "decode": ("open_image",),
    "emoji": ("prepare_emoji",),
    "noise": ("FASHION_MNIST_ASYMMETRIC", "asymmetric_transitions", "inject_label_noise"),
    "sampler": ("ClassBalancedBatchSampler", "DistributedClassBalancedBatchSampler", "WithSampleSeeds"),
    "transforms": ("build_transforms", "preprocess_eval"),
}
_imported, __dir__ = lazy_exports(__name__, _SOURCES)


def __getattr__(name: str) -> Any:
    if name in _SOURCES["catalog"]:  # the registry is filled by the loaders' modules
        from retrieval.data import builtin, emoji, official  # noqa: F401
    return _imported(name)


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
