"""ONNX export of a trained embedder or a pretrained backbone (``retrieval export``), its int8 quantization and its
onnxruntime runner.

- ``onnx_export``: the fp32 (or fp16) export, verified against PyTorch (imports torch).
- ``int8_export``: static int8 quantization of an fp32 export, calibrated on the user's images and verified against
  its parent (no torch: an existing export is quantized on the base install).
- ``text_export``: the text tower's export (imports torch).
"""

from retrieval.utils.lazy import lazy_exports

_SOURCES = {
    "onnx_export": ("ExportResult", "ExportVerificationError", "VerificationReport", "export_checkpoint",
                    "export_embedder", "export_pretrained", "sample_images", "verify_export"),
    "int8_export": ("Int8Refused", "Int8Result", "export_int8"),
}
__all__ = ["OnnxEmbedder", *sorted(name for names in _SOURCES.values() for name in names)]

from retrieval.onnx_runtime import OnnxEmbedder  # noqa: E402  (light: no torch)

__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
