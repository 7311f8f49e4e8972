"""The data-set registry, in a leaf module, and the checks its loaders share for clear errors.

The loaders (``builtin``, ``official``, ``emoji``) register here with ``@DATASETS.register(name)``;
``retrieval.data.catalog`` imports them all, so ``DATASETS`` read from there lists every data set, without an
import cycle.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from retrieval.utils.registry import Registry

if TYPE_CHECKING:
    from retrieval.data.dataset import ImageDataset

# Every factory takes (root, split, transform, **kwargs) and returns an ImageDataset.
DATASETS: Registry[ImageDataset] = Registry("dataset")


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
