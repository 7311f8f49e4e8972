"""An index folder's gallery as images without labels (``retrieval train --labels none --data INDEX``): the files its
catalogue holds as indexed, where the gallery is now; ``load_unlabelled`` takes either that or any folder of images
(``retrieval.data.unlabelled``, below the index package, reads folders)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np

from retrieval.data.dataset import ImageDataset
from retrieval.data.unlabelled import UNLABELLED_LAYOUT, is_index_folder, scan_images
from retrieval.errors import ParameterError
from retrieval.index.catalogue_reader import CatalogueReader
from retrieval.index.catalogue_schema import Status
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import gallery_place
from retrieval.index.search import gallery_root
from retrieval.records.index_info import IndexInfo


def index_gallery_images(index_dir: str | Path) -> list[str]:
    """The image files an index catalogues as indexed, where its gallery is now (a moved gallery followed); read
    from its catalogue alone, so an index whose vectors live elsewhere (a Milvus collection) serves too."""
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    info = layout.read_record() if layout.info.is_file() else IndexInfo()
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
