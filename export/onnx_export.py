"""Export a trained embedder (backbone + head + L2 norm) to one ONNX file and verify it against PyTorch.

The graph has a dynamic batch axis (input ``images`` [batch, 3, S, S] float32, output ``embeddings``
[batch, d] float32; a model trained ``--compatible-with`` an old model of another embedding size has a second
output, ``compatible_embedding`` [batch, d_old], its embedding projected into the old space and L2-normalised) and
carries the metadata that ``retrieval.onnx_runtime.OnnxEmbedder`` reads. The
exporter is torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``); the legacy TorchScript
exporter is used only when dynamo fails for a backbone, and a log line says so.
"""

from __future__ import annotations

import copy
import json
import logging
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from PIL import Image
from torch import nn

from retrieval.compatibility import COMPATIBILITY_KEY, compatibility_record
from retrieval.data.resize_modes import PRETRAINED_RESIZE
from retrieval.index.query_embedder import COMPATIBLE_WITH
from retrieval.models import Embedder, load_checkpoint, load_embedder
from retrieval.onnx_runtime import (
    COMPATIBLE_DIM_KEY,
    COMPATIBLE_OUTPUT_KEY,
    COMPATIBLE_OUTPUT_NAME,
    INPUT_NAME,
    OUTPUT_NAME,
    OnnxEmbedder,
    build_metadata,
    embedder_model_hash,
    onnx_model_hash,
    preprocess_images,
    proto_model_hash,
)

logger = logging.getLogger(__name__)
Log = Callable[[str], None]

FP32_MAX_ABS_DIFF = 1e-4
FP16_MIN_COSINE = 0.999
VERIFY_BATCH_SIZES = (1, 7)
# protobuf cannot serialise a single message over 2 GiB; bigger models keep their weights next to the file.
PROTOBUF_LIMIT_BYTES = 2**31 - 2**26
# Real photographs bundled with scikit-image (no download); camera and coins are grayscale.
SAMPLE_IMAGE_NAMES = ("chelsea", "astronaut", "coffee", "rocket", "camera", "coins", "immunohistochemistry")


class ExportVerificationError(ValueError):
    """The exported graph's outputs differ from PyTorch's beyond the tolerance; ``report`` has the numbers."""

    def __init__(self, message: str, report: VerificationReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class BatchCheck:
    batch_size: int
    max_abs_diff: float
    min_cosine: float
    passed: bool
    output: str = OUTPUT_NAME  # the graph output compared

    def describe(self) -> str:
        output = f" ({self.output})" if self.output != OUTPUT_NAME else ""
        return (f"batch {self.batch_size}{output}: max |diff| {self.max_abs_diff:.2e}, min cosine "
                f"{self.min_cosine:.6f} [{'ok' if self.passed else 'FAIL'}]")


@dataclass
class VerificationReport:
    precision: str
    criterion: str
    checks: list[BatchCheck]
    images: list[str]

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def describe(self) -> str:
        return "; ".join(check.describe() for check in self.checks)


@dataclass
class ExportResult:
    path: Path
    exporter: str
    opset: int
    precision: str
    seconds: float
    file_bytes: int
    metadata: dict[str, str]
    verification: VerificationReport | None = None
    external_data: list[Path] = field(default_factory=list)

    @property
    def model_hash(self) -> str:
        return self.metadata["model_hash"]


# ---------------------------------------------------------------- images for verification

def sample_images(count: int = max(VERIFY_BATCH_SIZES)) -> list[tuple[str, Image.Image]]:
    """Real photographs (scikit-image's bundled samples, colour and grayscale) as ``(name, PIL image)``."""
    import skimage.data

    if not 1 <= count <= len(SAMPLE_IMAGE_NAMES):
        raise ValueError(f"count must be in 1..{len(SAMPLE_IMAGE_NAMES)}, got {count}")
    return [(name, Image.fromarray(getattr(skimage.data, name)())) for name in SAMPLE_IMAGE_NAMES[:count]]


# ---------------------------------------------------------------- graph export

class BothOutputs(nn.Module):
    """The graph of a model with a projection into an old space: (its embedding, the projected one)."""

    def __init__(self, model: Embedder) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.embed_both(images)


def graph_outputs(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """What is exported and the names of its outputs: the model's embedding, and its projection into an old space
    where it has one."""
    if getattr(model, "compatible", None) is not None:
        return BothOutputs(model).eval(), [OUTPUT_NAME, COMPATIBLE_OUTPUT_NAME]
    return model, [OUTPUT_NAME]


def _dynamo_export(model: nn.Module, example: torch.Tensor, opset: int | None,
                   outputs: Sequence[str]) -> onnx.ModelProto:
    batch = torch.export.Dim("batch", min=1)
    program = torch.onnx.export(
        model, (example,), None, dynamo=True, verbose=False, opset_version=opset,
        input_names=[INPUT_NAME], output_names=list(outputs), dynamic_shapes={"images": {0: batch}},
    )
    return program.model_proto


def _legacy_export(model: nn.Module, example: torch.Tensor, opset: int | None,
                   outputs: Sequence[str]) -> onnx.ModelProto:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the caller already logged the fallback
        path = Path(tmp) / "model.onnx"
        torch.onnx.export(
            model, (example,), str(path), dynamo=False, opset_version=opset or 17, do_constant_folding=True,
            input_names=[INPUT_NAME], output_names=list(outputs),
            dynamic_axes={INPUT_NAME: {0: "batch"}, **{name: {0: "batch"} for name in outputs}},
        )
        return onnx.load(str(path))


def export_graph(model: nn.Module, input_size: int, opset: int | None, log: Log) -> tuple[onnx.ModelProto, str]:
    """``model`` (eval mode, fp32, CPU) as an ONNX graph with a dynamic batch axis; returns (graph, exporter).
    A model with a projection into an old space gets its second output (``graph_outputs``)."""
    example = torch.randn(2, 3, input_size, input_size, generator=torch.Generator().manual_seed(0))
    module, outputs = graph_outputs(model)
    try:
        proto, exporter = _dynamo_export(module, example, opset, outputs), "dynamo"
    except Exception as exc:  # any failure of torch.export / translation: try the TorchScript exporter
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log(f"dynamo exporter failed ({type(exc).__name__}: {first_line[:200]}); "
            f"falling back to the legacy TorchScript exporter")
        proto, exporter = _legacy_export(module, example, opset, outputs), "legacy"
    batch_dim = proto.graph.input[0].type.tensor_type.shape.dim[0]
    if not batch_dim.dim_param:
        raise RuntimeError(f"the {exporter} exporter produced a fixed batch size ({batch_dim.dim_value}), "
                           f"expected a dynamic batch axis")
    return proto, exporter


STACK_TRACE = "pkg.torch.onnx.stack_trace"  # the dynamo exporter's per-node record of the Python source


def drop_stack_traces(proto: onnx.ModelProto) -> None:
    """The exporter's stack traces out of the nodes' metadata, in place: they name files on the exporting machine
    (its user's folders) and no part of what the model computes."""
    for node in (*proto.graph.node, *(node for function in proto.functions for node in function.node)):
        for place in reversed(range(len(node.metadata_props))):
            if node.metadata_props[place].key == STACK_TRACE:
                del node.metadata_props[place]


def to_fp16(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Weights and activations in float16; inputs and outputs stay float32 so callers need not care."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    large = proto.ByteSize() > PROTOBUF_LIMIT_BYTES
    return convert_float_to_float16(proto, keep_io_types=True, disable_shape_infer=large)


def _opset(proto: onnx.ModelProto) -> int:
    return next(entry.version for entry in proto.opset_import if entry.domain in ("", "ai.onnx"))


def save_with_metadata(proto: onnx.ModelProto, path: Path, metadata: dict[str, str]) -> list[Path]:
    """Write the model (weights inside when under 2 GiB); returns any external-data files written."""
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    if proto.ByteSize() <= PROTOBUF_LIMIT_BYTES:
        onnx.save_model(proto, str(path))
        return []
    data_name = path.name + ".data"
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data_name, size_threshold=1024)
    return [path.parent / data_name]


def rewrite_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Replace the metadata of a written model, leaving its graph, weights and any external-data file as they are."""
    main = onnx.load(str(path), load_external_data=False)
    del main.metadata_props[:]
    onnx.helper.set_model_props(main, metadata)
    onnx.save_model(main, str(path))


# ---------------------------------------------------------------- verification

def _compare(reference: np.ndarray, candidate: np.ndarray) -> tuple[float, float]:
    ref, out = reference.astype(np.float64), candidate.astype(np.float64)
    max_abs = float(np.abs(ref - out).max())
    norms = np.linalg.norm(ref, axis=1) * np.linalg.norm(out, axis=1)
    cosine = (ref * out).sum(axis=1) / np.maximum(norms, 1e-12)
    return max_abs, float(cosine.min())


@torch.no_grad()
def verify_export(
    model: nn.Module,
    onnx_path: str | Path,
    precision: str = "fp32",
    batch_sizes: Sequence[int] = VERIFY_BATCH_SIZES,
    images: Sequence[tuple[str, Image.Image]] | None = None,
    max_abs_diff: float = FP32_MAX_ABS_DIFF,
    min_cosine: float = FP16_MIN_COSINE,
) -> VerificationReport:
    """Run the same preprocessed real images through PyTorch and onnxruntime (CPU) and compare, every output
    (the embedding, and the projection into an old space where the model has one).

    fp32 passes when max |diff| <= ``max_abs_diff``; fp16 when every row's cosine >= ``min_cosine``.
    Raises ``ExportVerificationError`` with the measured numbers otherwise.
    """
    images = list(images) if images is not None else sample_images(max(batch_sizes))
    if len(images) < max(batch_sizes):
        raise ValueError(f"verification at batch {max(batch_sizes)} needs that many images, got {len(images)}")
    batch = preprocess_images([image for _, image in images], model.preprocessing)
    runtime = OnnxEmbedder(onnx_path, providers="cpu")
    module, outputs = graph_outputs(model.eval())
    checks = []
    for size in batch_sizes:
        references = module(torch.from_numpy(batch[:size]))
        references = references if isinstance(references, tuple) else (references,)
        for name, reference in zip(outputs, references, strict=True):
            candidate = runtime.with_output(name).embed_batch(batch[:size])
            max_abs, cosine = _compare(reference.float().numpy(), candidate)
            passed = cosine >= min_cosine if precision == "fp16" else max_abs <= max_abs_diff
            checks.append(BatchCheck(size, max_abs, cosine, bool(passed), name))
    criterion = f"min cosine >= {min_cosine}" if precision == "fp16" else f"max |diff| <= {max_abs_diff:g}"
    report = VerificationReport(precision, criterion, checks, [name for name, _ in images])
    if not report.passed:
        hints = [
            "re-export with another --opset (e.g. 17 or 18)",
            "check that the model has no train-time behaviour left in eval mode (custom dropout, batch statistics)",
        ]
        if precision == "fp16":
            hints.insert(0, "export without --fp16 (some layers overflow or lose too much precision in float16)")
        raise ExportVerificationError(
            f"ONNX outputs differ from PyTorch ({precision}, required {criterion}) on real images "
            f"({', '.join(report.images)}): {report.describe()}. Try: {'; '.join(hints)}; or pass --no-verify "
            f"to write the file anyway.",
            report,
        )
    return report


# ---------------------------------------------------------------- the export

def export_embedder(
    model: Embedder,
    out: str | Path,
    config_hash: str | None = None,
    opset: int | None = None,
    fp16: bool = False,
    verify: bool = True,
    log: Log | None = None,
    compatibility: str | None = None,
) -> ExportResult:
    """Export an ``Embedder`` to ``out`` with metadata; verify against PyTorch unless ``verify=False``.
    ``compatibility``: its measured compatibility with the old model it declares (``compatibility_record``).

    On a failed verification the file is removed and ``ExportVerificationError`` is raised.
    """
    log = log or logger.info
    out = Path(out)
    if not hasattr(model, "config"):
        raise TypeError("export_embedder needs a retrieval Embedder (with .config); see retrieval.models")
    # A private fp32 CPU copy in eval mode: exporting must not change the caller's model.
    model = copy.deepcopy(model).cpu().float().eval()
    config = model.config  # written whole into the metadata's model_config
    preprocessing = model.preprocessing
    precision = "fp16" if fp16 else "fp32"
    norm = "L2-normalised" if preprocessing.normalize else "unnormalised"
    # a second output where the model has a projection into an old space
    compatible = getattr(model, "compatible", None) is not None
    also = f", and its projection into the old {config.value_of('compatible_dim')}-d space" if compatible else ""
    log(f"exporting {preprocessing.backbone} ({preprocessing.input_size} px, {preprocessing.embedding_dim}-d, {norm}"
        f"{also}) to {out} [{precision}] with torch {torch.__version__} ...")
    start = time.perf_counter()
    proto, exporter = export_graph(model, preprocessing.input_size, opset, log)
    if fp16:
        proto = to_fp16(proto)
    proto.doc_string = f"retrieval embedder: {preprocessing.backbone}, {preprocessing.embedding_dim}-d"
    drop_stack_traces(proto)
    # one identity everywhere: the hash of the file's own graph and weights, the one the index and search compute
    # when they open it; the PyTorch weights' fingerprint is kept as lineage
    extra = {"exporter": exporter, "opset": _opset(proto), "torch_version": torch.__version__,
             "source_model_hash": embedder_model_hash(model)}
    if config.compatible_with:  # trained --compatible-with: indexes of those models may be searched with it
        extra[COMPATIBLE_WITH] = json.dumps(sorted(config.compatible_with))
        if compatibility:  # ... and how well, as measured (`retrieval index upgrade` says it)
            extra[COMPATIBILITY_KEY] = compatibility
    if compatible:  # ... through this output, where their embedding size differs from this model's
        extra[COMPATIBLE_OUTPUT_KEY] = COMPATIBLE_OUTPUT_NAME
        extra[COMPATIBLE_DIM_KEY] = str(int(config.value_of("compatible_dim")))
    metadata = build_metadata(preprocessing, config, proto_model_hash(proto, preprocessing), config_hash, precision,
                              extra=extra)
    external = save_with_metadata(proto, out, metadata)
    if external:  # weights moved to a .data file serialise differently: the file as written is the authority
        written = onnx_model_hash(out, preprocessing)
        if written != metadata["model_hash"]:
            metadata["model_hash"] = written
            rewrite_metadata(out, metadata)
    seconds = time.perf_counter() - start
    size = out.stat().st_size + sum(p.stat().st_size for p in external)
    log(f"exported in {seconds:.1f} s with the {exporter} exporter (opset {_opset(proto)}): "
        f"{size / 2**20:.1f} MiB{' (weights in ' + external[0].name + ')' if external else ''}, "
        f"model_hash {metadata['model_hash']}")
    result = ExportResult(out, exporter, _opset(proto), precision, seconds, size, metadata, None, external)
    if not verify:
        log("verification skipped (--no-verify)")
        return result
    log(f"verifying with onnxruntime (CPU) against PyTorch on real images at batch sizes {VERIFY_BATCH_SIZES} ...")
    try:
        result.verification = verify_export(model, out, precision)
    except ExportVerificationError:
        for path in (out, *external):
            path.unlink(missing_ok=True)
        raise
    log(f"verified ({result.verification.criterion}): {result.verification.describe()}")
    return result


def export_pretrained(
    backbone: str,
    out: str | Path,
    image_size: int | None = None,
    resize: str = PRETRAINED_RESIZE,
    opset: int | None = None,
    fp16: bool = False,
    verify: bool = True,
    log: Log | None = None,
) -> ExportResult:
    """Export a pretrained ``backbone`` untrained: its pooled features, L2-normalised, at ``image_size`` pixels
    (default: the backbone's own), each image made square by ``resize`` (crop or pad), with the metadata and
    verification of a trained model's export."""
    from retrieval.models import create_pretrained_embedder

    return export_embedder(create_pretrained_embedder(backbone, image_size, resize), out, None, opset=opset,
                           fp16=fp16, verify=verify, log=log)


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    opset: int | None = None,
    fp16: bool = False,
    verify: bool = True,
    log: Log | None = None,
) -> ExportResult:
    """Export a training checkpoint (``retrieval-checkpoint/1``); its ``config_hash`` goes into the metadata, and
    the compatibility its evaluation measured, for a model trained --compatible-with an old one."""
    saved = load_checkpoint(checkpoint)
    model = load_embedder(checkpoint)
    # the measurement of these weights: the checkpoint's own epoch (an epoch not evaluated records none)
    measured = compatibility_record((saved.metrics or {}).get("compatibility"))
    return export_embedder(model, out, saved.config_hash, opset=opset, fp16=fp16, verify=verify, log=log,
                           compatibility=measured)
