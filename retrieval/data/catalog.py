"""The data-set registry and ``load_dataset``; helpers shared by the loaders for clear errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

from retrieval.data.dataset import ImageDataset, limit_per_class
from retrieval.registry import Registry

# Every factory takes (root, split, transform, **kwargs) and returns an ImageDataset.
DATASETS: Registry[ImageDataset] = Registry("dataset")


def load_dataset(
    name: str,
    root: str | Path | None = None,
    split: str = "train",
    transform: Callable[[Image.Image], Any] | None = None,
    **kwargs: Any,
) -> ImageDataset:
    """Load split ``split`` of data set ``name`` (see ``DATASETS.names()``).

    ``limit_per_class=K`` keeps the first K images of every class (deterministic small subsets);
    other keyword arguments go to the loader (e.g. ``protocol=`` for fashion-mnist and digits).
    """
    limit = kwargs.pop("limit_per_class", None)
    factory = DATASETS.get(name)
    dataset = factory(root=root, split=split, transform=transform, **kwargs)
    return limit_per_class(dataset, limit)


def check_split(dataset: str, split: str, allowed: tuple[str, ...] = ("train", "test")) -> None:
    if split not in allowed:
        raise ValueError(f"{dataset}: unknown split {split!r}; choose one of {', '.join(allowed)}")


def require_root(dataset: str, root: str | Path | None, layout: str) -> Path:
    """The root folder as a Path; a clear error when it is missing."""
    if root is None:
        raise ValueError(f"{dataset}: pass root=<folder> (the folder that holds {layout})")
    path = Path(root).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{dataset}: root folder {path.resolve()} does not exist; expected {layout}")
    return path


def require_file(dataset: str, path: Path, layout: str) -> Path:
    """``path`` when it exists; otherwise a FileNotFoundError naming the full path and the layout."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{dataset}: expected file {path.resolve()} is missing; expected layout: {layout}"
        )
    return path


def require_first_image(dataset: str, samples: list[str], layout: str) -> None:
    """Check that the first listed image exists: catches a wrong root without stat-ing every file."""
    if not samples:
        raise ValueError(f"{dataset}: the split has no images; expected layout: {layout}")
    require_file(dataset, Path(samples[0]), layout)
