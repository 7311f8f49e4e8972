"""Embedders for the index tests: ``FakeEmbedder`` (the OnnxEmbedder interface over a fixed random projection, no
model file) and ``write_projection_onnx`` (a real tiny ONNX file of the same kind, for onnxruntime and Ray actors)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.records.model_config import ModelConfig

SIZE = 16  # the embedders' input size: images are preprocessed to SIZE x SIZE


class FakeEmbedder:
    """A fixed random projection of the preprocessed pixels: distinct images -> distinct directions."""

    def __init__(self, dim: int = 24, seed: int = 0, normalized: bool = True) -> None:
        self.embedding_dim = dim
        self.normalized = normalized
        self.preprocessing = ModelPreprocessing(input_size=SIZE, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
        self.model_hash = hashlib.sha256(f"fake-{dim}-{seed}".encode()).hexdigest()[:16]
        self.metadata = {"model_hash": self.model_hash}
        self.projection = (
            np.random.default_rng(seed).standard_normal((3 * SIZE * SIZE, dim)).astype(np.float32)
        )
        self.calls = 0

    def embed_batch(self, batch: np.ndarray) -> np.ndarray:
        self.calls += 1
        out = np.asarray(batch, np.float32).reshape(len(batch), -1) @ self.projection
        if self.normalized:
            return out / np.linalg.norm(out, axis=1, keepdims=True)
        return out * 3.0  # deliberately not unit length

    def embed(self, images) -> np.ndarray:
        if isinstance(images, np.ndarray):
            return self.embed_batch(images)
        from retrieval.data import build_transforms, open_image

        tf = build_transforms(self.preprocessing, train=False)
        pil = [open_image(i) if isinstance(i, (str, Path)) else i for i in images]
        return self.embed_batch(np.stack([tf(p).numpy() for p in pil]))


def write_projection_onnx(path: Path, dim: int = 24, seed: int = 0, convs: int = 0, channels: int = 64,
                          drift: float = 0.0, compatible_with: tuple[str, ...] = (),
                          compatible: tuple[int, int] | None = None) -> Path:
    """A real (tiny) ONNX embedder with the export metadata: flatten, a fixed random projection, L2 norm.

    ``drift`` > 0 moves the projection of seed ``seed`` by that much noise (seed + 1000): a model near the
    undrifted one, as compatible training makes it, which ``compatible_with`` (model hashes) declares.
    ``compatible`` = (dim, seed): a second output, ``compatible_embedding``, as a model trained compatible with an
    old model of another size has: the projection of that old model's (dim, seed), drifted by ``drift`` too.

    onnxruntime runs it like any exported model; the Ray engine's actors load it from the file. ``convs`` > 0 puts
    that many 3x3 convolutions (3 -> ``channels`` ... -> 3, same size) first: real compute per image (~19 MFLOP
    per inner layer at 64 channels) for tests that need embedding to take a while, with a small file.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from retrieval.onnx_runtime import (
        COMPATIBLE_DIM_KEY,
        COMPATIBLE_OUTPUT_KEY,
        COMPATIBLE_OUTPUT_NAME,
        INPUT_NAME,
        OUTPUT_NAME,
        build_metadata,
    )

    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((3 * SIZE * SIZE, dim)).astype(np.float32)
    if drift:
        weights += drift * np.random.default_rng(seed + 1000).standard_normal(weights.shape).astype(np.float32)
    nodes, initializers, source = [], [numpy_helper.from_array(weights, "weights")], INPUT_NAME
    widths = [3] + [channels] * max(0, convs - 1) + [3] if convs else []
    for layer, (c_in, c_out) in enumerate(zip(widths, widths[1:], strict=False)):
        kernel = (rng.standard_normal((c_out, c_in, 3, 3)) / np.sqrt(9 * c_in)).astype(np.float32)
        initializers.append(numpy_helper.from_array(kernel, f"conv{layer}"))
        nodes.append(helper.make_node("Conv", [source, f"conv{layer}"], [f"c{layer}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{layer}"], [f"r{layer}"]))
        source = f"r{layer}"
    outputs = [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", dim])]
    second = []
    if compatible is not None:
        old_dim, old_seed = compatible
        old_weights = np.random.default_rng(old_seed).standard_normal((3 * SIZE * SIZE, old_dim)).astype(np.float32)
        old_weights += drift * np.random.default_rng(old_seed + 2000).standard_normal(old_weights.shape).astype(
            np.float32)
        initializers.append(numpy_helper.from_array(old_weights, "old_weights"))
        second = [helper.make_node("MatMul", ["flat", "old_weights"], ["old_projected"]),
                  helper.make_node("LpNormalization", ["old_projected"], [COMPATIBLE_OUTPUT_NAME], axis=1, p=2)]
        outputs.append(helper.make_tensor_value_info(COMPATIBLE_OUTPUT_NAME, TensorProto.FLOAT, ["batch", old_dim]))
    graph = helper.make_graph(
        [
            *nodes,
            helper.make_node("Flatten", [source], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "weights"], ["projected"]),
            helper.make_node("LpNormalization", ["projected"], [OUTPUT_NAME], axis=1, p=2),
            *second,
        ],
        "projection",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        outputs,
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    config = {
        "backbone": "projection-test",
        "embedding_dim": dim,
        "normalize": True,
        "input_size": SIZE,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
    }
    name = f"projection-{dim}-{seed}" + (f"-conv{convs}x{channels}" if convs else "")
    extra = {"compatible_with": json.dumps(list(compatible_with))} if compatible_with else {}
    if compatible is not None:
        extra |= {COMPATIBLE_OUTPUT_KEY: COMPATIBLE_OUTPUT_NAME, COMPATIBLE_DIM_KEY: str(compatible[0])}
    record = ModelConfig.from_json(config)
    for key, value in build_metadata(ModelPreprocessing.from_config(record), record, name, None, extra=extra).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path
