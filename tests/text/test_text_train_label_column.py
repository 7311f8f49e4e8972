"""`retrieval text train` on a shop's manifest: a manifest moved away from its images is refused in one line before
the image model or the text encoder loads (no ridge start on nothing); some missing images are left out with one
warning; --caption-column label captions each image by its class, read from --label-column, and a manifest without
labels names the column that looks like them."""

from __future__ import annotations

import logging

import pytest
from click.testing import CliRunner
from shop_gallery import write_category_shop as write_shop

from retrieval.cli.main import main
from retrieval.errors import ParameterError
from retrieval.train.text_tower import present_images, read_captions


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """A model file whose loading fails the test: what is refused must be refused before any model loads."""
    def refuse(path):
        raise AssertionError("the image model was loaded")

    monkeypatch.setattr("retrieval.index.query_embedder.load_model", refuse)
    path = tmp_path / "model.onnx"
    path.write_bytes(b"never read")
    return path


def text_train(model, manifest, out, *extra):
    return CliRunner().invoke(main, ["text", "train", "--model", str(model), "--images", str(manifest),
                                     "--out", str(out), *extra])


def test_a_moved_manifest_is_refused_in_one_line_before_any_model_loads(no_model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    moved = tmp_path / "moved" / "manifest.csv"
    moved.parent.mkdir()
    moved.write_text(manifest.read_text())
    result = text_train(no_model, moved, tmp_path / "run", "--caption-column", "title")
    assert result.exit_code == 1 and "Traceback" not in result.output and "solve" not in result.output
    [line] = [line for line in result.output.splitlines() if line.strip()]
    assert "12 of the 12 images listed in manifest" in line and "p00.png, p01.png, p02.png and 9 more" in line
    assert f"looked for in {moved.parent / 'img'}" in line and "move the manifest back beside its images" in line


def test_some_missing_images_are_left_out_with_one_warning(tmp_path, caplog):
    manifest = write_shop(tmp_path / "shop")
    for n in (1, 4):
        (tmp_path / "shop" / "img" / f"p{n:02d}.png").unlink()
    paths, captions = read_captions(str(manifest), ["title"], None)
    caplog.set_level(logging.WARNING, logger="retrieval")
    kept, kept_captions = present_images(paths, captions, str(manifest))
    assert len(kept) == 10 and all("p01.png" not in p and "p04.png" not in p for p in kept)
    assert kept_captions == [c for p, c in zip(paths, captions, strict=True) if p in kept]
    [line] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "2 of the 12 images" in line and "p01.png, p04.png" in line


def test_one_image_left_is_refused_as_too_few_with_the_line(tmp_path):
    manifest = write_shop(tmp_path / "shop", count=3)
    for n in (0, 1):
        (tmp_path / "shop" / "img" / f"p{n:02d}.png").unlink()
    paths, captions = read_captions(str(manifest), ["title"], None)
    with pytest.raises(ParameterError, match="only 1 of 3 captioned images can be read, LiT needs at least 2: 2 of"):
        present_images(paths, captions, str(manifest))


def test_caption_column_label_captions_each_image_by_the_label_column(tmp_path):
    manifest = write_shop(tmp_path / "shop", count=6)
    paths, captions = read_captions(str(manifest), ["label", "title"], None, "category")
    assert captions[0] == ["shoes", "a shoes called item 0"] and captions[1][0] == "bags" and len(paths) == 6


def test_caption_column_label_without_labels_names_the_column_that_looks_like_them(no_model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    result = text_train(no_model, manifest, tmp_path / "run", "--caption-column", "label")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "its 'category' column looks like one: use --label-column category" in result.output
    missing = text_train(no_model, manifest, tmp_path / "run", "--caption-column", "title", "--label-column", "kind")
    assert missing.exit_code == 1 and "--label-column names 'kind'" in missing.output
    assert "path, category, title" in missing.output
