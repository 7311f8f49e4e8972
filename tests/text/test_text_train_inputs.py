"""`retrieval text train`'s inputs: images that cannot be read make one summary line (how many, why, the first
few, where they were looked for, the fix), and too few readable images are refused before any training; a caption
column empty in every row is told apart from a missing one; manifest rows that are not UTF-8 are counted, never
dropped silently; the ridge start is finite for any number of rows and matches a float64 least-squares reference.
A stand-in image model (seeded vectors) keeps these in seconds, without the text encoder."""

from __future__ import annotations

import csv
import logging

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from retrieval.cli.main import main
from retrieval.errors import ParameterError
from retrieval.text.encoder import EncoderConfig, SentenceEncoder
from retrieval.text.tower import TextTower
from retrieval.train.text_tower import CACHE, embed_images, read_captions

DIM = 8


class StandInModel:
    """The image model's interface (``load_model``'s): a seeded vector per image; counts the images it embeds."""

    model_hash = "stand-in"
    embedding_dim = DIM

    def __init__(self) -> None:
        self.embedded = 0

    def embed(self, images: list) -> np.ndarray:
        self.embedded += len(images)
        return np.random.default_rng(self.embedded).normal(size=(len(images), DIM)).astype(np.float32)


@pytest.fixture
def model(monkeypatch, tmp_path):
    """A stand-in model file and the model ``load_model`` gives for it."""
    stand_in = StandInModel()
    monkeypatch.setattr("retrieval.index.query_embedder.load_model", lambda path: stand_in)
    path = tmp_path / "model.onnx"
    path.write_bytes(b"stand-in")
    return path, stand_in


def write_manifest(path, rows, header=("path", "label", "title")):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def image(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)
    return path


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_many_unreadable_images_make_one_summary_line_naming_the_folder_and_the_fix(model, tmp_path, caplog):
    moved = tmp_path / "moved"  # the manifest's folder: 319 of its 321 images are elsewhere
    paths = [str(image(moved / "kept_0.png")), str(image(moved / "kept_1.png"))]
    paths += [str(moved / f"photo_{n:03d}.jpg") for n in range(319)]
    caplog.set_level(logging.DEBUG, logger="retrieval")
    vectors, _, readable = embed_images(str(model[0]), paths, tmp_path / CACHE, progress=False)
    assert readable == [0, 1] and vectors.shape == (321, DIM)
    [line] = warnings_of(caplog)
    assert "319 of 321 captioned images are left out" in line and "missing file: 319" in line
    assert f"looked for in {moved}" in line and "photo_000.jpg, photo_001.jpg, photo_002.jpg and 316 more" in line
    assert "relative to the manifest's folder" in line


def test_fewer_readable_images_than_lit_needs_are_refused_with_the_summary(model, tmp_path):
    paths = [str(tmp_path / "moved" / f"photo_{n:03d}.jpg") for n in range(321)]
    with pytest.raises(ParameterError, match="only 0 of 321 captioned images can be read, LiT needs at least 2") \
            as refused:
        embed_images(str(model[0]), paths, tmp_path / CACHE, progress=False)
    assert "missing file: 321" in str(refused.value) and "and 318 more" in str(refused.value)


def test_two_images_one_unreadable_are_refused_before_training(model, tmp_path):
    manifest = write_manifest(tmp_path / "captions.csv", [["red.png", "a", "a red square"],
                                                           ["gone.png", "b", "a blue square"]])
    image(tmp_path / "red.png")
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["text", "train", "--model", str(model[0]), "--images", str(manifest),
                                       "--caption-column", "title", "--out", str(out)])
    assert result.exit_code != 0
    assert "only 1 of 2 captioned images can be read, LiT needs at least 2" in result.output
    assert "gone.png" in result.output and "Traceback" not in result.output
    assert not (out / "text.onnx").exists() and not (out / "report.json").exists()


def test_images_unreadable_last_time_are_tried_again_from_the_cache(model, tmp_path):
    paths = [str(image(tmp_path / f"{n}.png")) for n in range(2)] + [str(tmp_path / "late.png")]
    _, _, first = embed_images(str(model[0]), paths, tmp_path / CACHE, progress=False)
    image(tmp_path / "late.png")
    vectors, _, second = embed_images(str(model[0]), paths, tmp_path / CACHE, progress=False)
    assert first == [0, 1] and second == [0, 1, 2]
    assert model[1].embedded == 3  # the cached two were not embedded again
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1, rtol=1e-6)


@pytest.mark.parametrize("kind", ["csv", "parquet"])
def test_a_caption_column_empty_in_every_row_is_reported_as_empty(tmp_path, kind):
    rows = [[f"{n}.png", "a", "", "a square"] for n in range(3)]
    header = ("path", "label", "title", "description")
    manifest = write_manifest(tmp_path / "captions.csv", rows, header)
    if kind == "parquet":
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
        table = pa.table({name: [row[i] or None for row in rows] for i, name in enumerate(header)})
        pq.write_table(table, manifest := tmp_path / "captions.parquet")
    with pytest.raises(ParameterError, match="'title' has no text in any of the 3 row") as refused:
        read_captions(str(manifest), ("title",), None)
    assert "is not a column" not in str(refused.value)
    with pytest.raises(ParameterError, match="'headline' is not a column.*description, label, title"):
        read_captions(str(manifest), ("headline",), None)


def test_manifest_rows_that_are_not_utf8_are_counted_in_one_warning(tmp_path, caplog):
    manifest = tmp_path / "captions.csv"
    lines = [b"path,label,title"] + [f"{n}.png,a,".encode() + (b"caf\xe9" if n % 2 else b"cafe") for n in range(12)]
    manifest.write_bytes(b"\n".join(lines) + b"\n")
    caplog.set_level(logging.WARNING, logger="retrieval")
    paths, captions = read_captions(str(manifest), ("title",), None)
    assert len(paths) == 6 and captions[0] == ["cafe"]
    [line] = warnings_of(caplog)
    assert "6 of 12 rows of" in line and "column 'title' is not valid UTF-8 (manifest line 3)" in line
    assert "and 3 more" in line and "save the manifest as UTF-8" in line


def tower(width: int = 6, dim: int = 4) -> TextTower:
    config = EncoderConfig(vocab_size=10, hidden_size=width, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=8, max_position_embeddings=8, type_vocab_size=2, layer_norm_eps=1e-12)
    return TextTower(SentenceEncoder(config), dim)


def ridge_reference(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """argmin ||[x 1] W - y||^2 + ridge * max(n, 1) * ||W||^2 in float64, as the least squares of the stacked
    system [[x 1]; sqrt(lambda) I] W = [y; 0]."""
    a = np.hstack([x, np.ones((len(x), 1))])
    scale = np.sqrt(ridge * max(len(x), 1))
    stacked = np.vstack([a, scale * np.eye(a.shape[1])])
    return np.linalg.lstsq(stacked, np.vstack([y, np.zeros((a.shape[1], y.shape[1]))]), rcond=None)[0]


@pytest.mark.parametrize("rows", [0, 1, 2, 3, "repeated"])
def test_the_ridge_start_is_finite_for_any_rows_and_matches_a_float64_reference(rows):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5 if rows == "repeated" else rows, 6))
    if rows == "repeated":
        x[:] = x[0]  # one image five times: rank one
    y = rng.normal(size=(len(x), 4))
    model = tower()
    model.fit_projection(torch.from_numpy(x).float(), torch.from_numpy(y).float())
    got = torch.cat([model.projection.weight.T, model.projection.bias[None]]).detach().double().numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ridge_reference(x.astype(np.float32).astype(np.float64), y, 1e-2), atol=1e-5)
