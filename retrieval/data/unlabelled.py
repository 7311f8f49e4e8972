"""Images without labels, for fine-tuning on the user's own photos: any folder (flat or nested) or the gallery an
index catalogues (read by ``retrieval.index.formats.gallery_images.load_unlabelled``, above the index package). Each
image is its own class (label = its row), so the pair losses take its augmented views as positives; pseudo-labels
(``retrieval.pseudo_labels``) may replace those labels during training."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from retrieval.data.dataset import ImageDataset
from retrieval.data.formats import IMAGE_EXTENSIONS
from retrieval.data.walk import walk_following_links
from retrieval.errors import ParameterError

UNLABELLED_LAYOUT = "a folder of images, flat or nested (sub-folders are not read as classes), or an index folder"


def is_index_folder(root: str | Path) -> bool:
    """Whether ``root`` is an index folder (it holds a catalogue), whose gallery is then the data."""
    return (Path(root).expanduser() / "catalogue.sqlite").is_file()


def scan_images(folder: Path) -> list[str]:
    """Every image file under ``folder``, at any depth (links followed, each real folder once), sorted by path."""
    found = [str(Path(here) / name) for here, _dirs, files in walk_following_links(folder)
             for name in files if Path(name).suffix.lower() in IMAGE_EXTENSIONS and (Path(here) / name).is_file()]
    return sorted(found)


def hide_labels(dataset: ImageDataset) -> ImageDataset:
    """A copy of ``dataset`` whose labels are its rows (each image its own class): training never sees the
    classes; the class names become the images' own names."""
    return ImageDataset(dataset.samples, np.arange(len(dataset), dtype=np.int64),
                        [f"image {i}" for i in range(len(dataset))], dataset.transform)


def load_labelled_sample(root: str | Path, transform: Callable | None = None) -> ImageDataset:
    """A labelled sample to measure a run without labels on (--eval-data): ``root/test/CLASS/IMAGE`` where there is
    a test folder, else every ``root/CLASS/IMAGE``."""
    from retrieval.data.official import scan_class_folders

    base = Path(root).expanduser()
    if not base.is_dir():
        raise FileNotFoundError(f"{base.resolve()} is not a folder; a labelled sample is FOLDER/CLASS/IMAGE")
    paths, names = scan_class_folders(base / "test" if (base / "test").is_dir() else base)
    if len(set(names)) < 2:
        raise ParameterError("root", f"{base.resolve()}: {len(set(names))} class folder(s); Recall@K and MAP@R "
                                     "need at least 2 classes with 2 images each")
    return ImageDataset.from_class_names(paths, names, transform)
