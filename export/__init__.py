"""ONNX export of a trained embedder or a pretrained backbone (``retrieval export``) and its onnxruntime runner."""

from retrieval.export.onnx_export import (
    ExportResult,
    ExportVerificationError,
    VerificationReport,
    export_checkpoint,
    export_embedder,
    export_pretrained,
    sample_images,
    verify_export,
)
from retrieval.onnx_runtime import OnnxEmbedder

__all__ = [
    "ExportResult", "ExportVerificationError", "OnnxEmbedder", "VerificationReport", "export_checkpoint",
    "export_embedder", "export_pretrained", "sample_images", "verify_export",
]
