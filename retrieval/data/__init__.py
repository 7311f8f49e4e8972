"""Data sets with their official splits, the embedded emoji set, sampler, transforms, label noise.

The public names are imported on first use (PEP 562, ``retrieval.utils.lazy``): ``retrieval.data.decode`` (PIL and
numpy) is read by processes that never need torch, such as the ONNX runtime in a Ray embedding actor or the server.
"""

from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it
_SOURCES = {
    "augment": ("AUGMENTATIONS", "Augmentation", "resolve_augmentation"),
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
    "preprocessing": ("ModelPreprocessing",),
    "sampler": ("ClassBalancedBatchSampler", "DistributedClassBalancedBatchSampler", "WithSampleSeeds"),
    "transforms": ("build_transforms", "preprocess_eval"),
}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
__all__ = sorted(name for names in _SOURCES.values() for name in names)
