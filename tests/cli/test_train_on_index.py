"""Adapting a model to the gallery an index serves is two commands: `retrieval train --data INDEX --labels none`
(which exports the adapted model beside the run) and the `retrieval index upgrade` it prints."""

from __future__ import annotations

import json

from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import QUICK
from sample_images import noisy_png

from retrieval.cli.main import main
from retrieval.index import Index, build_index, load_model
from retrieval.index.formats.gallery_images import load_unlabelled

COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200)]


def indexed_gallery(tmp_path):
    """An index of 18 coloured images (three colours) built with a projection model."""
    gallery = tmp_path / "gallery"
    for label, colour in enumerate(COLOURS):
        (gallery / f"class{label}").mkdir(parents=True)
        for n in range(6):
            (gallery / f"class{label}" / f"img_{n}.png").write_bytes(noisy_png(colour, 100 * label + n))
    old = write_projection_onnx(tmp_path / "old.onnx", dim=24, seed=0)
    build_index(gallery, tmp_path / "idx", model=old, options=QUICK)
    return gallery, tmp_path / "idx"


def train_on(index, run, *extra: str):
    return CliRunner().invoke(main, [
        "train", "--dataset", "folder", "--data", str(index), "--labels", "none",
        "--backbone", "timm:test_resnet", "--no-pretrained", "--image-size", "32", "--embedding-dim", "16",
        "--loss", "ntxent", "--batch-size", "6", "--per-class", "2", "--epochs", "1", "--workers", "0",
        "--device", "cpu", "--no-plots", "--no-tensorboard", "--out", str(run), *extra])


def test_train_on_an_index_then_upgrade_it(tmp_path):
    gallery, index = indexed_gallery(tmp_path)
    assert sorted(load_unlabelled(index).samples) == sorted(str(p) for p in gallery.rglob("*.png"))

    run = tmp_path / "run"
    # 18 images are too few for the label-free check, which would keep the index as it is
    trained = train_on(index, run, "--no-label-free-check", "--json")
    assert trained.exit_code == 0, trained.output
    summary = json.loads(trained.output[trained.output.index("{"):])
    assert summary["model"] == str(run / "model.onnx")
    assert summary["next"] == f"retrieval index upgrade {tmp_path / 'idx'} --model {run / 'model.onnx'}"

    upgraded = CliRunner().invoke(main, summary["next"].split()[1:] + ["--json"])
    assert upgraded.exit_code == 0, upgraded.output
    with Index.open(tmp_path / "idx") as index:
        assert index.model_hash == load_model(run / "model.onnx").model_hash and len(index) == 18


def test_an_index_whose_trained_model_the_check_rejects_is_kept_as_it_is(tmp_path):
    _, index = indexed_gallery(tmp_path)
    run = tmp_path / "run"
    trained = train_on(index, run)
    assert trained.exit_code == 0, trained.output
    assert not (run / "model.onnx").exists()  # nothing exported for an upgrade
    lines = trained.output.strip().splitlines()
    assert not any("index upgrade" in line for line in lines)
    assert f"keep the index {index} as it is: no upgrade" in lines
    assert lines[-1] == ("next: retrieval export --pretrained timm:test_resnet --resize crop --image-size 32 --out "
                         "model.onnx   (keep the pretrained export)")
