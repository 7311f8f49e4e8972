"""The two training pipelines over the same samples and seeds: the workers' (CPU) and the device stage's."""

from __future__ import annotations

from retrieval.data import device_decode
from retrieval.data.augment import resolve_augmentation
from retrieval.data.dataset import CatchBadSamples, ImageDataset, collate_dropping_bad
from retrieval.data.device_decode import DeviceAugment, EncodedImages, collate_encoded
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.data.transforms import build_transforms

CONFIG = ModelPreprocessing(input_size=64, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), background="white")


def both_pipelines(samples, augmentation="crop-flip", seeds=None, group_pixels=device_decode.GROUP_PIXELS,
                   device="cpu", config=None):
    """(the workers' batch, the device stage's batch, its labels, its bad samples, the encoded items) of ``samples``
    (``config``: the model's, CONFIG unless given)."""
    config = CONFIG if config is None else config
    aug = resolve_augmentation(augmentation)
    dataset = ImageDataset(samples, list(range(len(samples))), [str(i) for i in range(len(samples))],
                           build_transforms(config, True, aug))
    keys = [(i, 7_000 + i if seeds is None else seeds[i]) for i in range(len(samples))]
    cpu = collate_dropping_bad([CatchBadSamples(dataset)[key] for key in keys])
    encoded = collate_encoded([CatchBadSamples(EncodedImages(dataset, config, aug))[key] for key in keys])
    images, labels, bad = DeviceAugment(config, aug, device, dataset=dataset, group_pixels=group_pixels)(
        encoded.inputs)
    return cpu, images, labels, bad, encoded
