"""`retrieval export --pretrained BACKBONE`: a pretrained backbone as it is, untrained, exported as one verified ONNX
file whose embedding is the backbone's pooled features, L2-normalised, and which indexes a folder at once."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from retrieval.cli.export import export_command
from retrieval.cli.main import main
from retrieval.data import open_image, preprocess_eval
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.export import OnnxEmbedder
from retrieval.models import create_backbone

SIZE = 64


@pytest.fixture(scope="module")
def pretrained_export(tmp_path_factory):
    out = tmp_path_factory.mktemp("pretrained") / "lite0.onnx"
    run = CliRunner().invoke(export_command, ["--pretrained", "efficientnet_lite0", "--image-size", str(SIZE),
                                              "--out", str(out), "--no-text-tower"])  # its tower: its own tests
    assert run.exit_code == 0, run.output
    return out, run.output


def photos(folder) -> list:
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in ("chelsea", "astronaut", "coffee", "rocket"):
        path = folder / f"{name}.png"
        Image.fromarray(getattr(skimage.data, name)()).save(path)
        paths.append(path)
    return paths


def test_the_export_is_verified_and_says_what_it_holds(pretrained_export):
    out, output = pretrained_export
    assert "verified (max |diff| <= 0.0001)" in output
    # letterboxed (pad) unless --resize says otherwise
    assert f"wrote {out}: efficientnet_lite0, input {SIZE} px (pad), 1280-d, normalized=true, fp32" in output
    assert output.splitlines()[-1] == f"next: retrieval index build --model {out} --images YOUR_IMAGES --out INDEX"
    runtime = OnnxEmbedder(out)
    config = json.loads(runtime.metadata["model_config"])
    assert config["head"] == "features" and config["pretrained"] and runtime.metadata["config_hash"] == ""
    assert runtime.metadata["model_hash"] == runtime.model_hash


def test_the_embedding_is_the_backbones_pooled_features_normalised(pretrained_export, tmp_path):
    """Computed independently: the pretrained backbone's own forward pass, divided by its norm."""
    out, _ = pretrained_export
    paths = photos(tmp_path)
    got = OnnxEmbedder(out).embed(paths)
    backbone = create_backbone("efficientnet_lite0", pretrained=True).module.eval()
    config = ModelPreprocessing.from_config(json.loads(OnnxEmbedder(out).metadata["model_config"]))
    with torch.no_grad():
        features = backbone(torch.stack([preprocess_eval(open_image(p), config) for p in paths])).double().numpy()
    want = features / np.linalg.norm(features, axis=1, keepdims=True)
    assert got.shape == (4, 1280) and np.abs(np.linalg.norm(got, axis=1) - 1).max() < 1e-5
    np.testing.assert_allclose(got, want, atol=1e-4)


def test_the_pretrained_model_indexes_and_searches_a_folder_at_once(pretrained_export, tmp_path):
    out, _ = pretrained_export
    paths = photos(tmp_path / "photos")
    build = CliRunner().invoke(main, ["index", "build", "--model", str(out), "--images", str(tmp_path / "photos"),
                                      "--out", str(tmp_path / "idx")])
    assert build.exit_code == 0, build.output
    search = CliRunner().invoke(main, ["search", "--index", str(tmp_path / "idx"), str(paths[2]), "-k", "1",
                                       "--json"])
    assert search.exit_code == 0, search.output
    assert "coffee.png" in search.output


@pytest.mark.parametrize("args, message", [
    ([], "give --checkpoint RUN_DIR/best.pt (a trained model) or --pretrained BACKBONE"),
    (["--checkpoint", "best.pt", "--pretrained", "efficientnet_lite0"], "not both"),
    (["--checkpoint", "best.pt", "--image-size", "64"], "--image-size applies to --pretrained"),
    (["--checkpoint", "best.pt", "--resize", "pad"], "--resize applies to --pretrained"),
])
def test_the_command_takes_a_checkpoint_or_a_backbone(tmp_path, args, message):
    run = CliRunner().invoke(export_command, [*args, "--out", str(tmp_path / "m.onnx")])
    assert run.exit_code == 2 and message in run.output, run.output
    assert not (tmp_path / "m.onnx").exists()


def test_an_unknown_backbone_is_refused_naming_the_known_ones(tmp_path):
    run = CliRunner().invoke(export_command, ["--pretrained", "no_such_net", "--out", str(tmp_path / "m.onnx")])
    assert run.exit_code == 1 and "--pretrained is unknown: 'no_such_net'" in run.output, run.output
    assert "efficientnet_lite0" in run.output
    assert "Traceback" not in run.output



def test_a_letterboxing_export_tells_apart_what_the_centre_crop_merges(pretrained_export, tmp_path):
    """Two 300 x 84 symbols that differ only at their ends: one embedding under crop (cosine 1.000: `index
    duplicates` grouped them), two under pad (the default); the mode is in the file's metadata and its model_hash."""
    pad, _ = pretrained_export
    crop = tmp_path / "crop.onnx"
    run = CliRunner().invoke(export_command, ["--pretrained", "efficientnet_lite0", "--image-size", str(SIZE),
                                              "--resize", "crop", "--out", str(crop), "--no-verify",
                                              "--no-text-tower"])
    assert run.exit_code == 0 and f"input {SIZE} px (crop)" in run.output, run.output
    symbols = []
    for name, (top, bottom, right) in {"treble": (10, 74, 30), "bass": (30, 54, 60)}.items():
        pixels = np.full((84, 300, 3), 255, np.uint8)
        pixels[20:64, 100:200] = 40
        pixels[top:bottom, 5:right] = (200, 0, 0) if name == "treble" else (0, 0, 200)
        symbols.append(tmp_path / f"{name}.png")
        Image.fromarray(pixels).save(symbols[-1])
    by_crop, by_pad = OnnxEmbedder(crop).embed(symbols), OnnxEmbedder(pad).embed(symbols)
    assert float(by_crop[0] @ by_crop[1]) > 0.9999
    assert float(by_pad[0] @ by_pad[1]) < 0.99
    assert OnnxEmbedder(pad).metadata["resize"] == "pad" and OnnxEmbedder(crop).metadata["resize"] == "crop"
    assert OnnxEmbedder(pad).model_hash != OnnxEmbedder(crop).model_hash
