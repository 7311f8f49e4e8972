"""`ImageDataset`: images (file paths or in-memory uint8 arrays) with contiguous integer labels."""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, Subset, default_collate

from retrieval.data.decode import describe_decode_error, open_image

Sample = str | np.ndarray


def default_data_dir() -> Path:
    """Where prepared data sets live: ``$RETRIEVAL_DATA_DIR`` or ``~/.cache/retrieval``."""
    env = os.environ.get("RETRIEVAL_DATA_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "retrieval"


def array_to_image(array: np.ndarray) -> Image.Image:
    """An HxW (grayscale) or HxWx3 uint8 array as an RGB PIL image."""
    if array.dtype != np.uint8:
        raise ValueError(f"in-memory images must be uint8 arrays, got dtype {array.dtype}")
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.ndim == 2:
        return Image.fromarray(np.ascontiguousarray(array), mode="L").convert("RGB")
    if array.ndim == 3 and array.shape[2] == 3:
        return Image.fromarray(np.ascontiguousarray(array), mode="RGB")
    raise ValueError(f"in-memory images must be HxW or HxWx3 uint8 arrays, got shape {array.shape}")


def _numeric_or_text_key(names: Sequence[Hashable]) -> Callable[[Hashable], Any]:
    """Sort numerically when every name is an integer ("2" < "10"), as text otherwise."""
    try:
        for name in names:
            int(str(name), 10)
    except ValueError:
        return str
    return lambda name: int(str(name), 10)


def encode_labels(raw_labels: Sequence[Hashable]) -> tuple[np.ndarray, list[str]]:
    """Map original class ids/names to contiguous labels 0..C-1 (sorted, numeric-aware).

    Returns ``(labels, class_names)`` with ``class_names[label]`` the original name as a string.
    """
    distinct = sorted(set(raw_labels), key=_numeric_or_text_key(list(set(raw_labels))))
    index = {name: i for i, name in enumerate(distinct)}
    labels = np.fromiter((index[name] for name in raw_labels), dtype=np.int64, count=len(raw_labels))
    return labels, [str(name) for name in distinct]


def sorted_class_names(names: Sequence[Hashable]) -> list[Hashable]:
    """Distinct class names in the order used for class-disjoint halves (numeric-aware sort)."""
    distinct = list(set(names))
    return sorted(distinct, key=_numeric_or_text_key(distinct))


def class_disjoint_halves(names: Sequence[Hashable]) -> dict[str, set[Hashable]]:
    """First half of the sorted class names is "train", the rest "test" (train gets the odd one)."""
    ordered = sorted_class_names(names)
    cut = (len(ordered) + 1) // 2
    return {"train": set(ordered[:cut]), "test": set(ordered[cut:])}


def held_out_per_class(names: Sequence[Hashable], fraction: float, seed: int, at_least: int = 1,
                       keep: int = 1) -> np.ndarray:
    """A seeded ``fraction`` of each class's items, as a boolean mask over ``names`` (one class name per item).

    A class gives ``max(at_least, round(fraction * n))`` of its ``n`` items where at least ``keep`` are left, else
    none. Each class draws from its own generator (the seed and the class name), so adding or removing a class or
    an image of another class never moves this class's items.
    """
    if not 0 < fraction < 1:
        raise ValueError(f"the held-out share must lie strictly between 0 and 1, got {fraction}")
    held = np.zeros(len(names), dtype=bool)
    members: dict[Hashable, list[int]] = {}
    for index, name in enumerate(names):
        members.setdefault(name, []).append(index)
    for name, indices in members.items():
        count = max(at_least, round(fraction * len(indices)))
        if len(indices) - count < keep:
            continue
        stream = np.random.default_rng([seed, zlib.crc32(str(name).encode("utf-8"))])
        held[np.asarray(indices)[stream.permutation(len(indices))[:count]]] = True
    return held


class ImageDataset(Dataset):
    """A split of an image data set.

    ``samples[i]`` is a file path or an HxW / HxWx3 uint8 array; ``labels`` are contiguous class
    indices 0..C-1 within the split and ``class_names[label]`` is the original class name.
    ``dataset[i]`` returns ``(transform(PIL RGB image), int label)``.
    """

    def __init__(
        self,
        samples: Sequence[Sample],
        labels: Sequence[int] | np.ndarray,
        class_names: Sequence[str],
        transform: Callable[[Image.Image], Any] | None = None,
    ) -> None:
        labels = np.ascontiguousarray(np.asarray(labels, dtype=np.int64).reshape(-1))
        if len(samples) != len(labels):
            raise ValueError(f"{len(samples)} samples but {len(labels)} labels; they must match one to one")
        if len(labels) and (labels.min() < 0 or labels.max() >= len(class_names)):
            raise ValueError(
                f"labels must lie in 0..{len(class_names) - 1} (one per class name), "
                f"got range {labels.min()}..{labels.max()}"
            )
        self.samples = list(samples)
        self.labels = labels
        self.class_names = [str(name) for name in class_names]
        self.transform = transform
        self.split_note: str | None = None  # how the loader split the data, for people (the run's first lines)

    @classmethod
    def from_class_names(
        cls,
        samples: Sequence[Sample],
        raw_labels: Sequence[Hashable],
        transform: Callable[[Image.Image], Any] | None = None,
    ) -> ImageDataset:
        """Build from original class names/ids; labels become 0..C-1 in sorted class order."""
        labels, class_names = encode_labels(raw_labels)
        return cls(samples, labels, class_names, transform)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.samples)

    def load_image(self, index: int) -> Image.Image:
        """The RGB PIL image of sample ``index``, without the transform."""
        sample = self.samples[index]
        if isinstance(sample, np.ndarray):
            return array_to_image(sample)
        return open_image(sample)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        image = self.load_image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def subset(self, indices: Sequence[int] | np.ndarray) -> ImageDataset:
        """The samples at ``indices``, labels re-encoded to stay contiguous; names are kept."""
        indices = np.asarray(indices, dtype=np.int64)
        used = sorted(set(self.labels[indices].tolist()))
        remap = {old: new for new, old in enumerate(used)}
        labels = np.fromiter((remap[int(label)] for label in self.labels[indices]), np.int64, len(indices))
        names = [self.class_names[old] for old in used]
        part = ImageDataset([self.samples[i] for i in indices], labels, names, self.transform)
        part.split_note = self.split_note
        return part

    def __repr__(self) -> str:
        return f"ImageDataset({len(self)} images, {self.num_classes} classes)"


def limit_per_class(dataset: ImageDataset, limit: int | None) -> ImageDataset:
    """Keep the first ``limit`` samples of each class (in dataset order): deterministic small subsets."""
    if limit is None:
        return dataset
    if limit < 1:
        raise ValueError(f"limit_per_class must be >= 1, got {limit}")
    counts: dict[int, int] = {}
    keep = []
    for index, label in enumerate(dataset.labels.tolist()):
        if counts.get(label, 0) < limit:
            counts[label] = counts.get(label, 0) + 1
            keep.append(index)
    return dataset.subset(keep)


# --- images that fail to load ----------------------------------------------------------------------
# A DataLoader worker that raises loses the exception's type and buries the file name in a re-raised traceback,
# so a sample that fails to load comes back as a ``BadSample`` record; ``collate_dropping_bad`` takes the records
# out of the batch and the main process decides (``BadImageLog``): warn and skip, or stop with a clear error.

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BadSample:
    """A sample that could not be loaded: its position in the dataset read, its file (or array) and why."""

    index: int
    source: str
    reason: str


class BadImageError(ValueError):
    """An image could not be read and the run was told to stop on such files."""


def sample_source(dataset: Dataset, index: int) -> str:
    """The file behind ``dataset[index]`` (through ``Subset`` and same-index wrappers), or a description of the
    in-memory sample."""
    while isinstance(dataset, Subset) or getattr(dataset, "same_indices", False):
        if isinstance(dataset, Subset):
            index = int(dataset.indices[index])
        dataset = dataset.dataset
    samples = getattr(dataset, "samples", None)
    if samples is not None and isinstance(samples[index], (str, os.PathLike)):
        return os.fspath(samples[index])
    return f"in-memory sample #{index} of {dataset!r}"


@contextmanager
def sample_seeded(seed: int) -> Iterator[None]:
    """The CPU generator seeded with one sample's seed, the caller's stream restored afterwards.

    Augmentation draws from the CPU generator alone; torch.manual_seed would also queue a seed for every lazily
    started accelerator, formatting a stack trace for each (~0.2 ms a sample)."""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(int(seed))
        yield


class CatchBadSamples(Dataset):
    """``dataset`` for a DataLoader: key ``i`` gives ``(i, dataset[i])``, or a ``BadSample`` when loading fails.

    A key ``(i, seed)`` seeds torch's RNG for that one sample (the caller's RNG state is kept), so random
    augmentation depends on the key alone, not on which worker loads it or where a run was resumed.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[int, Any] | BadSample:
        index, seed = key if isinstance(key, tuple) else (key, None)
        try:
            if seed is None:
                return index, self.dataset[index]
            with sample_seeded(seed):
                return index, self.dataset[index]
        except Exception as exc:  # noqa: BLE001  (any failure of one sample is reported, never fatal here)
            source = sample_source(self.dataset, index)
            return BadSample(index, source, describe_decode_error(exc))


class LoadedBatch(NamedTuple):
    """A collated batch without its bad samples: ``inputs``/``labels`` are None when none loaded."""

    inputs: Any
    labels: torch.Tensor | None
    indices: torch.Tensor  # dataset positions of the rows of inputs
    bad: list[BadSample]


def collate_dropping_bad(items: list[tuple[int, Any] | BadSample]) -> LoadedBatch:
    """Collate the ``(i, (image, label))`` items of ``CatchBadSamples``; ``BadSample`` records go to ``.bad``."""
    bad = [item for item in items if isinstance(item, BadSample)]
    good = [item for item in items if not isinstance(item, BadSample)]
    if not good:
        return LoadedBatch(None, None, torch.empty(0, dtype=torch.int64), bad)
    inputs, labels = default_collate([sample for _, sample in good])
    return LoadedBatch(inputs, labels, torch.tensor([index for index, _ in good], dtype=torch.int64), bad)


class BadImageLog:
    """The images that failed to load in one run, each once: warn and skip them, or stop (``policy="fail"``)."""

    POLICIES = ("skip", "fail")

    def __init__(self, policy: str = "fail", fix: str = "fix or remove the file",
                 warn: Callable[[str], None] = log.warning) -> None:
        if policy not in self.POLICIES:
            raise ValueError(f"bad-image policy must be one of {self.POLICIES}, got {policy!r}")
        self.policy = policy
        self.fix = fix  # the end of the "fail" error: what to do about it
        self.warn = warn  # takes the one-line warning for each new file
        self._by_source: dict[str, BadSample] = {}

    def add(self, bad: Iterable[BadSample]) -> None:
        """Record samples that failed: one warning line per new file, or ``BadImageError`` under "fail"."""
        for sample in bad:
            if self.policy == "fail":
                raise BadImageError(f"cannot read image {sample.source}: {sample.reason}; {self.fix}")
            if sample.source not in self._by_source:
                self._by_source[sample.source] = sample
                self.warn(f"skipping unreadable image {sample.source}: {sample.reason}")

    def __len__(self) -> int:
        return len(self._by_source)

    def records(self) -> list[dict[str, Any]]:
        """``[{"file", "reason"}]`` in the order the files were met (JSON-able, for reports and checkpoints)."""
        return [{"file": s.source, "reason": s.reason} for s in self._by_source.values()]

    def restore(self, records: Iterable[dict[str, Any]]) -> None:
        """Take back the ``records()`` of an earlier part of the run (no second warning for them)."""
        for record in records:
            self._by_source.setdefault(record["file"], BadSample(-1, record["file"], record["reason"]))

