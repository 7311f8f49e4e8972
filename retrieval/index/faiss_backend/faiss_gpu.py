"""faiss on a GPU: the resources (or an error saying what is missing), GPU search of a CPU index, GPU training."""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np

from retrieval.index.faiss_backend.faiss_params import has_id_map, index_ids, inner, ivf_of

GPU_MAX_K = 2048  # faiss GPU k-selection limit (also for nprobe)
INSTALL_GPU = "pip uninstall faiss-cpu && pip install faiss-gpu (or conda install -c pytorch faiss-gpu)"


def require_gpu() -> Any:
    """faiss GPU resources, or a clear error saying what is missing."""
    if not hasattr(faiss, "StandardGpuResources"):
        raise RuntimeError(
            f"`gpu` needs faiss with GPU support, but this faiss is CPU-only; install it: "
            f"{INSTALL_GPU}, or leave `gpu` off"
        )
    if faiss.get_num_gpus() < 1:
        raise RuntimeError(
            "`gpu` was asked for but faiss sees no CUDA GPU (faiss.get_num_gpus() == 0); leave `gpu` off"
        )
    return faiss.StandardGpuResources()


def check_gpu_k(k: int) -> None:
    """Refuse a ``k`` over what faiss' GPU k-selection returns."""
    if k > GPU_MAX_K:
        raise ValueError(f"faiss on GPU returns at most k={GPU_MAX_K} neighbours, asked for k={k}; lower -k")


class GpuSearcher:
    """Searches a CPU index on the GPU: an ``IDMap2``'s inner index, with positions mapped back to ids, or an IVF
    index that keeps catalogue ids in its lists as it is."""

    def __init__(self, index: faiss.Index, resources: Any = None) -> None:
        self.resources = resources or require_gpu()
        self.ids = index_ids(index) if has_id_map(index) else None
        self.gpu_index = faiss.index_cpu_to_gpu(self.resources, 0, inner(index))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        check_gpu_k(k)
        scores, found = self.gpu_index.search(queries, k)
        if self.ids is None:
            return scores, found
        return scores, np.where(found >= 0, self.ids[np.clip(found, 0, None)], -1)


def train_on_gpu(index: faiss.Index, sample: np.ndarray, resources: Any) -> None:
    """Train IVF coarse quantisers with GPU k-means (HNSW and Flat need no training)."""
    ivf = ivf_of(index)
    if ivf is not None:
        ivf.clustering_index = faiss.index_cpu_to_gpu(resources, 0, faiss.IndexFlatL2(ivf.d))
    index.train(sample)
