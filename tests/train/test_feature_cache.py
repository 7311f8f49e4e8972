"""The frozen-backbone feature cache reads back the features of the images a split holds now: a folder that gained,
lost or changed an image is embedded again, not read back misaligned with its labels."""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image
from torch import nn

from retrieval.data import load_dataset
from retrieval.train.feature_cache import cached_features


def mean_colour() -> nn.Module:
    """A stand-in backbone: each image's mean colour."""
    return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())


def to_tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image.resize((8, 8)), dtype=np.float32).copy()).permute(2, 0, 1) / 255


def features_of(root, cache) -> np.ndarray:
    data = load_dataset("folder", root, "train", transform=to_tensor, protocol="standard")
    key = {"dataset": "folder", "data": str(root), "split": "train"}  # the same key each time, as a run's
    return cached_features(mean_colour(), data, key, cache, torch.device("cpu"), 4, 0, False, "features",
                           progress=False).embeddings, data


def write(path, colour) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (10, 10), colour).save(path)


def test_a_folder_that_changed_is_embedded_again_and_one_that_did_not_is_read_back(tmp_path):
    root, cache = tmp_path / "shop", tmp_path / "cache"
    for i in range(5):
        write(root / "red" / f"{i}.png", (200, 10 * i, 0))
        write(root / "blue" / f"{i}.png", (0, 10 * i, 200))
    first, _ = features_of(root, cache)
    again, _ = features_of(root, cache)
    assert np.array_equal(first, again) and len(list(cache.glob("*.npz"))) == 1  # read back
    write(root / "red" / "5.png", (255, 255, 255))  # one more image: the rows shift
    grown, data = features_of(root, cache)
    assert len(grown) == len(data) == len(first) + 1
    expected = np.stack([to_tensor(data.load_image(i)).mean(dim=(1, 2)).numpy() for i in range(len(data))])
    assert np.allclose(grown, expected, atol=1e-6)
    write(root / "blue" / "0.png", (0, 0, 0))  # the same names, one image changed
    os.utime(root / "blue" / "0.png", ns=(1, 1))
    changed, data = features_of(root, cache)
    expected = np.stack([to_tensor(data.load_image(i)).mean(dim=(1, 2)).numpy() for i in range(len(data))])
    assert np.allclose(changed, expected, atol=1e-6)
