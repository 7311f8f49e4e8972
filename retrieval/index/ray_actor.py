"""The embedding actor of ``--engine ray`` (``ray_engine``), in a module of its own that never imports torch.

Ray starts every actor in a fresh worker process, which imports the module that defines the actor's class; the
actor only runs onnxruntime on batches already decoded and preprocessed by the decode tasks, so this module's
imports (numpy, ``retrieval.index.embedder``, ``retrieval.onnx_runtime``) keep torch (~4.5 s to import on a
2-core machine) off each actor's start. ``tests/test_index_ray.py`` checks that it stays so.
"""

from __future__ import annotations

import numpy as np

from retrieval.index.embedder import ModelMismatchError, load_model, prepare_vectors


class BatchEmbedder:
    """Ray Data actor: loads the ONNX model once, embeds the readable rows of each batch (unit vectors)."""

    def __init__(self, model_path: str, model_hash: str, threads: int) -> None:
        import onnxruntime
        import ray

        on_gpu = bool(ray.get_gpu_ids()) and "CUDAExecutionProvider" in onnxruntime.get_available_providers()
        self.embedder = load_model(model_path, providers="cuda" if on_gpu else "cpu", intra_op_threads=threads)
        if self.embedder.model_hash != model_hash:
            raise ModelMismatchError(
                f"{model_path} on this node has model_hash {self.embedder.model_hash}, the driver's has "
                f"{model_hash}; give every node the same model file"
            )

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok = np.asarray(batch["ok"], bool)
        dim = int(self.embedder.embedding_dim)
        vectors = np.zeros((len(ok), dim), np.float32)
        if ok.any():
            pixels = np.ascontiguousarray(batch["pixels"][ok])
            vectors[ok] = prepare_vectors(self.embedder.embed(pixels), dim)
        return {key: batch[key] for key in ("id", "ok", "sha256", "size", "error")} | {"embedding": vectors}
