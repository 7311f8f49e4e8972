"""Images without labels, for fine-tuning on the user's own photos: any folder (flat or nested) or the gallery an
index catalogues. Each image is its own class (label = its row), so the pair losses take its augmented views as
positives; pseudo-labels (``retrieval.pseudo_labels``) may replace those labels during training."""

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


def index_gallery_images(index_dir: str | Path) -> list[str]:
    """The image files an index catalogues as indexed, where its gallery is now (a moved gallery followed); read
    from its catalogue alone, so an index whose vectors live elsewhere (a Milvus collection) serves too."""
    from retrieval.index.catalogue_reader import CatalogueReader
    from retrieval.index.catalogue_schema import Status
    from retrieval.index.layout import IndexLayout
    from retrieval.index.portable import gallery_place
    from retrieval.index.search import gallery_root

    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    info = layout.read_info() if layout.info.is_file() else {}
    with CatalogueReader(layout.catalogue) as catalogue:
        place = gallery_place(info, gallery_root(info, catalogue), layout.root, None)
        ids = catalogue.ids_with_status(Status.DONE)
        files = [place.file(row["path"]) for row in catalogue.rows(ids).values()]
    missing = sum(file is None for file in files)
    found = sorted(file for file in files if file is not None)
    if not found:
        raise FileNotFoundError(f"{index_dir}: none of the index's {len(files)} images is where its gallery should be; "
                                "if the gallery moved, index it again or move it back")
    if missing:
        import warnings

        warnings.warn(f"{index_dir}: {missing} of the index's {len(files)} images are not in its gallery folder and "
                      "are left out", stacklevel=2)
    return found


def load_unlabelled(root: str | Path | None, transform: Callable | None = None) -> ImageDataset:
    """The images of ``root`` (a folder, flat or nested, or an index folder), each its own class; labels never
    read from folder names."""
    if root is None:
        raise ParameterError("root", f"is required: {UNLABELLED_LAYOUT}")
    base = Path(root).expanduser()
    if not base.exists():
        raise FileNotFoundError(f"{base.resolve()} does not exist; expected {UNLABELLED_LAYOUT}")
    paths = index_gallery_images(base) if is_index_folder(base) else scan_images(base)
    if len(paths) < 2:
        raise ParameterError("root", f"{base.resolve()}: {len(paths)} image(s) found; training without labels needs "
                                     "at least 2 (each image's views are a positive pair, the other images its "
                                     f"negatives); expected {UNLABELLED_LAYOUT}")
    names = [str(Path(p).relative_to(base)) if Path(p).is_relative_to(base) else p for p in paths]
    return ImageDataset(paths, np.arange(len(paths), dtype=np.int64), names, transform)


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
