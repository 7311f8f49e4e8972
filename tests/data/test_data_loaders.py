"""Data-set loaders: each official layout built as a tiny tree in tmp_path."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retrieval.data import DATASETS, ImageDataset, limit_per_class, load_dataset
from retrieval.data.builtin import FASHION_MNIST_CLASSES, FASHION_MNIST_DIR
from retrieval.data.formats import IMAGE_EXTENSIONS
from retrieval.index.sources import list_gallery

COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30), (30, 200, 200), (200, 30, 200)]


def write_image(path: Path, color=(120, 60, 30), size=(12, 8)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def names_of(dataset: ImageDataset) -> set[str]:
    return {dataset.class_names[label] for label in dataset.labels}


def check_contiguous(dataset: ImageDataset) -> None:
    assert dataset.labels.dtype == np.int64 and dataset.labels.flags["C_CONTIGUOUS"]
    assert sorted(set(dataset.labels.tolist())) == list(range(len(dataset.class_names)))


# ---------------------------------------------------------------- ImageDataset


def test_image_dataset_arrays_become_rgb_and_transform_applies():
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4)
    color = np.zeros((3, 4, 3), dtype=np.uint8)
    color[..., 2] = 255
    dataset = ImageDataset([gray, color], [1, 0], ["b", "a"], transform=lambda im: np.asarray(im))
    first, label = dataset[0]
    assert label == 1 and isinstance(label, int)
    assert (
        first.shape == (3, 4, 3)
        and np.array_equal(first[..., 0], gray)
        and np.array_equal(first[..., 1], gray)
    )
    assert dataset.load_image(1).getpixel((0, 0)) == (0, 0, 255)
    assert dataset.class_names[dataset.labels[0]] == "a"


def test_image_dataset_applies_exif_orientation(tmp_path):
    path = tmp_path / "rotated.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    Image.new("RGB", (20, 10), (10, 20, 30)).save(path, exif=exif)
    dataset = ImageDataset([str(path)], [0], ["x"])
    assert dataset.load_image(0).size == (10, 20)
    assert dataset.load_image(0).mode == "RGB"


def test_image_dataset_rejects_bad_input():
    with pytest.raises(ValueError, match="2 samples but 1 labels"):
        ImageDataset([np.zeros((2, 2), np.uint8)] * 2, [0], ["a"])
    with pytest.raises(ValueError, match="labels must lie in 0..0"):
        ImageDataset([np.zeros((2, 2), np.uint8)], [1], ["a"])
    with pytest.raises(ValueError, match="HxW or HxWx3"):
        ImageDataset([np.zeros((2, 2, 4), np.uint8)], [0], ["a"]).load_image(0)
    with pytest.raises(ValueError, match="uint8"):
        ImageDataset([np.zeros((2, 2), np.float32)], [0], ["a"]).load_image(0)


def test_from_class_names_sorts_numeric_names_numerically():
    dataset = ImageDataset.from_class_names([np.zeros((2, 2), np.uint8)] * 3, ["10", "2", "10"])
    assert dataset.class_names == ["2", "10"]
    assert dataset.labels.tolist() == [1, 0, 1]


def test_limit_per_class_keeps_first_k_in_order():
    images = [np.full((2, 2), i, np.uint8) for i in range(7)]
    dataset = ImageDataset(images, [0, 1, 0, 2, 0, 1, 2], ["a", "b", "c"])
    small = limit_per_class(dataset, 2)
    assert [int(s[0, 0]) for s in small.samples] == [0, 1, 2, 3, 5, 6]
    assert small.labels.tolist() == [0, 1, 0, 2, 1, 2] and small.class_names == ["a", "b", "c"]
    with pytest.raises(ValueError, match=">= 1"):
        limit_per_class(dataset, 0)


def test_unknown_dataset_name_lists_choices():
    with pytest.raises(KeyError, match="available: .*cars196.*cub"):
        load_dataset("imagenet")
    assert set(DATASETS.names()) >= {
        "folder",
        "csv",
        "cub",
        "cars196",
        "sop",
        "inshop",
        "emoji",
        "fashion-mnist",
        "digits",
    }


# ---------------------------------------------------------------- folder and csv


def test_folder_with_split_folders(tmp_path):
    for split, classes in {"train": ["cat", "dog"], "test": ["eel", "fox", "gnu"]}.items():
        for c, cls in enumerate(classes):
            for i in range(c + 1):
                write_image(tmp_path / split / cls / f"{i}.png", COLORS[c])
    (tmp_path / "train" / "cat" / "notes.txt").write_text("not an image")
    train = load_dataset("folder", tmp_path, "train")
    test = load_dataset("folder", tmp_path, "test")
    assert len(train) == 3 and len(test) == 6
    assert train.class_names == ["cat", "dog"] and test.class_names == ["eel", "fox", "gnu"]
    assert np.bincount(test.labels).tolist() == [1, 2, 3]
    check_contiguous(test)
    assert train.load_image(0).getpixel((0, 0)) == COLORS[0]


def test_folder_without_split_is_class_disjoint_halves(tmp_path):
    for c, cls in enumerate(["e", "a", "d", "b", "c"]):
        write_image(tmp_path / cls / "x.jpg", COLORS[c])
        write_image(tmp_path / cls / "y.jpg", COLORS[c])
    train = load_dataset("folder", tmp_path, "train")
    test = load_dataset("folder", tmp_path, "test")
    assert names_of(train) == {"a", "b", "c"} and names_of(test) == {"d", "e"}
    assert len(train) == 6 and len(test) == 4
    check_contiguous(train)
    check_contiguous(test)


def test_folder_and_gallery_take_exactly_the_decoders_image_files(tmp_path):
    """The folder data set and the gallery listing take exactly the decoder's extensions (any case, TIFF, PPM and
    PGM included) and nothing it refuses, so every file they take decodes."""
    others = [".tga", ".ico", ".psd", ".svg", ".txt"]
    for c, cls in enumerate(["a", "b"]):
        for extension in sorted(IMAGE_EXTENSIONS) + others:
            path = tmp_path / "train" / cls / f"x{extension.upper() if c else extension}"
            path.parent.mkdir(parents=True, exist_ok=True)
            if extension in (".svg", ".txt", ".psd"):
                path.write_text("<svg/>")
            else:
                Image.new("RGB", (12, 8), COLORS[c]).save(path, Image.registered_extensions()[extension])
    train = load_dataset("folder", tmp_path, "train")
    gallery = list_gallery(tmp_path / "train")
    assert sorted(Path(p).suffix.lower() for p in train.samples) == sorted([*IMAGE_EXTENSIONS] * 2) == sorted(
        Path(item.path).suffix.lower() for item in gallery.items
    )
    assert all(train.load_image(i).size == (12, 8) for i in range(len(train)))


def test_folder_errors_name_the_path(tmp_path):
    write_image(tmp_path / "train" / "a" / "x.png")
    with pytest.raises(FileNotFoundError, match=str((tmp_path / "test").resolve())):
        load_dataset("folder", tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_dataset("folder", tmp_path / "nowhere")
    with pytest.raises(ValueError, match="root="):
        load_dataset("folder")
    with pytest.raises(ValueError, match="unknown split 'val'"):
        load_dataset("folder", tmp_path, "val")


def test_a_flat_folder_of_images_is_told_how_to_label_them(tmp_path):
    """Images at the top level with no class folders: the message counts them and names both ways to label them."""
    for i in range(3):
        write_image(tmp_path / "flat" / f"{i}.png", COLORS[i])
    (tmp_path / "flat" / "notes.txt").write_text("not an image")
    with pytest.raises(ValueError) as raised:
        load_dataset("folder", tmp_path / "flat")
    message = str(raised.value)
    assert "no images found" not in message and "holds 3 images at its top level" in message
    assert "FOLDER/CLASS/IMAGE" in message and "one sub-folder per class" in message and "csv data set" in message
    assert "--" not in message
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "a" / "notes.png.txt").write_text("not an image")
    with pytest.raises(ValueError, match="no images found"):  # a folder with truly no image keeps its message
        load_dataset("folder", tmp_path / "empty")


def test_csv_manifest_with_split_column(tmp_path):
    rows = ["path,label,split"]
    for i, (label, split) in enumerate([("7", "train"), ("7", "train"), ("3", "train"), ("9", "test")]):
        write_image(tmp_path / "imgs" / f"{i}.png", COLORS[i])
        rows.append(f"imgs/{i}.png,{label},{split}")
    (tmp_path / "manifest.csv").write_text("\n".join(rows) + "\n")
    train = load_dataset("csv", tmp_path, "train")  # a folder holding manifest.csv
    test = load_dataset("csv", tmp_path / "manifest.csv", "test")
    assert train.class_names == ["3", "7"] and train.labels.tolist() == [1, 1, 0]
    assert len(test) == 1 and test.class_names == ["9"]
    assert train.load_image(2).getpixel((0, 0)) == COLORS[2]
    with pytest.raises(ValueError, match="no rows with split 'val'"):
        load_dataset("csv", tmp_path, "val")


def test_csv_manifest_without_split_column_and_bad_header(tmp_path):
    rows = ["path,label"] + [f"{c}{i}.png,{c}" for c in "abcd" for i in range(2)]
    for c in "abcd":
        for i in range(2):
            write_image(tmp_path / f"{c}{i}.png")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    assert names_of(load_dataset("csv", tmp_path / "list.csv", "train")) == {"a", "b"}
    assert names_of(load_dataset("csv", tmp_path / "list.csv", "test")) == {"c", "d"}
    (tmp_path / "noheader.csv").write_text("a0.png,a\n")
    with pytest.raises(ValueError, match="header row 'path,label"):
        load_dataset("csv", tmp_path / "noheader.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=str((tmp_path / "empty" / "manifest.csv").resolve())):
        load_dataset("csv", tmp_path / "empty", "train")


# ---------------------------------------------------------------- CUB-200-2011


def make_cub(root: Path) -> None:
    classes = [1, 2, 100, 101, 150, 200]
    (root / "classes.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "classes.txt").write_text("".join(f"{c} {c:03d}.Bird_{c}\n" for c in classes))
    images, labels = [], []
    image_id = 0
    for c in classes:
        for i in range(2):
            image_id += 1
            rel = f"{c:03d}.Bird_{c}/img_{i}.jpg"
            write_image(root / "images" / rel)
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {c}")
    (root / "images.txt").write_text("\n".join(images) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")


def test_cub_split_classes_1_100_vs_101_200(tmp_path):
    make_cub(tmp_path / "CUB_200_2011")
    train = load_dataset("cub", tmp_path, "train")  # finds the CUB_200_2011 sub-folder
    test = load_dataset("cub", tmp_path / "CUB_200_2011", "test")
    assert len(train) == 6 and len(test) == 6
    assert train.class_names == ["001.Bird_1", "002.Bird_2", "100.Bird_100"]
    assert test.class_names == ["101.Bird_101", "150.Bird_150", "200.Bird_200"]
    assert not names_of(train) & names_of(test)
    check_contiguous(train)
    assert train.samples[0].endswith("images/001.Bird_1/img_0.jpg")
    train.load_image(5)


def test_cub_missing_file_names_full_path(tmp_path):
    make_cub(tmp_path)
    (tmp_path / "image_class_labels.txt").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path.resolve() / "image_class_labels.txt")):
        load_dataset("cub", tmp_path)
    make_cub(tmp_path)
    (tmp_path / "images" / "001.Bird_1" / "img_0.jpg").unlink()
    with pytest.raises(FileNotFoundError, match="img_0.jpg"):
        load_dataset("cub", tmp_path)


# ---------------------------------------------------------------- Cars196


def make_cars(root: Path, class_ids: list[int]) -> None:
    from scipy.io import savemat

    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    annotations = np.zeros((1, len(class_ids)), dtype=[(f, "O") for f in fields])
    for i, class_id in enumerate(class_ids):
        rel = f"car_ims/{i + 1:06d}.jpg"
        write_image(root / rel)
        annotations[0, i] = (
            rel,
            np.uint8(1),
            np.uint8(2),
            np.uint8(10),
            np.uint8(7),
            np.uint8(class_id),
            np.uint8(i % 2),
        )
    class_names = np.empty((1, 196), dtype=object)
    for c in range(196):
        class_names[0, c] = f"Make Model {c + 1}"
    savemat(root / "cars_annos.mat", {"annotations": annotations, "class_names": class_names})


def test_cars196_split_classes_1_98_vs_99_196(tmp_path):
    make_cars(tmp_path, [1, 1, 98, 99, 99, 99, 196])
    train = load_dataset("cars196", tmp_path, "train")
    test = load_dataset("cars196", tmp_path, "test")
    assert len(train) == 3 and len(test) == 4
    assert names_of(train) == {"Make Model 1", "Make Model 98"}
    assert names_of(test) == {"Make Model 99", "Make Model 196"}
    assert np.bincount(test.labels).tolist() in ([3, 1], [1, 3])
    assert train.samples[0] == str(tmp_path / "car_ims" / "000001.jpg")
    check_contiguous(test)


def test_cars196_missing_mat_and_bad_structure(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path.resolve() / "cars_annos.mat")):
        load_dataset("cars196", tmp_path)
    from scipy.io import savemat

    savemat(tmp_path / "cars_annos.mat", {"something": np.zeros(3)})
    with pytest.raises(ValueError, match="no 'annotations'"):
        load_dataset("cars196", tmp_path)


# ---------------------------------------------------------------- Stanford Online Products


def make_sop(root: Path) -> None:
    header = "image_id class_id super_class_id path\n"
    for split, classes in {"train": [1, 1, 2, 2], "test": [11319, 11319, 11320]}.items():
        lines = []
        for i, class_id in enumerate(classes):
            rel = f"bicycle_final/{class_id}_{i}.JPG"
            write_image(root / rel)
            lines.append(f"{i + 1} {class_id} 1 {rel}")
        (root / f"Ebay_{split}.txt").write_text(header + "\n".join(lines) + "\n")


def test_sop_official_lists(tmp_path):
    make_sop(tmp_path / "Stanford_Online_Products")
    train = load_dataset("sop", tmp_path, "train")
    test = load_dataset("sop", tmp_path, "test")
    assert len(train) == 4 and len(test) == 3
    assert train.class_names == ["1", "2"] and test.class_names == ["11319", "11320"]
    assert test.labels.tolist() == [0, 0, 1]


def test_sop_missing_list(tmp_path):
    make_sop(tmp_path)
    (tmp_path / "Ebay_test.txt").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path.resolve() / "Ebay_test.txt")):
        load_dataset("sop", tmp_path, "test")


# ---------------------------------------------------------------- In-shop


def make_inshop(root: Path) -> None:
    rows = [
        ("img/WOMEN/Dresses/id_00000002/02_1_front.jpg", "id_00000002", "train"),
        ("img/WOMEN/Dresses/id_00000002/02_2_side.jpg", "id_00000002", "train"),
        ("img/MEN/Denim/id_00000080/01_1_front.jpg", "id_00000080", "train"),
        ("img/MEN/Denim/id_00000007/01_1_front.jpg", "id_00000007", "query"),
        ("img/MEN/Denim/id_00000007/01_2_side.jpg", "id_00000007", "gallery"),
        ("img/MEN/Denim/id_00000003/01_1_front.jpg", "id_00000003", "gallery"),
        ("img/MEN/Denim/id_00000003/01_2_side.jpg", "id_00000003", "query"),
        ("img/MEN/Denim/id_00000005/01_2_side.jpg", "id_00000005", "gallery"),
    ]
    for rel, _, _ in rows:
        write_image(root / rel)
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n"
    text += "".join(f"{rel}   {item}   {status}\n" for rel, item, status in rows)
    (root / "list_eval_partition.txt").write_text(text)


def test_inshop_query_and_gallery_share_labels(tmp_path):
    make_inshop(tmp_path)
    train = load_dataset("inshop", tmp_path, "train")
    query = load_dataset("inshop", tmp_path, "query")
    gallery = load_dataset("inshop", tmp_path, "gallery")
    assert (len(train), len(query), len(gallery)) == (3, 2, 3)
    assert train.class_names == ["id_00000002", "id_00000080"]
    assert query.class_names == gallery.class_names == ["id_00000003", "id_00000005", "id_00000007"]
    assert query.labels.tolist() == [2, 0] and gallery.labels.tolist() == [2, 0, 1]
    assert not names_of(train) & names_of(gallery)


def test_inshop_test_split_and_missing_partition(tmp_path):
    make_inshop(tmp_path)
    with pytest.raises(ValueError, match="split='query' and split='gallery'"):
        load_dataset("inshop", tmp_path, "test")
    (tmp_path / "list_eval_partition.txt").unlink()
    with pytest.raises(FileNotFoundError, match=str(tmp_path.resolve() / "list_eval_partition.txt")):
        load_dataset("inshop", tmp_path, "train")


# ---------------------------------------------------------------- Fashion-MNIST


def write_idx(path: Path, array: np.ndarray, gz: bool) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        data = gzip.compress(data)
    path.write_bytes(data)


def test_fashion_mnist_idx_files_plain_and_gz(tmp_path):
    rng = np.random.default_rng(0)
    for part, n, gz in (("train", 20, False), ("t10k", 10, True)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        write_idx(tmp_path / f"{part}-images-idx3-ubyte", images, gz)
        write_idx(tmp_path / f"{part}-labels-idx1-ubyte", np.arange(n) % 10, gz)
    train = load_dataset("fashion-mnist", tmp_path, "train")
    test = load_dataset("fashion-mnist", tmp_path, "test", protocol="disjoint")
    assert len(train) == 20 and train.class_names == list(FASHION_MNIST_CLASSES)
    assert len(test) == 5 and test.class_names == list(FASHION_MNIST_CLASSES[5:])
    assert train.load_image(3).size == (28, 28)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist", tmp_path / "none")


needs_fashion_mnist = pytest.mark.skipif(
    not FASHION_MNIST_DIR.is_dir(),
    reason=f"{FASHION_MNIST_DIR} is absent: apt-get install dataset-fashion-mnist",
)


@needs_fashion_mnist
def test_fashion_mnist_real_files():
    train = load_dataset("fashion-mnist", split="train")
    test = load_dataset("fashion-mnist", split="test")
    assert (len(train), len(test)) == (60000, 10000)
    assert train.samples[0].shape == (28, 28) and train.samples[0].dtype == np.uint8
    assert np.bincount(train.labels).tolist() == [6000] * 10
    assert np.bincount(test.labels).tolist() == [1000] * 10
    assert train.load_image(0).size == (28, 28) and train.load_image(0).mode == "RGB"


@needs_fashion_mnist
def test_fashion_mnist_protocols_and_class_subset():
    train = load_dataset("fashion-mnist", split="train", protocol="disjoint")
    test = load_dataset("fashion-mnist", split="test", protocol="disjoint")
    assert (len(train), len(test)) == (30000, 5000)
    assert train.class_names == ["t-shirt", "trouser", "pullover", "dress", "coat"]
    assert not names_of(train) & names_of(test)
    subset = load_dataset("fashion-mnist", split="test", classes=["shirt", 0], limit_per_class=7)
    assert subset.class_names == ["t-shirt", "shirt"] and np.bincount(subset.labels).tolist() == [7, 7]
    with pytest.raises(ValueError, match="protocol"):
        load_dataset("fashion-mnist", protocol="open")


# ---------------------------------------------------------------- digits


def test_digits_disjoint_and_standard():
    train = load_dataset("digits", split="train")
    test = load_dataset("digits", split="test")
    assert train.class_names == list("01234") and test.class_names == list("56789")
    assert len(train) + len(test) == 1797
    assert train.samples[0].shape == (32, 32) and train.samples[0].max() > 200
    standard_train = load_dataset("digits", split="train", protocol="standard", seed=1)
    standard_test = load_dataset("digits", split="test", protocol="standard", seed=1)
    assert len(standard_train) + len(standard_test) == 1797
    assert standard_train.class_names == standard_test.class_names == list("0123456789")
    share = np.bincount(standard_test.labels) / (
        np.bincount(standard_test.labels) + np.bincount(standard_train.labels)
    )
    assert np.allclose(share, 0.3, atol=0.02)  # stratified
    again = load_dataset("digits", split="test", protocol="standard", seed=1)
    other = load_dataset("digits", split="test", protocol="standard", seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(again.samples, standard_test.samples, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(other.samples, standard_test.samples, strict=True))


@needs_fashion_mnist
def test_fashion_mnist_unknown_class_name():
    with pytest.raises(ValueError, match="unknown class 'hat'"):
        load_dataset("fashion-mnist", split="test", classes=["hat"])
    with pytest.raises(ValueError, match="disjoint train has classes"):
        load_dataset("fashion-mnist", split="train", protocol="disjoint", classes=["shirt"])


def linked_class_tree(tmp_path: Path) -> Path:
    """root/cat (real), root/dog -> a folder elsewhere, root/cat/again -> root (a loop), root/kitty -> root/cat (the
    same images again), root/dog/more -> a second folder elsewhere (a link inside a linked class)."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    for name, folder in (("c", root / "cat"), ("d", elsewhere / "dogs"), ("m", elsewhere / "more")):
        for i in range(2):
            write_image(folder / f"{name}{i}.png", COLORS[i])
    (root / "dog").symlink_to(elsewhere / "dogs", target_is_directory=True)
    (root / "cat" / "again").symlink_to(root, target_is_directory=True)
    (root / "kitty").symlink_to(root / "cat", target_is_directory=True)
    (elsewhere / "dogs" / "more").symlink_to(elsewhere / "more", target_is_directory=True)
    return root


def test_class_folders_that_are_links_are_followed_once_each_without_looping(tmp_path, caplog):
    from retrieval.data.official import scan_class_folders

    root = linked_class_tree(tmp_path)
    with caplog.at_level("WARNING", logger="retrieval.data.walk"):
        paths, names = scan_class_folders(root)
    taken = sorted(zip(names, (Path(p).name for p in paths), strict=True))
    assert taken == [("cat", "c0.png"), ("cat", "c1.png"), ("dog", "d0.png"), ("dog", "d1.png"), ("dog", "m0.png"),
                     ("dog", "m1.png")]
    assert "2 linked folder(s)" in caplog.text and "kitty" in caplog.text  # the loop and the alias, said once
    train, test = load_dataset("folder", root, "train"), load_dataset("folder", root, "test")
    assert len(train) + len(test) == 6


def test_the_gallery_listing_follows_linked_class_folders_once_inside_the_gallery_only(tmp_path, caplog):
    """A training set reads its linked classes wherever they are; a gallery, which a server sends file by file,
    follows only the links that stay inside it (dog leads elsewhere: named in a warning, not listed)."""
    with caplog.at_level("WARNING", logger="retrieval.data.walk"):
        gallery = list_gallery(linked_class_tree(tmp_path))
    labels = sorted((item.label, Path(item.path).name) for item in gallery.items)
    assert labels == [("cat", "c0.png"), ("cat", "c1.png")]
    assert not gallery.errors
    assert "lead outside it and were not followed" in caplog.text and "dogs" in caplog.text
