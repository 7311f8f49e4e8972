"""`retrieval text train` starts from the zero-shot tower the image model names (what `retrieval export --pretrained`
writes beside it), never delivers worse than that start on the held-out captions, and says when the start won."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from sample_images import noisy_png
from text_towers import small_encoder_folder

from retrieval.cli.main import main
from retrieval.index.query_embedder import load_model
from retrieval.text.sibling_text import ZERO_SHOT, ZERO_SHOT_CLASSES
from retrieval.text.text_onnx import TextEmbedder

COLOURS = {"red": (200, 40, 40), "green": (40, 200, 40), "blue": (40, 40, 200), "yellow": (200, 200, 40),
           "purple": (140, 40, 160), "orange": (230, 130, 20)}


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A 24-d image model with a zero-shot tower named beside it (a small BERT's, its classes the colours), a small
    encoder folder of the same name the tower records, and a manifest of 6 colours x 6 captioned images."""
    import torch

    from retrieval.export.text_export import export_text_tower, link_text_model
    from retrieval.text.encoder import SentenceEncoder
    from retrieval.text.tokens import TextTokenizer
    from retrieval.text.tower import ClassBridge, TextTower

    root = tmp_path_factory.mktemp("zero_shot_start")
    encoder = small_encoder_folder(root / "encoder")
    (root / "models").mkdir()
    model = write_projection_onnx(root / "models" / "model.onnx", dim=24, seed=0)
    model_hash = load_model(model).model_hash
    torch.manual_seed(1)
    tower = TextTower(SentenceEncoder.from_folder(encoder), 24)
    # a class bridge as the export's: each colour's two texts onto a row of its own
    texts = [f"{prefix}{colour}" for colour in COLOURS for prefix in ("", "a photo of a ")]
    tokenizer = TextTokenizer.from_file(str(encoder / "tokenizer.json"), 32)
    with torch.no_grad():
        features = tower.encoder(*map(torch.from_numpy, tokenizer(texts)))
    tower.bridge = ClassBridge.of_texts(features, torch.arange(len(texts)) // 2, torch.randn(len(COLOURS), 24),
                                        temperature=0.1, top=3)
    export_text_tower(tower, tokenizer, root / "models" / "model.text.onnx", model_hash,
                      {"name": "encoder", "layers_tuned": 0},
                      ["a red thing"], origin=ZERO_SHOT, extra={
                          ZERO_SHOT_CLASSES: json.dumps(list(COLOURS)),
                          "zero_shot_training": json.dumps({"bridge_temperature": 0.1, "bridge_top": 3})})
    link_text_model(model, root / "models" / "model.text.onnx")
    rows = [["path", "label", "title"]]
    for colour, rgb in COLOURS.items():
        (root / "g" / colour).mkdir(parents=True)
        for n in range(6):
            (root / "g" / colour / f"{n}.png").write_bytes(noisy_png(rgb, 10 * len(rows) + n))
            rows.append([f"{colour}/{n}.png", colour, f"a {colour} square"])
    with open(root / "g" / "manifest.csv", "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return {"root": root, "encoder": encoder, "model": model, "manifest": root / "g" / "manifest.csv",
            "tower": root / "models" / "model.text.onnx"}


def _train(shop, out, *extra):
    return CliRunner().invoke(main, ["text", "train", "--model", str(shop["model"]), "--images",
                                     str(shop["manifest"]), "--caption-column", "title", "--out", str(out),
                                     "--encoder", str(shop["encoder"]), "--batch-size", "8", *map(str, extra)])


def test_training_starts_from_the_zero_shot_tower_and_is_never_worse_than_it(shop, tmp_path):
    result = _train(shop, tmp_path / "run", "--epochs", "4", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    start = report["start"]
    assert start["kind"] == "zero-shot" and start["text_model"] == str(shop["tower"])
    assert report["history"][0]["recall@10"] == start["recall@10"]
    assert report["held_out"]["recall@10"] >= start["recall@10"]  # the start is a candidate, chosen on ties
    assert json.loads(TextEmbedder(tmp_path / "run" / "text.onnx").session.get_modelmeta()
                      .custom_metadata_map["caption_columns"]) == ["title"]  # what an upgrade measures it on


def test_the_start_wins_where_no_epoch_beats_it_and_text_onnx_maps_as_the_start_does(shop, tmp_path):
    result = _train(shop, tmp_path / "run", "--epochs", "2", "--lr", "1e-12", "--anchor-weight", "0")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["chosen_epoch"] == 0 and "the zero-shot start won" in result.output
    texts = ["a red square", "a blue square", "something else entirely"]
    delivered, start = TextEmbedder(tmp_path / "run" / "text.onnx"), TextEmbedder(shop["tower"])
    np.testing.assert_allclose(delivered.embed(texts), start.embed(texts), atol=1e-5)


def test_the_ridge_start_is_kept_on_request_and_a_missing_zero_shot_start_is_refused_when_insisted_on(shop, tmp_path):
    ridge = _train(shop, tmp_path / "ridge", "--epochs", "1", "--start", "ridge")
    assert ridge.exit_code == 0, ridge.output
    assert json.loads((tmp_path / "ridge" / "report.json").read_text())["start"]["kind"] == "ridge"
    bare = write_projection_onnx(tmp_path / "bare.onnx", dim=24, seed=0)  # the same model, no tower beside it
    refused = CliRunner().invoke(main, ["text", "train", "--model", str(bare), "--images", str(shop["manifest"]),
                                        "--caption-column", "title", "--out", str(tmp_path / "z"), "--encoder",
                                        str(shop["encoder"]), "--start", "zero-shot"])
    assert refused.exit_code != 0 and "names no text tower" in refused.output
    auto = CliRunner().invoke(main, ["text", "train", "--model", str(bare), "--images", str(shop["manifest"]),
                                     "--caption-column", "title", "--out", str(tmp_path / "a"), "--encoder",
                                     str(shop["encoder"]), "--epochs", "1"])
    assert auto.exit_code == 0, auto.output
    assert json.loads((tmp_path / "a" / "report.json").read_text())["start"]["kind"] == "ridge"


def test_a_damaged_tower_beside_the_model_falls_back_to_the_ridge_start_saying_why(shop, tmp_path):
    from retrieval.export.text_export import link_text_model

    folder = tmp_path / "damaged"
    folder.mkdir()
    model = write_projection_onnx(folder / "model.onnx", dim=24, seed=0)
    (folder / "model.text.onnx").write_bytes(b"not an onnx file at all")
    link_text_model(model, folder / "model.text.onnx")  # named with its hash: found, then unreadable
    auto = CliRunner().invoke(main, ["text", "train", "--model", str(model), "--images", str(shop["manifest"]),
                                     "--caption-column", "title", "--out", str(tmp_path / "a"), "--encoder",
                                     str(shop["encoder"]), "--epochs", "1"])
    assert auto.exit_code == 0, auto.output
    assert json.loads((tmp_path / "a" / "report.json").read_text())["start"]["kind"] == "ridge"
    insisted = CliRunner().invoke(main, ["text", "train", "--model", str(model), "--images", str(shop["manifest"]),
                                         "--caption-column", "title", "--out", str(tmp_path / "z"), "--encoder",
                                         str(shop["encoder"]), "--start", "zero-shot"])
    assert insisted.exit_code != 0 and "cannot be read as a zero-shot tower" in insisted.output
