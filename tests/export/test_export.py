"""ONNX export: parity with PyTorch on real images, metadata, dynamic batch, OnnxEmbedder, CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper
from PIL import Image
from torch import nn

import retrieval.export.onnx_export as onnx_export
from retrieval import onnx_runtime
from retrieval.cli.export import export_command
from retrieval.data import open_image, preprocess_eval
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.export import ExportVerificationError, OnnxEmbedder, export_embedder, sample_images, verify_export
from retrieval.models import CHECKPOINT_FORMAT, config_hash, create_embedder
from retrieval.onnx_runtime import embedder_model_hash, onnx_model_hash, preprocess_images, resolve_providers
from retrieval.records.run_config import RunConfig

SIZE = 64  # small inputs keep the tests fast; the graph is the same as at 224


def torch_embed_files(model: nn.Module, paths) -> np.ndarray:
    """The PyTorch path: open_image (EXIF, RGB) -> preprocess_eval -> Embedder."""
    batch = torch.stack([preprocess_eval(open_image(p), model.preprocessing) for p in paths])
    with torch.no_grad():
        return model.eval()(batch).numpy()


@pytest.fixture(scope="module")
def lite0():
    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=32, pretrained=True).eval()
    model.config = model.config.with_fields({"input_size": SIZE})
    return model


@pytest.fixture(scope="module")
def lite0_export(lite0, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "lite0.onnx"
    lines: list[str] = []
    result = export_embedder(lite0, path, config_hash="cafe0123", log=lines.append)
    return result, lines


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """Real photos saved in awkward forms: EXIF-rotated JPEG, grayscale, RGBA and palette PNGs."""
    import skimage.data

    folder = tmp_path_factory.mktemp("images")
    chelsea = Image.fromarray(skimage.data.chelsea())  # 451 x 300: a rotation changes the crop
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    files = {
        "exif": folder / "exif.jpg",
        "gray": folder / "gray.png",
        "rgba": folder / "rgba.png",
        "palette": folder / "palette.png",
        "rgb": folder / "coffee.png",
    }
    chelsea.save(files["exif"], exif=exif, quality=95)
    Image.fromarray(skimage.data.camera()).save(files["gray"])
    rocket = Image.fromarray(skimage.data.rocket()).convert("RGBA")
    alpha = np.tile(np.linspace(64, 255, rocket.width, dtype=np.uint8), (rocket.height, 1))
    rocket.putalpha(Image.fromarray(alpha))
    rocket.save(files["rgba"])
    Image.fromarray(skimage.data.astronaut()).quantize(64).save(files["palette"])
    Image.fromarray(skimage.data.coffee()).save(files["rgb"])
    return files


# ---------------------------------------------------------------- export + verification

def test_export_verifies_fp32_on_real_images_at_batch_1_and_7(lite0_export):
    result, lines = lite0_export
    report = result.verification
    assert result.exporter == "dynamo" and result.precision == "fp32"
    assert [c.batch_size for c in report.checks] == [1, 7]
    assert all(c.max_abs_diff <= 1e-4 and c.min_cosine > 0.99999 for c in report.checks)
    assert report.images[:2] == ["chelsea", "astronaut"]
    assert any(line.startswith("verified") and "batch 7: max |diff|" in line for line in lines)
    # weights are inside the one file (no external data for a small model)
    assert result.external_data == [] and result.file_bytes == result.path.stat().st_size > 10 * 2**20


def test_parity_recomputed_independently(lite0, lite0_export):
    result, _ = lite0_export
    images = [image for _, image in sample_images(7)]
    batch = torch.stack([preprocess_eval(image, lite0.preprocessing) for image in images])
    with torch.no_grad():
        reference = lite0(batch).numpy()
    runtime = OnnxEmbedder(result.path, providers="cpu")
    for n in (1, 7):
        out = runtime.embed(images[:n])
        assert out.dtype == np.float32 and out.shape == (n, 32)
        assert np.abs(out - reference[:n]).max() <= 1e-4


def test_metadata_round_trip(lite0, lite0_export):
    result, _ = lite0_export
    props = {p.key: p.value for p in onnx.load(str(result.path)).metadata_props}
    assert props["embedding_dim"] == "32" and props["input_size"] == str(SIZE)
    assert props["backbone"] == "efficientnet_lite0" and props["normalized"] == "true"
    assert props["config_hash"] == "cafe0123" and props["precision"] == "fp32"
    runtime = OnnxEmbedder(result.path)
    assert runtime.embedding_dim == 32 and runtime.input_size == SIZE and runtime.normalized
    # one model, one hash: what the export prints and stores is what every reader computes from the
    # file's graph and weights; the PyTorch weights' fingerprint is kept as lineage
    assert props["model_hash"] == result.model_hash == runtime.model_hash
    assert runtime.model_hash == onnx_model_hash(result.path, runtime.preprocessing)
    assert props["source_model_hash"] == runtime.source_model_hash == embedder_model_hash(lite0)
    assert runtime.source_model_hash != runtime.model_hash and runtime.config_hash == "cafe0123"
    assert runtime.metadata == props
    # the model's whole config travels as it is; the record read from the metadata is the PyTorch model's
    assert json.loads(props["model_config"]) == lite0.config.to_json()
    assert runtime.preprocessing == lite0.preprocessing
    image = sample_images(1)[0][1]
    assert torch.equal(preprocess_eval(image, runtime.preprocessing), preprocess_eval(image, lite0.preprocessing))


def test_dynamic_batch_axis(lite0, lite0_export):
    result, _ = lite0_export
    dim0 = onnx.load(str(result.path)).graph.input[0].type.tensor_type.shape.dim[0]
    assert dim0.dim_param and not dim0.dim_value
    runtime = OnnxEmbedder(result.path, providers="cpu", batch_size=64)
    gen = torch.Generator().manual_seed(1)
    for n in (3, 5):
        batch = torch.randn(n, 3, SIZE, SIZE, generator=gen)
        with torch.no_grad():
            reference = lite0(batch).numpy()
        out = runtime.embed_batch(batch.numpy())
        assert out.shape == (n, 32) and np.abs(out - reference).max() <= 1e-4


def test_onnx_embedder_matches_torch_on_files(lite0, lite0_export, image_files):
    result, _ = lite0_export
    paths = list(image_files.values())
    runtime = OnnxEmbedder(result.path, providers="cpu", batch_size=2)  # several chunks
    out = runtime.embed(paths)
    reference = torch_embed_files(lite0, paths)
    assert out.shape == (len(paths), 32)
    assert np.abs(out - reference).max() <= 1e-4
    # normalised model: unit norm rows
    np.testing.assert_allclose(np.linalg.norm(out, axis=1), 1.0, atol=1e-5)
    # a single path and a PIL image give the same row as the batch
    np.testing.assert_allclose(runtime.embed(str(paths[1]))[0], out[1], atol=1e-5)
    np.testing.assert_allclose(runtime.embed(open_image(paths[0]))[0], out[0], atol=1e-5)


def test_exif_orientation_is_applied(lite0_export, image_files):
    result, _ = lite0_export
    runtime = OnnxEmbedder(result.path, providers="cpu")
    path = image_files["exif"]
    assert open_image(path).size == (300, 451)  # rotated from the stored 451 x 300
    with Image.open(path) as raw:
        unrotated = runtime.embed(raw.convert("RGB"))[0]
    rotated = runtime.embed(path)[0]
    assert np.abs(rotated - unrotated).max() > 1e-2


def test_failing_verification_raises_with_numbers(lite0, lite0_export, tmp_path, monkeypatch):
    result, _ = lite0_export
    proto = onnx.load(str(result.path))
    for init in proto.graph.initializer:  # shift every 32-vector (the head bias among them)
        if list(init.dims) == [32] and init.data_type == onnx.TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 0.05, init.name))
    tampered = tmp_path / "tampered.onnx"
    onnx.save(proto, str(tampered))
    with pytest.raises(ExportVerificationError) as info:
        verify_export(lite0, tampered)
    message = str(info.value)
    assert "batch 1: max |diff|" in message and "batch 7: max |diff|" in message and "Try:" in message
    assert all(c.max_abs_diff > 1e-4 and not c.passed for c in info.value.report.checks)
    # through export_embedder: the bad file is removed
    monkeypatch.setattr(onnx_export, "export_graph", lambda *args: (onnx.load(str(tampered)), "dynamo"))
    out = tmp_path / "bad.onnx"
    with pytest.raises(ExportVerificationError, match="required max"):
        export_embedder(lite0, out, log=lambda _: None)
    assert not out.exists()


# ---------------------------------------------------------------- CLI end to end (fp16, unnormalised)

def test_cli_export_fp16_unnormalised_then_embed(tmp_path, image_files):
    torch.manual_seed(0)
    model = create_embedder("resnet18", embedding_dim=16, pretrained=False, normalize=False).eval()
    model.config = model.config.with_fields({"input_size": SIZE})
    train_config = {"dataset": "digits", "backbone": "resnet18", "image_size": SIZE}
    ckpt = tmp_path / "best.pt"
    torch.save({"format": CHECKPOINT_FORMAT, "model_config": model.config.to_json(), "state_dict": model.state_dict(),
                "train_config": train_config, "config_hash": config_hash(RunConfig.from_json(train_config)), "epoch": 1,
                "metrics": {}}, ckpt)
    out = tmp_path / "model.onnx"
    run = CliRunner().invoke(export_command, ["--checkpoint", str(ckpt), "--out", str(out), "--fp16"])
    assert run.exit_code == 0, run.output
    assert "exporting resnet18" in run.output and "verified (min cosine >= 0.999)" in run.output
    runtime = OnnxEmbedder(out)
    assert runtime.metadata["precision"] == "fp16" and not runtime.normalized
    # the hash the command prints is the one the file is known by everywhere (the fp16 graph's own)
    assert f"model_hash {runtime.model_hash}" in run.output and runtime.metadata["model_hash"] == runtime.model_hash
    assert run.output.splitlines()[-1] == f"next: retrieval index build --model {out} --images YOUR_IMAGES --out INDEX"
    assert runtime.config_hash == config_hash(RunConfig.from_json(train_config))
    weights = [i for i in onnx.load(str(out)).graph.initializer if len(i.dims) == 4]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)
    paths = list(image_files.values())
    got, want = runtime.embed(paths), torch_embed_files(model, paths)
    cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.dtype == np.float32 and cosine.min() >= 0.999
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() > 0.1  # not normalised


def test_cli_reports_missing_checkpoint(tmp_path):
    run = CliRunner().invoke(export_command, ["--checkpoint", str(tmp_path / "no.pt"), "--out",
                                              str(tmp_path / "m.onnx")])
    assert run.exit_code != 0 and "checkpoint not found" in run.output


# ---------------------------------------------------------------- fallback, errors, providers, hash

def test_legacy_fallback_logs_and_keeps_dynamic_batch(monkeypatch):
    def broken(*args):
        raise RuntimeError("unsupported op for this test")

    monkeypatch.setattr(onnx_export, "_dynamo_export", broken)
    tiny = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()
    lines: list[str] = []
    proto, exporter = onnx_export.export_graph(tiny, 16, None, lines.append)
    assert exporter == "legacy"
    assert any("falling back to the legacy" in line and "unsupported op" in line for line in lines)
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 16, 16)
    out = session.run(None, {"images": x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(out, tiny(x).numpy(), atol=1e-5)


def test_onnx_embedder_clear_errors(tmp_path, lite0_export):
    with pytest.raises(FileNotFoundError, match="retrieval export"):
        OnnxEmbedder(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        OnnxEmbedder(junk)
    bare = tmp_path / "bare.onnx"
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [None, 4])],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, str(bare))
    with pytest.raises(ValueError, match="not exported by `retrieval export`"):
        OnnxEmbedder(bare)
    runtime = OnnxEmbedder(lite0_export[0].path)
    with pytest.raises(ValueError, match=r"shape \[n, 3, 64, 64\]"):
        runtime.embed_batch(np.zeros((2, 3, 32, 32), dtype=np.float32))
    with pytest.raises(ValueError, match="floating point"):
        runtime.embed_batch(np.zeros((1, 3, SIZE, SIZE), dtype=np.uint8))
    with pytest.raises(TypeError, match="PIL image or a file path"):
        runtime.embed([42])
    assert runtime.embed([]).shape == (0, 32)


def test_resolve_providers(monkeypatch):
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert resolve_providers("auto") == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert resolve_providers("cpu") == ["CPUExecutionProvider"]
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert resolve_providers("auto") == ["CPUExecutionProvider"]
    with pytest.raises(RuntimeError, match="onnxruntime-gpu"):
        resolve_providers("cuda")
    with pytest.raises(ValueError, match="providers must be"):
        resolve_providers("tpu")


def test_model_hash_tracks_weights_not_the_dtype_they_are_held_in():
    import copy

    torch.manual_seed(0)
    model = create_embedder("resnet18", embedding_dim=8, pretrained=False)
    before = embedder_model_hash(model)
    assert embedder_model_hash(copy.deepcopy(model).double()) == before  # same fp32 values
    assert embedder_model_hash(model, replace(model.preprocessing, input_size=32)) != before  # preprocessing counts
    with torch.no_grad():
        model.head.linear.bias[0] += 1e-3
    assert embedder_model_hash(model) != before
    assert len(before) == 16


def test_preprocess_images_is_the_eval_pipeline(image_files):
    config = ModelPreprocessing(input_size=48, mean=(0.5, 0.4, 0.3), std=(0.2, 0.3, 0.4))
    paths = list(image_files.values())
    batch = preprocess_images(paths, config)
    expected = torch.stack([preprocess_eval(open_image(p), config) for p in paths]).numpy()
    assert batch.dtype == np.float32 and batch.shape == (len(paths), 3, 48, 48)
    np.testing.assert_array_equal(batch, expected)
    assert onnx_runtime.load_image(paths[0]).mode == "RGB"


def test_a_model_with_external_weights_is_known_by_the_hash_it_prints(tmp_path, monkeypatch):
    """Weights over protobuf's 2 GiB go to a .data file (here forced with a tiny limit): the stored and printed
    model_hash is still the one readers compute from the file."""
    import retrieval.export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "PROTOBUF_LIMIT_BYTES", 1000)
    torch.manual_seed(0)
    model = create_embedder("resnet18", embedding_dim=8, pretrained=False).eval()
    model.config = model.config.with_fields({"input_size": SIZE})
    printed = []
    result = onnx_export.export_embedder(model, tmp_path / "big.onnx", verify=False, log=printed.append)
    assert result.external_data == [tmp_path / "big.onnx.data"]
    runtime = OnnxEmbedder(result.path)
    assert runtime.metadata["model_hash"] == result.model_hash == runtime.model_hash
    assert any(f"model_hash {runtime.model_hash}" in line for line in printed)
