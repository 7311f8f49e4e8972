"""Loaders for on-disk data sets with their official retrieval splits.

folder   ImageFolder tree (``root/train/<class>/``, ``root/test/<class>/``, or ``root/<class>/``)
csv      manifest ``path,label[,split]``
cub      CUB-200-2011: classes 1-100 train, 101-200 test
cars196  Stanford Cars: classes 1-98 train, 99-196 test
sop      Stanford Online Products: Ebay_train.txt / Ebay_test.txt
inshop   In-shop Clothes: train / query / gallery from list_eval_partition.txt
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from retrieval.data.dataset import ImageDataset, class_disjoint_halves, encode_labels, held_out_per_class
from retrieval.data.formats import IMAGE_EXTENSIONS
from retrieval.data.manifest_columns import (
    DEFAULT_LABEL_COLUMN,
    SaidOnce,
    missing_label_column,
    no_labels_hint,
    present_rows,
)
from retrieval.data.registry import (
    DATASETS,
    check_split,
    require_file,
    require_first_image,
    require_root,
)
from retrieval.data.walk import walk_following_links

Transform = Callable[[Image.Image], Any] | None
log = logging.getLogger(__name__)


def _split_by_class(paths: list[str], names: list[str], keep: set, transform: Transform) -> ImageDataset:
    chosen = [(path, name) for path, name in zip(paths, names, strict=True) if name in keep]
    return ImageDataset.from_class_names([p for p, _ in chosen], [n for _, n in chosen], transform)


def _find_root(root: Path, marker: str, subfolders: tuple[str, ...]) -> Path:
    """``root`` or the first of its ``subfolders`` that holds ``marker`` (archives unpack one level deep)."""
    for candidate in (root, *(root / sub for sub in subfolders)):
        if (candidate / marker).is_file():
            return candidate
    return root


def _read_rows(path: Path, skip: int = 0) -> list[list[str]]:
    """Whitespace-separated rows of a text file, skipping ``skip`` header lines and blank lines."""
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()[skip:]
    return [line.split() for line in lines if line.strip()]


# ---------------------------------------------------------------- folder

FOLDER_LAYOUT = (
    "root/train/<class>/<image>, root/test/<class>/<image> (official split), "
    "or root/<class>/<image> (split by protocol=disjoint or protocol=standard)"
)
PROTOCOLS = ("disjoint", "standard")  # without a split of its own: class-disjoint halves, or images of every class
DEFAULT_TEST_SIZE = 0.2  # protocol=standard: the share of each class's images in the test split


def scan_class_folders(folder: Path) -> tuple[list[str], list[str]]:
    """(image paths, class names) of ``folder/CLASS/**/image``, sorted: every run reads the same list."""
    found = []
    # linked folders are followed (a class folder is often a link), each real folder once, without loops
    for here, _dirs, files in walk_following_links(folder):
        relative = Path(here).relative_to(folder)
        if not relative.parts:
            continue  # the top level holds class folders, not images
        for name in files:
            file = Path(here) / name
            if file.suffix.lower() in IMAGE_EXTENSIONS and file.is_file():
                found.append(file)
    found.sort()  # by path, as before: class folder by name, then the path inside it
    paths = [str(file) for file in found]
    names = [file.relative_to(folder).parts[0] for file in found]
    if not paths:
        loose = sum(1 for file in folder.iterdir() if file.suffix.lower() in IMAGE_EXTENSIONS and file.is_file())
        if loose:
            # a flat folder: its images are there, but nothing says which class each one is
            raise ValueError(
                f"folder: {folder.resolve()} holds {loose} image{'s' if loose != 1 else ''} at its top level and no "
                "class folders; the folder data set takes each image's label from the folder it is in "
                "(FOLDER/CLASS/IMAGE). Move the images into one sub-folder per class, or list them with their "
                "labels in a manifest (path,label) and use the csv data set"
            )
        raise ValueError(
            f"folder: no images found under {folder.resolve()}; expected layout: {FOLDER_LAYOUT}"
        )
    return paths, names


def split_by_protocol(dataset: str, paths: list[str], names: list[str], split: str, transform: Transform,
                      protocol: str | None, test_size: float | None, seed: int | None) -> ImageDataset:
    """``split`` of images that come without one: class-disjoint halves of the sorted class names (``disjoint``,
    the default: the research protocol, new classes at test time), or a seeded ``test_size`` of each class's images
    as the test split (``standard``: every class trains, the test holds unseen images of seen classes, as a
    catalogue's new products are)."""
    protocol = protocol or "disjoint"
    if protocol not in PROTOCOLS:
        raise ValueError(f"{dataset}: unknown protocol {protocol!r}; choose 'standard' (every class in training, "
                         "a share of each class's images held out for test) or 'disjoint' (half the classes train, "
                         "the other half test)")
    classes = len(set(names))
    if protocol == "disjoint":
        if test_size is not None or seed is not None:
            raise ValueError(f"{dataset}: test_size= and seed= choose the share of each class's images that "
                             "protocol=standard holds out; protocol=disjoint splits the classes in halves: give "
                             "protocol=standard too, or leave them out")
        halves = class_disjoint_halves(names)
        data = _split_by_class(paths, names, halves[split], transform)
        data.split_note = (
            f"protocol=disjoint: class-disjoint halves of the {classes} classes: training sees "
            f"{len(halves['train'])} of them, the test split the other {len(halves['test'])}, classes the model never "
            "saw (the research protocol). For a catalogue whose every class should train, split it with "
            "protocol=standard")
        return data
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"{dataset}: seed={seed!r} must be a whole number >= 0 (it chooses the test images)")
    share = DEFAULT_TEST_SIZE if test_size is None else test_size
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share < 1:
        raise ValueError(f"{dataset}: test_size={test_size!r} must lie strictly between 0 and 1 (the share of each "
                         f"class's images in the test split; default {DEFAULT_TEST_SIZE})")
    # at least 2 test images a class, so that each test image has another of its class to find
    is_test = held_out_per_class(names, share, seed, at_least=2, keep=1)
    tested = len({names[i] for i in np.flatnonzero(is_test)})
    if tested < 2:  # one class (or none) to find: every query's nearest is right, the numbers would say nothing
        raise ValueError(f"{dataset}: protocol=standard holds test images out of {tested} of the {classes} classes; a "
                         "test needs 2 classes or more, each with 3 images or more (2 to test, 1 to train): add "
                         "images or classes, or raise test_size")
    chosen = np.flatnonzero(is_test if split == "test" else ~is_test)
    data = ImageDataset.from_class_names([paths[i] for i in chosen], [names[i] for i in chosen], transform)
    data.split_note = (
        f"protocol=standard: all {classes} classes train; a seeded {share:.0%} of each class's images (seed {seed}, "
        f"2 at least, none from a class too small to keep one for training) is the test split, unseen images of "
        f"{tested} seen classes: the catalogue case")
    return data


@DATASETS.register("folder")
def load_folder(root: str | Path | None, split: str = "train", transform: Transform = None,
                protocol: str | None = None, test_size: float | None = None, seed: int | None = None) -> ImageDataset:
    """ImageFolder tree: ``train/`` and ``test/`` sub-folders if present, else split by ``protocol``
    (``split_by_protocol``: ``disjoint``, the default, or ``standard`` with ``test_size`` and ``seed``)."""
    check_split("folder", split)
    base = require_root("folder", root, FOLDER_LAYOUT)
    if (base / "train").is_dir() or (base / "test").is_dir():
        if protocol is not None or test_size is not None or seed is not None:
            raise ValueError(f"folder: {base.resolve()} has train/ and test/ folders, which are its split; "
                             "protocol=, test_size= and seed= split a folder of class folders only: leave them out, or "
                             "give the data set a folder of class folders")
        split_dir = base / split
        if not split_dir.is_dir():
            raise FileNotFoundError(
                f"folder: split folder {split_dir.resolve()} is missing; expected layout: {FOLDER_LAYOUT}"
            )
        paths, names = scan_class_folders(split_dir)
        data = ImageDataset.from_class_names(paths, names, transform)
        data.split_note = f"the folder's own split: {split_dir.resolve()}"
        return data
    paths, names = scan_class_folders(base)
    return split_by_protocol("folder", paths, names, split, transform, protocol, test_size, seed)


# ---------------------------------------------------------------- csv

CSV_LAYOUT = (
    "a CSV manifest with header row 'path,label[,split]' (label_column= names another column for the labels); paths "
    "relative to the manifest's folder (root may be the .csv file or a folder holding manifest.csv)"
)
# What the csv data set has said of missing images, by (manifest, missing, rows): a process loads each split of
# one manifest separately (train, test, a checkpoint's validation), and the same line is said at the first only.
CSV_MISSING_SAID = SaidOnce(log.warning)


def _existing_rows(manifest: Path, paths: list[str], said: SaidOnce) -> list[int]:
    """The rows whose image is there (``present_rows``); none is refused in one line, some missing make one
    warning through ``said`` (a manifest moved away from its images: ``missing_images_line``)."""
    present = present_rows(paths, manifest.resolve())
    if not present.missing:
        return present.kept
    if not present.kept:
        raise FileNotFoundError(f"csv: no image to train on: {present.line}")
    said((str(manifest.resolve()), len(present.missing), len(paths)), f"csv: {present.line}; they are left out")
    return present.kept


@DATASETS.register("csv")
def load_csv(root: str | Path | None, split: str = "train", transform: Transform = None,
             protocol: str | None = None, test_size: float | None = None, seed: int | None = None,
             label_column: str | None = None) -> ImageDataset:
    """CSV manifest; with a ``split`` column its values select rows, else split by ``protocol`` as the folder data
    set splits (``split_by_protocol``). ``label_column``: the column of the labels ('label' unless named); a manifest
    without it is refused, naming the column that looks like labels. Rows whose image is not there are left out
    (one warning), and a manifest none of whose images is there is refused in one line."""
    base = require_root("csv", root, CSV_LAYOUT)
    manifest = base if base.is_file() else require_file("csv", base / "manifest.csv", CSV_LAYOUT)
    column = label_column or DEFAULT_LABEL_COLUMN
    with open(manifest, newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        if "path" not in columns:
            raise ValueError(
                f"csv: {manifest.resolve()} must start with a header row 'path,label[,split]', "
                f"found {columns}"
            )
        if label_column is not None and label_column not in columns:
            raise missing_label_column(label_column, columns, manifest.resolve())
        rows = [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    if column not in columns:
        raise ValueError(f"csv: {manifest.resolve()} gives no labels, and training and evaluation need each image's "
                         f"class: {no_labels_hint(columns, rows)}")
    folder = manifest.parent
    paths = [str(folder / row["path"]) for row in rows]  # absolute paths stay absolute under "/"
    kept = _existing_rows(manifest, paths, CSV_MISSING_SAID)
    if len(kept) < len(rows):
        rows, paths = [rows[i] for i in kept], [paths[i] for i in kept]
    names = [row[column] for row in rows]
    if "split" in columns:
        if protocol is not None or test_size is not None or seed is not None:
            raise ValueError(f"csv: {manifest.resolve()} has a split column, which is its split; protocol=, "
                             "test_size= and seed= split a manifest without one: leave them out, or drop the column")
        present = sorted({row["split"] for row in rows})
        if split not in present:
            raise ValueError(f"csv: no rows with split {split!r} in {manifest.resolve()}; splits: {present}")
        keep = [i for i, row in enumerate(rows) if row["split"] == split]
        dataset = ImageDataset.from_class_names([paths[i] for i in keep], [names[i] for i in keep], transform)
    else:
        check_split("csv", split)
        dataset = split_by_protocol("csv", paths, names, split, transform, protocol, test_size, seed)
    require_first_image("csv", dataset.samples, CSV_LAYOUT)
    return dataset


# ---------------------------------------------------------------- CUB-200-2011

CUB_LAYOUT = (
    "CUB_200_2011/images.txt ('<image_id> <relative path>'), image_class_labels.txt "
    "('<image_id> <class_id>'), optional classes.txt, and the images under images/"
)


@DATASETS.register("cub")
def load_cub(root: str | Path | None, split: str = "train", transform: Transform = None) -> ImageDataset:
    """CUB-200-2011, retrieval protocol: classes 1-100 train, 101-200 test."""
    check_split("cub", split)
    base = _find_root(require_root("cub", root, CUB_LAYOUT), "images.txt", ("CUB_200_2011",))
    images = dict(_read_rows(require_file("cub", base / "images.txt", CUB_LAYOUT)))
    classes = dict(_read_rows(require_file("cub", base / "image_class_labels.txt", CUB_LAYOUT)))
    class_names = dict(_read_rows(base / "classes.txt")) if (base / "classes.txt").is_file() else {}
    wanted = range(1, 101) if split == "train" else range(101, 201)
    paths, names = [], []
    for image_id in sorted(images, key=int):
        class_id = int(classes[image_id])
        if class_id in wanted:
            paths.append(str(base / "images" / images[image_id]))
            names.append(class_names.get(str(class_id), str(class_id)))
    require_first_image("cub", paths, CUB_LAYOUT)
    return ImageDataset.from_class_names(paths, names, transform)


# ---------------------------------------------------------------- Cars196

CARS_LAYOUT = (
    "cars_annos.mat (struct array 'annotations' with fields relative_im_path and class, "
    "optional cell array 'class_names') and the images it lists (car_ims/...)"
)


def _mat_strings(values: Any) -> list[str]:
    return [str(np.asarray(v).reshape(-1)[0]) if np.asarray(v).size else "" for v in np.atleast_1d(values)]


@DATASETS.register("cars196")
def load_cars196(root: str | Path | None, split: str = "train", transform: Transform = None) -> ImageDataset:
    """Stanford Cars (196 classes), retrieval protocol: classes 1-98 train, 99-196 test."""
    from scipy.io import loadmat

    check_split("cars196", split)
    base = require_root("cars196", root, CARS_LAYOUT)
    mat = loadmat(str(require_file("cars196", base / "cars_annos.mat", CARS_LAYOUT)), squeeze_me=True)
    if "annotations" not in mat:
        raise ValueError(f"cars196: {base / 'cars_annos.mat'} has no 'annotations'; expected {CARS_LAYOUT}")
    annotations = np.atleast_1d(mat["annotations"])
    fields = annotations.dtype.names or ()
    if "relative_im_path" not in fields or "class" not in fields:
        raise ValueError(f"cars196: annotations fields are {fields}; expected {CARS_LAYOUT}")
    rel_paths = _mat_strings(annotations["relative_im_path"])
    class_ids = [int(np.asarray(c).reshape(-1)[0]) for c in np.atleast_1d(annotations["class"])]
    class_names = _mat_strings(mat["class_names"]) if "class_names" in mat else []
    wanted = range(1, 99) if split == "train" else range(99, 197)
    paths, names = [], []
    for rel_path, class_id in zip(rel_paths, class_ids, strict=True):
        if class_id in wanted:
            paths.append(str(base / rel_path))
            known = class_id <= len(class_names) and class_names[class_id - 1]
            names.append(class_names[class_id - 1] if known else str(class_id))
    require_first_image("cars196", paths, CARS_LAYOUT)
    return ImageDataset.from_class_names(paths, names, transform)


# ---------------------------------------------------------------- Stanford Online Products

SOP_LAYOUT = (
    "Ebay_train.txt and Ebay_test.txt (header 'image_id class_id super_class_id path', "
    "paths relative to root)"
)


@DATASETS.register("sop")
def load_sop(root: str | Path | None, split: str = "train", transform: Transform = None) -> ImageDataset:
    """Stanford Online Products: the official class-disjoint Ebay_train / Ebay_test lists."""
    check_split("sop", split)
    base = _find_root(require_root("sop", root, SOP_LAYOUT), "Ebay_train.txt", ("Stanford_Online_Products",))
    listing = require_file("sop", base / f"Ebay_{split}.txt", SOP_LAYOUT)
    rows = _read_rows(listing)
    if not rows or rows[0][:2] != ["image_id", "class_id"]:
        raise ValueError(f"sop: {listing.resolve()} must start with the header row; expected {SOP_LAYOUT}")
    paths = [str(base / row[3]) for row in rows[1:]]
    require_first_image("sop", paths, SOP_LAYOUT)
    return ImageDataset.from_class_names(paths, [row[1] for row in rows[1:]], transform)


# ---------------------------------------------------------------- In-shop Clothes

INSHOP_LAYOUT = (
    "list_eval_partition.txt (line 1: count, line 2: 'image_name item_id evaluation_status', then rows "
    "with status train/query/gallery) in root or root/Eval, images relative to root or root/Img"
)


@DATASETS.register("inshop")
def load_inshop(root: str | Path | None, split: str = "train", transform: Transform = None) -> ImageDataset:
    """In-shop Clothes Retrieval: splits train, query and gallery.

    Query and gallery share one label encoding (the sorted item ids of both), so that the same item
    has the same label in both: evaluate queries against the gallery.
    """
    if split == "test":
        raise ValueError(
            "inshop has no 'test' split: load split='query' and split='gallery' and search "
            "the queries against the gallery"
        )
    check_split("inshop", split, ("train", "query", "gallery"))
    given = require_root("inshop", root, INSHOP_LAYOUT)
    base = _find_root(given, "list_eval_partition.txt", ("Eval",))
    partition = require_file("inshop", base / "list_eval_partition.txt", INSHOP_LAYOUT)
    rows = _read_rows(partition, skip=2)
    if any(len(row) != 3 for row in rows):
        raise ValueError(
            f"inshop: every row of {partition.resolve()} needs 3 columns; expected {INSHOP_LAYOUT}"
        )
    statuses = ("query", "gallery") if split in ("query", "gallery") else ("train",)
    pool = [row for row in rows if row[2] in statuses]
    image_base = next((b for b in (given, given / "Img") if pool and (b / pool[0][0]).is_file()), given)
    labels_all, class_names = encode_labels([row[1] for row in pool])
    keep = [i for i, row in enumerate(pool) if row[2] == split]
    paths = [str(image_base / pool[i][0]) for i in keep]
    require_first_image("inshop", paths, INSHOP_LAYOUT)
    return ImageDataset(paths, labels_all[keep], class_names, transform)
