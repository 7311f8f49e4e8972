"""Shared helpers for the index tests: a fake embedder with the OnnxEmbedder interface, small galleries.

(No tests here; the name only keeps it inside the index tests' files.)
"""

from __future__ import annotations

import hashlib
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

from retrieval.data.synthetic import bomb_png, write_digits  # noqa: F401  (the index tests import them here)

SIZE = 16


class FakeEmbedder:
    """A fixed random projection of the preprocessed pixels: distinct images -> distinct directions."""

    def __init__(self, dim: int = 24, seed: int = 0, normalized: bool = True) -> None:
        self.embedding_dim = dim
        self.normalized = normalized
        self.model_config = {"input_size": SIZE, "mean": (0.5, 0.5, 0.5), "std": (0.25, 0.25, 0.25)}
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

        tf = build_transforms(self.model_config, train=False)
        pil = [open_image(i) if isinstance(i, (str, Path)) else i for i in images]
        return self.embed_batch(np.stack([tf(p).numpy() for p in pil]))


def write_projection_onnx(path: Path, dim: int = 24, seed: int = 0, convs: int = 0, channels: int = 64) -> Path:
    """A real (tiny) ONNX embedder with the export metadata: flatten, a fixed random projection, L2 norm.

    onnxruntime runs it like any exported model; the Ray engine's actors load it from the file. ``convs`` > 0 puts
    that many 3x3 convolutions (3 -> ``channels`` ... -> 3, same size) first: real compute per image (~19 MFLOP
    per inner layer at 64 channels) for tests that need embedding to take a while, with a small file.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from retrieval.onnx_runtime import INPUT_NAME, OUTPUT_NAME, build_metadata

    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((3 * SIZE * SIZE, dim)).astype(np.float32)
    nodes, initializers, source = [], [numpy_helper.from_array(weights, "weights")], INPUT_NAME
    widths = [3] + [channels] * max(0, convs - 1) + [3] if convs else []
    for layer, (c_in, c_out) in enumerate(zip(widths, widths[1:], strict=False)):
        kernel = (rng.standard_normal((c_out, c_in, 3, 3)) / np.sqrt(9 * c_in)).astype(np.float32)
        initializers.append(numpy_helper.from_array(kernel, f"conv{layer}"))
        nodes.append(helper.make_node("Conv", [source, f"conv{layer}"], [f"c{layer}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{layer}"], [f"r{layer}"]))
        source = f"r{layer}"
    graph = helper.make_graph(
        [
            *nodes,
            helper.make_node("Flatten", [source], ["flat"], axis=1),
            helper.make_node("MatMul", ["flat", "weights"], ["projected"]),
            helper.make_node("LpNormalization", ["projected"], [OUTPUT_NAME], axis=1, p=2),
        ],
        "projection",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info(OUTPUT_NAME, TensorProto.FLOAT, ["batch", dim])],
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
    for key, value in build_metadata(config, name, None).items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))
    return path


def png_bytes(size: tuple[int, int] = (32, 32), colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(size: tuple[int, int] = (64, 64)) -> bytes:
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


# The kill tests' pause points: "after_shard_write:N" stops the build once its N-th shard file is in place but
# before its rows are recorded; "after_commit:N" once those rows are recorded too.
PAUSE_ENV = "RETRIEVAL_INDEX_TEST_PAUSE"
PAUSED = "RETRIEVAL_INDEX_PAUSED"  # printed to stderr when the build has stopped there


def pause_build_at(point: str) -> None:
    """Wrap the writer's two durable steps (``ShardStore.write``, ``Catalogue.record``) in this process so that
    the build stops at ``point``, printing ``PAUSED`` and sleeping until the test kills it."""
    import time

    from retrieval.index.catalogue import Catalogue
    from retrieval.index.shards import ShardStore

    step, number = point.split(":")
    written: list[str] = []  # the shards this process wrote, in order
    write, record = ShardStore.write, Catalogue.record

    def stop() -> None:
        print(f"{PAUSED} {point}", file=sys.stderr, flush=True)
        time.sleep(600)

    def write_then_pause(self, ids, vectors, outcomes):
        name = write(self, ids, vectors, outcomes)
        written.append(name)
        if step == "after_shard_write" and len(written) == int(number):
            stop()
        return name

    def record_then_pause(self, outcomes):
        outcomes = list(outcomes)
        record(self, outcomes)
        if step == "after_commit" and len(written) == int(number) and any(o.shard == written[-1] for o in outcomes):
            stop()

    ShardStore.write, Catalogue.record = write_then_pause, record_then_pause


def run_cli_with_fake(args: list[str]) -> None:
    """Entry point of the subprocess used by the kill tests: the real CLI with the fake model (and the pause
    point named by ``PAUSE_ENV``, if any)."""
    import os

    import retrieval.index.writer as writer
    from retrieval.cli.index import index_group

    writer.load_model = lambda path, providers="auto": FakeEmbedder()
    if os.environ.get(PAUSE_ENV):
        pause_build_at(os.environ[PAUSE_ENV])
    index_group.main(args, prog_name="retrieval index")


if __name__ == "__main__":
    run_cli_with_fake(sys.argv[1:])
