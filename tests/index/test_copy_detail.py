"""Which image of a group of copies is kept (``KeptImage``): the one holding the content at the most pixels (its
file's size from the header times the scale the verification fitted), upright with the most, then the most pixels,
a name no other's extends, the largest file, the first path: an original, never its downscaled, turned, cropped or
re-encoded copy, whichever is catalogued first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from index_builds import write_embeddings_folder
from PIL import Image
from planted import fashion_item

from retrieval.index import IngestOptions, build_from_embeddings
from retrieval.index.curation.catalogued_images import KeptImage
from retrieval.index.curation.copy_check import compare_pair, image_features
from retrieval.index.curation.copy_verification import CheckedPair, CopyRules, copy_groups
from retrieval.index.search import Index

QUICK = IngestOptions(workers=0, shard_size=4, progress=False)


def original() -> Image.Image:
    return fashion_item(1, 160, hue=0.6)


COPIES = {  # file name: how the copy is made (the .jpg saved at quality 30)
    "downscaled.png": lambda p: p.resize((p.width // 2, p.height // 2), Image.Resampling.BILINEAR),
    "turned.png": lambda p: p.rotate(6, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(255, 255, 255)),
    "cropped.png": lambda p: p.crop((10, 20, 140, 150)),
    "jpeg.jpg": lambda p: p,
}


def catalogued(tmp_path: Path, files: dict[str, Image.Image], sizes: dict[str, int] | None = None) -> Path:
    """An index (built from embeddings) of ``files`` saved in its gallery, in that order, each with its file's bytes
    as the catalogue's size unless ``sizes`` says otherwise."""
    root = tmp_path / "in"
    root.mkdir(parents=True)
    for name, picture in files.items():
        picture.save(root / name, **({"quality": 30} if name.endswith(".jpg") else {}))
    names = list(files)
    sizes = sizes or {name: (root / name).stat().st_size for name in names}
    vectors = np.random.default_rng(0).standard_normal((len(names), 8)).astype(np.float32)
    write_embeddings_folder(root, [vectors], [{"path": names, "size": [sizes[n] for n in names]}])
    build_from_embeddings(root, tmp_path / "idx", options=QUICK)
    return tmp_path / "idx"


def verified_pairs(index: Index) -> list[CheckedPair]:
    """Every pair of the index's images compared as the verification compares them."""
    ids = sorted(index.ids.tolist())
    rows = index.indexed_rows(ids)
    features = {i: image_features(Image.open(index.image_file(rows[i]["path"]))) for i in ids}
    pairs = []
    for n, a in enumerate(ids):
        for b in ids[n + 1:]:
            comparison = compare_pair(features[a], features[b])
            pairs.append(CheckedPair(a, b, 0.95, comparison, CopyRules().reason(comparison)))
    return pairs


@pytest.mark.parametrize("copy_first", [True, False])
def test_a_group_of_an_original_and_its_copies_keeps_the_original_whichever_is_catalogued_first(tmp_path, copy_first):
    """An original with its half-size, turned (a wider canvas: more pixels), cropped and JPEG copies, catalogued
    before it or after: every pair verified, one group, the original kept."""
    picture = original()
    copies = {name: make(picture) for name, make in COPIES.items()}
    files = {**copies, "original.png": picture} if copy_first else {"original.png": picture, **copies}
    with Index.open(catalogued(tmp_path, files)) as index:
        pairs = verified_pairs(index)
        assert all(p.verified for p in pairs), [(p.first, p.second, p.reason) for p in pairs]
        groups = copy_groups(pairs, keep=KeptImage(index))
        names = {i: Path(row["path"]).name for i, row in index.indexed_rows(index.ids.tolist()).items()}
    assert len(groups) == 1 and names[int(groups[0].ids[0])] == "original.png"
    assert sorted(names[int(i)] for i in groups[0].ids[1:]) == sorted(copies)


@pytest.mark.parametrize("copy", ["turned.png", "cropped.png", "jpeg.jpg"])
@pytest.mark.parametrize("copy_first", [True, False])
def test_an_original_and_one_copy_of_its_size_keep_the_original(tmp_path, copy, copy_first):
    """Two members only, the copy at the original's detail: turned (its canvas wider: the smaller canvas is kept
    where a turn splits a group evenly), cropped (fewer pixels) or re-encoded (a smaller file)."""
    picture = original()
    files = {copy: COPIES[copy](picture)}
    files = {**files, "original.png": picture} if copy_first else {"original.png": picture, **files}
    with Index.open(catalogued(tmp_path, files)) as index:
        pair = verified_pairs(index)[0]
        assert pair.verified, pair.reason
        ids = {Path(r["path"]).name: i for i, r in index.indexed_rows(index.ids.tolist()).items()}
        for head, other in ((ids[copy], ids["original.png"]), (ids["original.png"], ids[copy])):
            assert KeptImage(index)(head, [(other, pair)]) == ids["original.png"]


def test_a_name_that_extends_anothers_is_the_copy(tmp_path):
    """Two files of one picture at one size, the copy's name extending the original's: the original is kept though
    the copy's file is the larger and its path sorts first."""
    picture = original()
    files = {"photo.png": picture, "photo (1).png": picture.copy()}
    with Index.open(catalogued(tmp_path, files, {"photo.png": 100, "photo (1).png": 200})) as index:
        pair = verified_pairs(index)[0]
        ids = {Path(r["path"]).name: i for i, r in index.indexed_rows(index.ids.tolist()).items()}
        assert KeptImage(index)(ids["photo (1).png"], [(ids["photo.png"], pair)]) == ids["photo.png"]


def test_copies_of_equal_detail_keep_the_largest_file_then_the_first_path(tmp_path):
    """Two files of one picture at one size: the one the catalogue records larger is kept; of equal sizes, the
    first path."""
    picture = original()
    files = {"a.png": picture, "b.png": picture.copy()}
    with Index.open(catalogued(tmp_path / "larger", files, {"a.png": 100, "b.png": 200})) as index:
        head, other = sorted(index.ids.tolist())
        pair = verified_pairs(index)[0]
        names = {i: Path(r["path"]).name for i, r in index.indexed_rows([head, other]).items()}
        assert names[KeptImage(index)(head, [(other, pair)])] == "b.png"
    with Index.open(catalogued(tmp_path / "equal", files, {"a.png": 100, "b.png": 100})) as index:
        head, other = sorted(index.ids.tolist())
        pair = verified_pairs(index)[0]
        names = {i: Path(r["path"]).name for i, r in index.indexed_rows([head, other]).items()}
        assert names[KeptImage(index)(other, [(head, pair)])] == "a.png"


def test_a_file_gone_from_the_gallery_is_measured_as_it_was_loaded(tmp_path):
    """The half-size copy's file is gone (its header unread): its side as the verification loaded it still shows it
    holds the content at half the pixels, and the original is kept."""
    picture = original()
    files = {"copy.png": COPIES["downscaled.png"](picture), "original.png": picture}
    with Index.open(catalogued(tmp_path, files)) as index:
        pair = verified_pairs(index)[0]
        ids = {Path(r["path"]).name: i for i, r in index.indexed_rows(index.ids.tolist()).items()}
        (tmp_path / "in" / "copy.png").unlink()
        keep = KeptImage(index, {ids["copy.png"]: 80})
        assert keep(ids["copy.png"], [(ids["original.png"], pair)]) == ids["original.png"]


def png_header(width: int, height: int) -> bytes:
    """A small PNG file whose header (its checksum right) claims ``width`` x ``height`` pixels."""
    import io
    import struct
    import zlib

    saved = io.BytesIO()
    Image.new("RGB", (4, 4)).save(saved, "PNG")
    data = bytearray(saved.getvalue())
    data[16:24] = struct.pack(">II", width, height)  # the IHDR's width and height, after the signature and its tag
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


@pytest.mark.parametrize("claimed", [8_000, 100_000])  # past the decoder's pixel limit; past Pillow's too
def test_a_file_whose_header_claims_a_huge_size_is_measured_as_it_was_loaded(tmp_path, claimed):
    """The copy's file now claims a huge picture in its header: the claim is not believed (no error, no decoding),
    its side as the verification loaded it ranks it, and the original is kept."""
    picture = original()
    files = {"copy.png": COPIES["downscaled.png"](picture), "original.png": picture}
    with Index.open(catalogued(tmp_path, files)) as index:
        pair = verified_pairs(index)[0]
        ids = {Path(r["path"]).name: i for i, r in index.indexed_rows(index.ids.tolist()).items()}
        (tmp_path / "in" / "copy.png").write_bytes(png_header(claimed, claimed))
        keep = KeptImage(index, {ids["copy.png"]: 80})
        assert keep(ids["copy.png"], [(ids["original.png"], pair)]) == ids["original.png"]
