"""Where the gallery images come from: a folder walked recursively, or a manifest CSV."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif"})


@dataclass(frozen=True)
class GalleryItem:
    path: str  # absolute, so that the catalogue does not depend on the working directory
    label: str | None


def list_gallery(images: str | Path, split: str | None = None) -> list[GalleryItem]:
    """Every image under a folder (recursive, extension in any case) or every row of a manifest CSV.

    In a folder, an image in a sub-folder is labelled by that sub-folder's name (ImageFolder style);
    an image at the top level has no label. A manifest has columns ``path,label[,split]`` with paths
    relative to the manifest's folder; ``split`` keeps only the rows of that split.
    """
    images = Path(images).expanduser()
    if images.is_dir():
        if split is not None:
            raise ValueError("--split filters a manifest's rows; it does not apply to a folder of images")
        return walk_folder(images)
    if images.is_file() and images.suffix.lower() == ".csv":
        return read_manifest(images, split)
    if images.exists():
        raise ValueError(f"--images must be a folder or a manifest .csv (path,label[,split]), got {images}")
    raise FileNotFoundError(f"--images {images} does not exist")


def walk_folder(root: Path) -> list[GalleryItem]:
    root = root.resolve()
    items = []
    for folder, dirs, files in os.walk(root):
        dirs.sort()  # deterministic order, so that ids follow the folder order
        for name in sorted(files):
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                path = Path(folder) / name
                label = path.parent.name if path.parent != root else None
                items.append(GalleryItem(str(path), label))
    return items


def read_manifest(manifest: Path, split: str | None = None) -> list[GalleryItem]:
    base = manifest.resolve().parent
    with open(manifest, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        fields = reader.fieldnames or []
        if "path" not in fields:
            raise ValueError(f"manifest {manifest} needs a header with a 'path' column (path,label[,split])")
        if split is not None and "split" not in fields:
            raise ValueError(f"--split {split} given but manifest {manifest} has no 'split' column")
        items = []
        for row in reader:
            if split is not None and row.get("split") != split:
                continue
            path = Path(row["path"]).expanduser()
            path = path if path.is_absolute() else base / path
            label = row.get("label") or None
            items.append(GalleryItem(str(path), label))
    if split is not None and not items:
        raise ValueError(f"manifest {manifest} has no rows with split == {split!r}")
    return items
