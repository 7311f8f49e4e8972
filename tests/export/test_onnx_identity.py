"""ONNX files: decoded images embed alike whatever their encoding; identity comes from the file, not its metadata."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import skimage.data
from PIL import Image
from sample_images import sticker
from serve_fixtures import export_model

from retrieval.index import Index, IngestOptions, build_index
from retrieval.index.query_embedder import ModelMismatchError
from retrieval.onnx_runtime import OnnxEmbedder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return export_model(tmp_path_factory.mktemp("onnx") / "model.onnx")


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_transparent_png_embeds_like_the_same_image_flattened_on_the_background(model_path, tmp_path):
    runtime = OnnxEmbedder(model_path)
    assert runtime.preprocessing.background == (255, 255, 255)
    transparent = sticker(96)
    flattened = Image.new("RGB", transparent.size, (255, 255, 255))
    flattened.paste(transparent, mask=transparent.getchannel("A"))
    transparent.save(tmp_path / "transparent.png")
    flattened.save(tmp_path / "flattened.png")
    embeddings = runtime.embed([tmp_path / "transparent.png", tmp_path / "flattened.png"])
    assert cosine(embeddings[0], embeddings[1]) >= 0.9999


def test_16_bit_png_embeds_like_its_8_bit_version(model_path, tmp_path):
    camera = skimage.data.camera()  # a real 8-bit greyscale photograph
    Image.fromarray(camera).save(tmp_path / "camera8.png")
    Image.fromarray(camera.astype(np.uint16) * 257).save(tmp_path / "camera16.png")
    assert Image.open(tmp_path / "camera16.png").mode.startswith("I")
    embeddings = OnnxEmbedder(model_path).embed([tmp_path / "camera8.png", tmp_path / "camera16.png"])
    assert cosine(embeddings[0], embeddings[1]) >= 0.999


def edited(source, out, **changes) -> OnnxEmbedder | None:
    """A copy of ``source`` with some metadata values replaced."""
    proto = onnx.load(str(source))
    for prop in proto.metadata_props:
        if prop.key in changes:
            prop.value = changes[prop.key]
    onnx.save(proto, str(out))
    return out


def metadata_of(path) -> dict[str, str]:
    return {p.key: p.value for p in onnx.load(str(path)).metadata_props}


def test_model_hash_comes_from_the_weights_not_the_metadata(model_path, tmp_path):
    import torch

    from retrieval.export import export_embedder
    from retrieval.models import create_embedder

    torch.manual_seed(1)  # another random head: a different model
    other = create_embedder("efficientnet_lite0", embedding_dim=32, pretrained=True).eval()
    other.config = other.config.with_fields({"input_size": 64})
    export_embedder(other, tmp_path / "other.onnx", verify=False, log=lambda _: None)
    impostor = edited(tmp_path / "other.onnx", tmp_path / "impostor.onnx", **metadata_of(model_path))
    assert metadata_of(impostor)["model_hash"] == metadata_of(model_path)["model_hash"]
    assert OnnxEmbedder(impostor).model_hash != OnnxEmbedder(model_path).model_hash

    gallery = tmp_path / "gallery"
    gallery.mkdir()
    for i, colour in enumerate([(255, 0, 0), (0, 255, 0), (0, 0, 255)]):
        Image.new("RGB", (32, 32), colour).save(gallery / f"{i}.png")
    build_index(gallery, tmp_path / "index", model=model_path,
                options=IngestOptions(workers=0, progress=False))
    with Index.open(tmp_path / "index") as index, pytest.raises(ModelMismatchError, match="model_hash"):
        index.search_images([gallery / "0.png"], k=1, embedder=OnnxEmbedder(impostor))


def test_edited_preprocessing_is_a_different_model(model_path, tmp_path):
    original = OnnxEmbedder(model_path)
    for key, value in (("mean", json.dumps([0.0, 0.0, 0.0])), ("background", json.dumps([0, 0, 0]))):
        changed = OnnxEmbedder(edited(model_path, tmp_path / f"{key}.onnx", **{key: value}))
        assert changed.model_hash != original.model_hash, key


@pytest.mark.parametrize("key,value,match", [
    ("input_size", "32", "input_size 32 but the graph's input has shape"),
    ("embedding_dim", "64", "embedding_dim 64 but the graph's output has shape"),
])
def test_metadata_that_disagrees_with_the_graph_is_a_clear_error(model_path, tmp_path, key, value, match):
    with pytest.raises(ValueError, match=match + ".*retrieval export"):
        OnnxEmbedder(edited(model_path, tmp_path / "bad.onnx", **{key: value}))


def test_the_hash_is_of_the_weights_that_run_even_when_the_file_is_swapped_while_loading(model_path, tmp_path,
                                                                                         monkeypatch):
    """One read of the file is both run and hashed: a file replaced between two reads would run other weights
    under the first file's hash."""
    import onnxruntime
    from onnx import numpy_helper

    proto = onnx.load(str(model_path))
    head = max(proto.graph.initializer, key=lambda t: (len(t.dims) == 2, t.dims[0] if t.dims else 0))
    head.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(head), head.name))  # other weights, same metadata
    other = tmp_path / "other.onnx"
    onnx.save(proto, str(other))
    honest = {path: OnnxEmbedder(path) for path in (model_path, other)}
    assert honest[model_path].model_hash != honest[other].model_hash

    served = tmp_path / "served.onnx"
    served.write_bytes(model_path.read_bytes())
    real_session = onnxruntime.InferenceSession

    def session_then_swap(*args, **kwargs):  # the attacker replaces the file right after the session read it
        session = real_session(*args, **kwargs)
        (tmp_path / "next.onnx").write_bytes(other.read_bytes())
        (tmp_path / "next.onnx").replace(served)
        return session

    monkeypatch.setattr(onnxruntime, "InferenceSession", session_then_swap)
    loaded = OnnxEmbedder(served)
    monkeypatch.undo()
    image = [sticker(64)]
    ran = next(path for path, runtime in honest.items() if np.allclose(runtime.embed(image), loaded.embed(image)))
    assert loaded.model_hash == honest[ran].model_hash
