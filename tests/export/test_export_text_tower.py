"""`retrieval export --pretrained efficientnet_lite0` also writes its zero-shot text tower beside the model and names
it in the model's metadata (the model's hash unchanged); `retrieval index build` records it, so `retrieval search
--text` answers with no other step. The tower is trained on a subset of the classes here (the command's settings,
made smaller), so that the file runs in a minute."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from PIL import Image

from retrieval.cli.main import main
from retrieval.train import zero_shot_tower
from retrieval.train.zero_shot_tower import ZeroShotSettings

SIZE = 64


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """model.onnx and model.text.onnx, as `retrieval export --pretrained` writes them, and its output."""
    patch = pytest.MonkeyPatch()
    patch.setattr(zero_shot_tower, "DEFAULT_SETTINGS",
                  ZeroShotSettings(prompts=("names", "photo"), epochs=3, classes=80))
    try:
        out = tmp_path_factory.mktemp("zero-shot") / "model.onnx"
        run = CliRunner().invoke(main, ["export", "--pretrained", "efficientnet_lite0", "--image-size", str(SIZE),
                                        "--no-verify", "--out", str(out)])
    finally:
        patch.undo()
    assert run.exit_code == 0, run.output
    return out, run.output


def gallery(folder):
    import skimage.data

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("chelsea", "astronaut", "coffee", "rocket", "camera"):
        Image.fromarray(getattr(skimage.data, name)()).convert("RGB").save(folder / f"{name}.png")
    return folder


def model_copy(exported, folder, text: bool = True):
    """The exported model (and its text tower) copied into ``folder``: a test that changes files changes its own."""
    folder.mkdir(parents=True, exist_ok=True)
    out, _ = exported
    shutil.copy(out, folder / out.name)
    if text:
        shutil.copy(out.with_name("model.text.onnx"), folder / "model.text.onnx")
    return folder / out.name


def test_export_writes_the_text_tower_and_names_it_in_the_model(exported):
    from retrieval.onnx_runtime import OnnxEmbedder
    from retrieval.text.text_onnx import TextEmbedder, file_hash

    out, output = exported
    text_path = out.with_name("model.text.onnx")
    model, text = OnnxEmbedder(out), TextEmbedder(text_path)
    assert model.metadata["text_model"] == "model.text.onnx"
    assert model.metadata["text_model_hash"] == file_hash(text_path) == text.model_hash
    assert text.image_model_hash == model.model_hash and text.dim == 1280
    meta = dict(text.session.get_modelmeta().custom_metadata_map)
    classes = json.loads(meta["zero_shot_classes"])
    assert len(classes) == 1000 and classes[281] == "tabby" and meta["text_origin"] == "zero-shot"
    assert f"wrote {text_path}: zero-shot text tower, 1000 classes" in output
    assert output.rstrip().splitlines()[-1].startswith("next: retrieval index build")


def test_naming_the_text_tower_leaves_the_model_hash_as_it_was(exported, tmp_path):
    """The hash of the graph and weights, recomputed from the file, equals the one written before the metadata was
    added, and equals it again once the two keys are taken out."""
    import onnx

    from retrieval.onnx_runtime import OnnxEmbedder, onnx_model_hash
    from retrieval.utils.onnx_hash import proto_model_hash

    out, _ = exported
    model = OnnxEmbedder(out)
    assert onnx_model_hash(out, model.preprocessing) == model.metadata["model_hash"] == model.model_hash
    proto = onnx.load(str(out))
    kept = [p for p in proto.metadata_props if p.key not in ("text_model", "text_model_hash")]
    assert len(kept) == len(proto.metadata_props) - 2
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    assert proto_model_hash(proto, model.preprocessing) == model.model_hash


def test_no_text_tower_skips_it_and_other_backbones_get_none_in_one_line(tmp_path, monkeypatch):
    from retrieval.cli import export as export_cli

    out = tmp_path / "plain" / "model.onnx"
    run = CliRunner().invoke(main, ["export", "--pretrained", "efficientnet_lite0", "--image-size", str(SIZE),
                                    "--no-verify", "--no-text-tower", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert not out.with_name("model.text.onnx").exists() and "text tower" not in run.output
    from retrieval.onnx_runtime import OnnxEmbedder

    assert "text_model" not in OnnxEmbedder(out).metadata
    monkeypatch.setattr(zero_shot_tower, "IMAGENET_HEADS", {})  # as a backbone without an ImageNet head
    said = []
    monkeypatch.setattr(export_cli.click, "echo", lambda line="", **_: said.append(str(line)))
    assert export_cli._zero_shot_tower("efficientnet_lite0", out, out, "0" * 16, progress=False) == {}
    assert len(said) == 1 and said[0].startswith("no text tower: efficientnet_lite0 has no ImageNet classifier")


def test_index_build_records_the_tower_and_search_by_text_answers(exported, tmp_path):
    from retrieval.text.text_onnx import file_hash

    model = model_copy(exported, tmp_path / "models")
    index = tmp_path / "index"
    run = CliRunner().invoke(main, ["index", "build", "--model", str(model), "--images",
                                    str(gallery(tmp_path / "photos")), "--out", str(index), "--json"])
    assert run.exit_code == 0, run.output
    info = json.loads((index / "index.json").read_text())
    assert info["text_model_hash"] == file_hash(model.with_name("model.text.onnx"))
    assert info["text_model_path_relative"] == "../models/model.text.onnx"
    search = CliRunner().invoke(main, ["search", "--index", str(index), "--text", "a cat", "-k", "3", "--json"])
    assert search.exit_code == 0, search.output
    answer = json.loads(search.output)
    hits = answer[0]["results"] if isinstance(answer, list) else answer["results"]
    assert len(hits) == 3


@pytest.mark.parametrize("damage", ["missing", "replaced"])
def test_a_missing_or_replaced_tower_is_one_warning_and_the_build_goes_on(exported, tmp_path, damage, caplog):
    model = model_copy(exported, tmp_path / "models")
    text = model.with_name("model.text.onnx")
    if damage == "missing":
        text.unlink()
    else:
        text.write_bytes(text.read_bytes() + b"\0")
    index = tmp_path / "index"
    with caplog.at_level("WARNING", logger="retrieval.text.sibling_text"):
        run = CliRunner().invoke(main, ["index", "build", "--model", str(model), "--images",
                                        str(gallery(tmp_path / "photos")), "--out", str(index)])
    assert run.exit_code == 0, run.output
    assert "text_model_hash" not in json.loads((index / "index.json").read_text())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no text model recorded" in warnings[0]
    assert ("missing" if damage == "missing" else "it was replaced") in warnings[0]
