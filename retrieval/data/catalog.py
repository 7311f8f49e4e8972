"""Every data set and ``load_dataset``: importing this module imports the loaders, which fill ``DATASETS``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from PIL import Image

# The loader modules register their data sets in DATASETS when imported.
from retrieval.data import builtin, emoji, official  # noqa: F401
from retrieval.data.dataset import ImageDataset, limit_per_class
from retrieval.data.registry import DATASETS
from retrieval.errors import ParameterError


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
    if kwargs.get("label_column") is not None and name != "csv":
        raise ParameterError("label_column", f"names a manifest's column: it applies to the csv data set, not {name}")
    factory = DATASETS.get(name)
    dataset = factory(root=root, split=split, transform=transform, **kwargs)
    return limit_per_class(dataset, limit)
