"""Data sets with their official splits, the embedded emoji set, sampler, transforms, label noise.

- ``catalog``: every data set and ``load_dataset`` (importing it imports every loader).
- ``registry``: ``DATASETS``, the data-set registry (a leaf), and the checks its loaders share.
- ``builtin``: Fashion-MNIST and scikit-learn's digits, held in memory.
- ``official``: on-disk data sets with their official retrieval splits (folder, csv, CUB, Cars196, SOP, In-shop).
- ``emoji``: the embedded emoji data set, every emoji drawn in two styles.
- ``emoji_groups``: Unicode's emoji groups and subgroups, and the emoji data set's two readings.
- ``emoji_captions``: captions of the emoji for the text tower.
- ``manifest_columns``: a manifest's label column and missing images, said the same way wherever one is read.
- ``dataset``: ``ImageDataset``: images (file paths or arrays) with contiguous integer labels.
- ``sampler``: P x N class-balanced batches, in one process or as a rank's part of the global batch.
- ``augment``: training augmentation as data (``Augmentation``, the ``AUGMENTATIONS`` presets); no torch.
- ``transforms``: ``build_transforms``: the training and evaluation transforms of a model's preprocessing.
- ``eval_preprocess``: ``EvalPreprocess``, the evaluation preprocessing in PIL and NumPy (no torch).
- ``device_decode``: training images decoded and augmented on the training device (``--decode-on device``).
- ``preprocessing``: ``ModelPreprocessing``, THE typed record of what a model needs to embed an image.
- ``resize_modes``: how an image of any shape becomes a model's square input (crop or pad).
- ``colour``: background colours, and transparent pixels composited onto them.
- ``decode``: ``read_image``, THE image decoder: untrusted bytes -> an 8-bit sRGB image, bounded.
- ``decode_memory``: what one decode holds, estimated from the header before any pixel is decoded.
- ``decode_budget``: the process-wide decode budget, and the heap given back after a large decode.
- ``exif_icc``: the EXIF orientation and the ICC profile an image file asks of its pixels.
- ``tiff_tags``: what a TIFF structure's tag directories cost Pillow, bounded before it reads them.
- ``formats``: the one list of image formats, their file extensions and media types (a leaf).
- ``walk``: the one folder walk: links to folders followed, each real folder listed once.
- ``noise``: synthetic label noise (symmetric, asymmetric) for robustness experiments.
- ``synthetic``: synthetic images: a small labelled gallery without a download, images at the decoder's limits.
- ``unlabelled``: images without labels in a folder, each its own class, and a labelled sample to measure them on.

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
