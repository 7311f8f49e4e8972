"""Small data sets that ship with the system: Fashion-MNIST (Debian package) and sklearn's digits.

Both are held in memory as uint8 arrays. ``protocol="standard"`` is the usual classification split
(same classes in train and test); ``protocol="disjoint"`` is the retrieval protocol: classes 0-4 train,
classes 5-9 test, so test classes are never seen in training.
"""

from __future__ import annotations

import functools
import gzip
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from retrieval.data.dataset import ImageDataset
from retrieval.data.registry import DATASETS, check_split

Transform = Callable[[Image.Image], Any] | None

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_INSTALL = "apt-get install dataset-fashion-mnist"
# Index = Fashion-MNIST label; names without "/" so that they work as folder names.
FASHION_MNIST_CLASSES = (
    "t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot",
)  # fmt: skip
DIGITS_CLASSES = tuple(str(d) for d in range(10))
PROTOCOLS = ("standard", "disjoint")
DISJOINT_CLASSES = {"train": range(0, 5), "test": range(5, 10)}


def _select(
    images: np.ndarray,
    original_labels: np.ndarray,
    names: Sequence[str],
    classes: Sequence[int | str] | None,
    transform: Transform,
) -> ImageDataset:
    """Keep images of ``classes`` (indices or names; all if None); re-encode labels 0..C-1."""
    present = sorted(set(np.unique(original_labels).tolist()))
    wanted = present
    if classes is not None:
        as_index = [_class_index(c, names) for c in classes]
        unknown = [c for c in as_index if not 0 <= c < len(names)]
        if unknown:
            raise ValueError(f"unknown classes {unknown}; choose from 0..{len(names) - 1} or {list(names)}")
        wanted = [c for c in present if c in set(as_index)]
        if not wanted:
            raise ValueError(f"none of classes={list(classes)} is in this split (it has {present})")
    remap = np.full(len(names), -1, dtype=np.int64)
    remap[wanted] = np.arange(len(wanted))
    keep = np.flatnonzero(remap[original_labels] >= 0)
    return ImageDataset(
        list(images[keep]), remap[original_labels[keep]], [names[c] for c in wanted], transform
    )


def _class_index(cls: int | str, names: Sequence[str]) -> int:
    """A class given by index or by name as its index."""
    if isinstance(cls, str) and cls in names:
        return names.index(cls)
    try:
        return int(cls)
    except ValueError:
        raise ValueError(f"unknown class {cls!r}; choose an index or one of {list(names)}") from None


# what each protocol means, for people (a run's first lines)
PROTOCOL_NOTES = {
    "standard": "protocol=standard: every class trains; the test split holds other images of the same classes",
    "disjoint": "protocol=disjoint: classes 0-4 train, 5-9 test: the test split's classes were never trained on",
}


def _check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; choose 'standard' (same classes) or 'disjoint'")


# ---------------------------------------------------------------- Fashion-MNIST


def _idx_path(folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"fashion-mnist: expected {folder.resolve() / stem}[.gz] (IDX file); install the data with "
        f"`{FASHION_MNIST_INSTALL}` or pass root=<folder with the four IDX files>"
    )


@functools.lru_cache(maxsize=4)
def read_idx(path: Path) -> np.ndarray:
    """An IDX (MNIST format) uint8 array, gzipped or not."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        data = handle.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (bad magic number)")
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says shape {shape} but holds {array.size} values")
    return array.reshape(shape)


def read_fashion_mnist(root: str | Path | None, part: str) -> tuple[np.ndarray, np.ndarray]:
    """Images [N, 28, 28] and labels [N] of the official ``train`` (60k) or ``t10k`` (10k) part."""
    folder = Path(root) if root is not None else FASHION_MNIST_DIR
    images = read_idx(_idx_path(folder, f"{part}-images-idx3-ubyte"))
    labels = read_idx(_idx_path(folder, f"{part}-labels-idx1-ubyte")).astype(np.int64)
    if len(images) != len(labels):
        raise ValueError(f"fashion-mnist {part}: {len(images)} images but {len(labels)} labels")
    return images, labels


@DATASETS.register("fashion-mnist")
def load_fashion_mnist(
    root: str | Path | None = None,
    split: str = "train",
    transform: Transform = None,
    protocol: str = "standard",
    classes: Sequence[int | str] | None = None,
) -> ImageDataset:
    """Fashion-MNIST from the IDX files (default folder /usr/share/datasets/fashion-mnist).

    standard: the official 60k train / 10k test images, all 10 classes.
    disjoint: train = train images of classes 0-4; test = test images of classes 5-9.
    ``classes`` restricts to a subset (indices or names), applied after the protocol.
    """
    check_split("fashion-mnist", split)
    _check_protocol(protocol)
    images, labels = read_fashion_mnist(root, "train" if split == "train" else "t10k")
    if protocol == "disjoint":
        in_split = list(DISJOINT_CLASSES[split])
        classes = (
            in_split
            if classes is None
            else [c for c in classes if _class_index(c, FASHION_MNIST_CLASSES) in in_split]
        )
        if not classes:
            raise ValueError(f"fashion-mnist disjoint {split} has classes {in_split}; classes= selects none")
    data = _select(images, labels, FASHION_MNIST_CLASSES, classes, transform)
    data.split_note = PROTOCOL_NOTES[protocol]
    return data


# ---------------------------------------------------------------- digits


@functools.lru_cache(maxsize=4)
def digits_images(size: int) -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 1,797 8x8 digits as uint8 [N, size, size] (bicubic upscale) and labels [N]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = np.clip(bunch.images * (255.0 / 16.0), 0, 255).round().astype(np.uint8)
    big = np.stack([np.asarray(Image.fromarray(im).resize((size, size), Image.BICUBIC)) for im in small])
    return big, bunch.target.astype(np.int64)


@DATASETS.register("digits")
def load_digits_dataset(
    root: str | Path | None = None,
    split: str = "train",
    transform: Transform = None,
    protocol: str = "disjoint",
    image_size: int = 32,
    test_size: float = 0.3,
    seed: int = 0,
) -> ImageDataset:
    """sklearn digits (no files needed; ``root`` is ignored).

    disjoint (default): digits 0-4 train, 5-9 test. standard: a seeded stratified split with
    ``test_size`` of every class in test.
    """
    from sklearn.model_selection import train_test_split

    check_split("digits", split)
    _check_protocol(protocol)
    images, labels = digits_images(image_size)
    if protocol == "disjoint":
        data = _select(images, labels, DIGITS_CLASSES, list(DISJOINT_CLASSES[split]), transform)
    else:
        train_idx, test_idx = train_test_split(
            np.arange(len(labels)), test_size=test_size, random_state=seed, stratify=labels
        )
        keep = np.sort(train_idx if split == "train" else test_idx)
        data = _select(images[keep], labels[keep], DIGITS_CLASSES, None, transform)
    data.split_note = PROTOCOL_NOTES[protocol]
    return data
