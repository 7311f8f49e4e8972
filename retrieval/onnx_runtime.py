"""Run an exported embedder with onnxruntime: ``OnnxEmbedder(path).embed(images) -> [n, d] float32``.

This is the core-side half of the ONNX export (the index and the server use it; it never imports
``export/``). The metadata contract written by ``retrieval export`` lives here too, so that writer and
reader share one definition; ``parse_metadata`` is where a file's metadata becomes its ``ModelPreprocessing``.

Images are prepared by the same functions as the PyTorch path (``open_image`` for files, then
``eval_preprocess.EvalPreprocess``, which the PyTorch path wraps as a tensor), so both runtimes see identical input
tensors. None of it imports torch: a process that only embeds (a Ray actor, the server) runs without it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from retrieval.data.colour import DEFAULT_BACKGROUND
from retrieval.data.decode import open_image
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.records.model_config import ModelConfig
from retrieval.utils.onnx_hash import legacy_model_hash, proto_model_hash

if TYPE_CHECKING:
    import torch
    from torch import nn

ONNX_FORMAT = "retrieval-onnx/1"
INPUT_NAME = "images"
OUTPUT_NAME = "embeddings"
# a model trained --compatible-with an old one of another embedding size has a second output: its embedding
# projected into the old space (L2-normalised), which an index the old model built is searched and upgraded with;
# the metadata names it (COMPATIBLE_OUTPUT_KEY) and gives its size (COMPATIBLE_DIM_KEY)
COMPATIBLE_OUTPUT_NAME = "compatible_embedding"
COMPATIBLE_OUTPUT_KEY = "compatible_output"
COMPATIBLE_DIM_KEY = "compatible_dim"
# metadata_props keys written by `retrieval export`; values are strings (JSON for lists and dicts).
REQUIRED_METADATA = (
    "format", "backbone", "embedding_dim", "input_size", "mean", "std", "normalized", "config_hash",
    "model_hash", "model_config", "precision",
)
PRECISIONS = ("fp32", "fp16", "int8")

ImageInput = Image.Image | str | os.PathLike


# ---------------------------------------------------------------- identity of a trained model

def embedder_model_hash(model: nn.Module, preprocessing: ModelPreprocessing | None = None) -> str:
    """A 16-hex-digit fingerprint of an embedder's weights (state dict, in fp32) and preprocessing (None: the
    model's own, ``Embedder.preprocessing``).

    The export stores it as ``source_model_hash`` (lineage: which PyTorch weights a file came from); the identity
    of an ONNX file, its ``model_hash``, is ``onnx_model_hash``.
    """
    digest = (preprocessing if preprocessing is not None else model.preprocessing).identity_digest()
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.float()  # fp32 values: a copy held in float64 hashes the same
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def onnx_model_hash(path: str | os.PathLike, preprocessing: ModelPreprocessing) -> str:
    """A 16-hex-digit fingerprint computed from an ONNX file itself: its graph and weights (annotations and metadata
    left out: ``proto_model_hash``) and the preprocessing it is run with. Two files share it only if they compute the
    same embeddings."""
    return proto_model_hash(read_onnx_model(path), preprocessing)


def read_onnx_model(path: str | os.PathLike) -> Any:
    """The ``onnx.ModelProto`` of a file, read once with any external weights inlined: hash and run this one
    object, never a second read of a file that can be replaced in between."""
    import onnx

    return onnx.load(str(path))  # external weights, if any, are loaded into the proto


def build_metadata(
    preprocessing: ModelPreprocessing,
    model_config: ModelConfig,
    model_hash: str,
    config_hash: str | None,
    precision: str = "fp32",
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The ``metadata_props`` an exported embedder carries (all values are strings): the explicit keys from
    ``preprocessing``; ``model_config``, the model's whole config (``Embedder.config``, whose preprocessing keys
    ``preprocessing`` was read from), written as it is under ``model_config``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if preprocessing.backbone is None or preprocessing.embedding_dim is None:
        raise ValueError("an exported model's metadata names its backbone and embedding_dim: the model config has "
                         "no 'backbone' or 'embedding_dim'")
    meta = {
        "format": ONNX_FORMAT,
        "backbone": preprocessing.backbone,
        "embedding_dim": str(preprocessing.embedding_dim),
        "input_size": str(preprocessing.input_size),
        "mean": json.dumps(list(preprocessing.mean)),
        "std": json.dumps(list(preprocessing.std)),
        "background": json.dumps(list(preprocessing.background)),
        "resize": preprocessing.resize_mode,  # crop (the centre) or pad (the whole image, letterboxed)
        "normalized": "true" if preprocessing.normalize else "false",
        "config_hash": config_hash or "",
        "model_hash": model_hash,
        "model_config": json.dumps(model_config.to_json(), sort_keys=True),
        "precision": precision,
        "input_name": INPUT_NAME,
        "output_name": OUTPUT_NAME,
    }
    meta.update({k: str(v) for k, v in (extra or {}).items()})
    return meta


def parse_metadata(meta: Mapping[str, str], source: str = "model") -> ModelPreprocessing:
    """Check the metadata written by ``retrieval export`` and return the model's ``ModelPreprocessing`` from it: the
    one place an ONNX file's metadata is read."""
    missing = [key for key in REQUIRED_METADATA if key not in meta]
    if missing:
        raise ValueError(
            f"{source} has no retrieval metadata (missing {', '.join(missing)}): it was not exported by "
            "`retrieval export`; export the training checkpoint with it first"
        )
    if meta["format"] != ONNX_FORMAT:
        raise ValueError(f"{source} has metadata format {meta['format']!r}; this version reads {ONNX_FORMAT!r}")
    try:
        config = ModelConfig.from_json(json.loads(meta["model_config"]))
    except ValueError as exc:
        raise ValueError(f"{source}'s model_config metadata: {exc}") from None
    # The explicit keys are authoritative (they are what the graph was exported with); the resize mode is the
    # model config's (absent there: a model from before the modes, which crops).
    # Files exported before the background was recorded were meant for opaque images: white is the default.
    return ModelPreprocessing(
        input_size=int(meta["input_size"]),
        mean=tuple(float(v) for v in json.loads(meta["mean"])),  # type: ignore[arg-type]  (checked: 3 numbers)
        std=tuple(float(v) for v in json.loads(meta["std"])),  # type: ignore[arg-type]
        background=json.loads(meta["background"]) if "background" in meta else DEFAULT_BACKGROUND,
        resize=config.resize or None,
        backbone=meta["backbone"],
        embedding_dim=int(meta["embedding_dim"]),
        normalize=meta["normalized"] == "true",
    )


def check_graph_matches(session: Any, preprocessing: ModelPreprocessing, source: str) -> None:
    """The metadata must describe the graph: input [n, 3, S, S] with S = input_size, output [n, embedding_dim]."""
    inputs, outputs = session.get_inputs(), session.get_outputs()
    if len(inputs) != 1 or len(outputs) < 1:
        raise ValueError(f"{source} has {len(inputs)} inputs and {len(outputs)} outputs; an embedder has one "
                         "image input and an embedding output; export it with `retrieval export`")
    size, dim = preprocessing.input_size, preprocessing.embedding_dim
    found = list(inputs[0].shape)  # ints where the graph fixes a size, names where it is dynamic
    if len(found) != 4 or found[1] != 3 or any(d != size for d in found[2:] if isinstance(d, int)):
        raise ValueError(
            f"{source}: its metadata says input_size {size} but the graph's input has shape {found} "
            f"(expected [batch, 3, {size}, {size}]); the metadata was edited or belongs to another model. "
            "Re-export the checkpoint with `retrieval export`"
        )
    out_shape = list(outputs[0].shape)
    if len(out_shape) != 2 or (isinstance(out_shape[1], int) and out_shape[1] != dim):
        raise ValueError(
            f"{source}: its metadata says embedding_dim {dim} but the graph's output has shape {out_shape}; "
            "the metadata was edited or belongs to another model. Re-export the checkpoint with `retrieval export`"
        )


def check_compatible_output(session: Any, metadata: Mapping[str, str], source: str) -> tuple[str, int] | None:
    """(name, size) of the output that embeds into an old model's space, as the metadata declares it and the graph
    has it; None for a model without one."""
    name = metadata.get(COMPATIBLE_OUTPUT_KEY)
    if not name:
        return None
    try:
        dim = int(metadata.get(COMPATIBLE_DIM_KEY, ""))
    except ValueError:
        dim = 0
    shapes = {output.name: list(output.shape) for output in session.get_outputs()}
    shape = shapes.get(name)
    if dim < 1 or shape is None or len(shape) != 2 or (isinstance(shape[1], int) and shape[1] != dim):
        raise ValueError(
            f"{source}: its metadata declares a compatible output {name!r} of {metadata.get(COMPATIBLE_DIM_KEY)!r} "
            f"dimensions, but the graph's outputs are {shapes}; the metadata was edited or belongs to another model. "
            "Re-export the checkpoint with `retrieval export`"
        )
    return name, dim


# ---------------------------------------------------------------- preprocessing shared with PyTorch

def load_image(image: ImageInput) -> Image.Image:
    """A PIL image as given, or a file opened as RGB with its EXIF orientation applied."""
    if isinstance(image, Image.Image):
        return image
    if isinstance(image, (str, os.PathLike)):
        return open_image(image)
    raise TypeError(f"expected a PIL image or a file path, got {type(image).__name__}")


def preprocess_images(images: Iterable[ImageInput], preprocessing: ModelPreprocessing) -> np.ndarray:
    """PIL images or paths -> float32 batch [n, 3, S, S], exactly as evaluation prepares them."""
    preprocess = EvalPreprocess(preprocessing)  # the one evaluation preprocessing (torch paths wrap it)
    arrays = [preprocess(load_image(image)) for image in images]
    if not arrays:
        return np.zeros((0, 3, preprocess.size, preprocess.size), dtype=np.float32)
    return np.stack(arrays)


def _is_torch_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch (a tensor exists only once torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


# ---------------------------------------------------------------- onnxruntime session

def resolve_providers(providers: str | Sequence[str] = "auto") -> list[str]:
    """'auto': CUDA when onnxruntime-gpu sees a GPU, else CPU; 'cpu'; 'cuda'; or an explicit list."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if not isinstance(providers, str):
        unknown = [p for p in providers if p not in available]
        if unknown:
            raise RuntimeError(f"onnxruntime providers {unknown} are not available here (available: {available})")
        return list(providers)
    choice = providers.lower()
    if choice == "auto":
        if "CUDAExecutionProvider" in available:
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]
    if choice == "cpu":
        return ["CPUExecutionProvider"]
    if choice == "cuda":
        if "CUDAExecutionProvider" not in available:
            raise RuntimeError(
                "providers='cuda' was requested but onnxruntime has no CUDAExecutionProvider "
                f"(available: {available}); install onnxruntime-gpu on a CUDA machine or use providers='cpu'"
            )
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    raise ValueError(f"providers must be 'auto', 'cpu', 'cuda' or a list of provider names, got {providers!r}")


def make_session(model: str | os.PathLike | bytes, providers: Sequence[str], intra_op_threads: int | None = None,
                 spin: bool = True, log_severity: int | None = None):
    """``spin=False``: idle threads sleep instead of busy-waiting, leaving the CPU to data-loading processes
    (throughput jobs such as indexing); spinning only shortens the latency of the next call. ``log_severity``:
    onnxruntime's least severity logged (3: errors only; None: its default)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if log_severity is not None:
        options.log_severity_level = int(log_severity)
    if intra_op_threads is not None:
        options.intra_op_num_threads = int(intra_op_threads)
    if not spin:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = model if isinstance(model, bytes) else str(model)  # bytes: the very model that was hashed
    return ort.InferenceSession(source, sess_options=options, providers=list(providers))


class OnnxEmbedder:
    """An exported embedder run by onnxruntime.

    ``embed(images)`` takes PIL images, file paths, or a preprocessed float32 batch [n, 3, S, S] and returns
    float32 embeddings [n, d] (unit norm when the model was trained with L2 normalisation).

    It embeds with the model's own output; ``with_output(compatible_output)`` is the same model (one session, one
    ``model_hash``) embedding into the old space of a model it was trained compatible with, for a model that has
    that output (trained ``--compatible-with`` an old model of another embedding size).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        providers: str | Sequence[str] = "auto",
        intra_op_threads: int | None = None,
        batch_size: int = 32,
        spin: bool = True,
    ) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"ONNX model not found: {self.path} (create one with `retrieval export`)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        chosen = resolve_providers(providers)
        # One read of the file: the session runs exactly the bytes that are hashed below (a file swapped
        # between two reads could otherwise run other weights under this model's identity).
        try:
            proto = read_onnx_model(self.path)
            self.session = make_session(proto.SerializeToString(), chosen, intra_op_threads, spin=spin)
        except Exception as exc:  # onnx's DecodeError and onnxruntime's InvalidProtobuf/Fail derive from Exception
            raise ValueError(f"{self.path} is not a readable ONNX model: {exc}") from exc
        self._metadata = dict(self.session.get_modelmeta().custom_metadata_map)
        self.preprocessing = parse_metadata(self._metadata, source=str(self.path))
        check_graph_matches(self.session, self.preprocessing, str(self.path))
        # identity from the model's own graph and weights: metadata alone could be copied onto another model
        self._model_hashes = (proto_model_hash(proto, self.preprocessing),
                              legacy_model_hash(proto, self.preprocessing))
        del proto
        self._input_name = self.session.get_inputs()[0].name
        self._primary_output = self._metadata.get("output_name", self.session.get_outputs()[0].name)
        self._compatible = check_compatible_output(self.session, self._metadata, str(self.path))
        # what this object embeds with: the primary output unless with_output chose the compatible one
        self._output_name = self._primary_output
        # the model's own output: its size and normalisation, which parse_metadata always sets
        self._primary_dim = int(self.preprocessing.embedding_dim)  # type: ignore[arg-type]
        self._embedding_dim, self._normalized = self._primary_dim, bool(self.preprocessing.normalize)

    # -- properties
    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    @property
    def embedding_dim(self) -> int:
        """The size of the output it embeds with (the model's own ``embedding_dim`` unless ``with_output``)."""
        return self._embedding_dim

    @property
    def output_name(self) -> str:
        """The graph output it embeds with."""
        return self._output_name

    @property
    def primary_output(self) -> str:
        """The graph output of the model's own embedding."""
        return self._primary_output

    @property
    def compatible_output(self) -> str | None:
        """The output that embeds into an old model's space (trained --compatible-with one of another size), else
        None."""
        return self._compatible[0] if self._compatible else None

    @property
    def compatible_dim(self) -> int | None:
        """The size of ``compatible_output`` (the old model's embedding size), else None."""
        return self._compatible[1] if self._compatible else None

    def with_output(self, name: str | None) -> OnnxEmbedder:
        """This model embedding with output ``name`` (None: its own embedding); shares the session and identity."""
        name = name or self._primary_output
        if name == self._output_name:
            return self
        view = copy.copy(self)
        if name == self._primary_output:
            view._output_name, view._embedding_dim = name, self._primary_dim
            view._normalized = bool(self.preprocessing.normalize)
        elif self._compatible is not None and name == self._compatible[0]:
            view._output_name, view._embedding_dim, view._normalized = name, self._compatible[1], True
        else:
            known = [self._primary_output] + ([self._compatible[0]] if self._compatible else [])
            raise ValueError(f"{self.path} has no embedding output {name!r} (it has {', '.join(known)}); the index "
                             "was built with another export of this model: re-export it with `retrieval export`")
        return view

    @property
    def input_size(self) -> int:
        return self.preprocessing.input_size

    @property
    def model_hash(self) -> str:
        """Computed from the file when opened (``onnx_model_hash``); indexes record it."""
        return self._model_hashes[0]

    @property
    def model_hashes(self) -> tuple[str, str]:
        """Every hash a record may name this model by: ``model_hash`` and the ``legacy_model_hash`` that versions
        before it recorded (``query_embedder.hash_matches`` compares them)."""
        return self._model_hashes

    @property
    def source_model_hash(self) -> str:
        """The PyTorch weights' fingerprint the export wrote into the metadata (lineage, not identity); files of
        older exports have it under ``model_hash``."""
        return self._metadata.get("source_model_hash") or self._metadata["model_hash"]

    @property
    def config_hash(self) -> str:
        return self._metadata["config_hash"]

    @property
    def precision(self) -> str:
        """fp32, fp16 or int8, as the export recorded it."""
        return self._metadata.get("precision", "fp32")

    @property
    def normalized(self) -> bool:
        """Whether its output is L2-normalised (the compatible output always is)."""
        return self._normalized

    @property
    def providers(self) -> list[str]:
        return self.session.get_providers()

    def __repr__(self) -> str:
        output = f", output={self._output_name!r}" if self._output_name != self._primary_output else ""
        return (f"OnnxEmbedder({str(self.path)!r}, backbone={self.preprocessing.backbone!r}, "
                f"dim={self.embedding_dim}{output}, providers={self.providers})")

    # -- inference
    def preprocess(self, images: Iterable[ImageInput]) -> np.ndarray:
        return preprocess_images(images, self.preprocessing)

    def embed(self, images: Any) -> np.ndarray:
        """Embeddings [n, d] float32 of PIL images / file paths (one or a sequence) or of a batch array."""
        if isinstance(images, np.ndarray) or _is_torch_tensor(images):
            return self.embed_batch(images)
        if isinstance(images, (Image.Image, str, os.PathLike)):
            images = [images]
        images = list(images)
        out = np.zeros((len(images), self.embedding_dim), dtype=np.float32)
        for start in range(0, len(images), self.batch_size):  # decode one chunk at a time
            chunk = images[start:start + self.batch_size]
            out[start:start + len(chunk)] = self.embed_batch(self.preprocess(chunk))
        return out

    def embed_batch(self, batch: np.ndarray | torch.Tensor) -> np.ndarray:
        """Embeddings [n, d] float32 of a preprocessed batch [n, 3, S, S]."""
        if _is_torch_tensor(batch):
            batch = batch.detach().cpu().numpy()
        batch = np.asarray(batch)
        size = self.input_size
        if batch.ndim != 4 or batch.shape[1:] != (3, size, size):
            raise ValueError(
                f"expected a preprocessed batch of shape [n, 3, {size}, {size}], got {list(batch.shape)}; "
                f"pass PIL images or file paths to embed() to have them preprocessed"
            )
        if not np.issubdtype(batch.dtype, np.floating):
            raise ValueError(f"a preprocessed batch must be floating point (normalised), got dtype {batch.dtype}")
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        out = np.zeros((len(batch), self.embedding_dim), dtype=np.float32)
        for start in range(0, len(batch), self.batch_size):
            chunk = batch[start:start + self.batch_size]
            result = self.session.run([self._output_name], {self._input_name: chunk})[0]
            out[start:start + len(chunk)] = result
        return out
