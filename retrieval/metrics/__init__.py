"""Metrics of embeddings: Recall@K, MAP@R, R-precision, NMI, F1, the linear probe, and the exact kNN under them.

- ``ranking``: ``evaluate`` (the one entry point every caller reports with), ``per_query_metrics``, ``mean_metrics``.
- ``neighbours``: ``knn``: exact k nearest neighbours in blocks of queries, on the CPU or one CUDA GPU.
- ``clustering``: ``clustering_metrics`` (NMI, pair F1 of a seeded faiss k-means), ``kmeans_assign``, ``pair_f1``.
- ``probe``: ``linear_probe``: a logistic regression on frozen embeddings (scikit-learn, the train extra).
- ``inputs``: the checks every metric makes of its embeddings and labels.
- ``evaluation``: an embedder evaluated on a data set's split: its embeddings, then these metrics (training,
  evaluate).

The public names are imported on first use (PEP 562, ``retrieval.utils.lazy``): every submodule computes in torch,
which a process that imports this package without measuring (the command line) should not pay for.
"""

from retrieval.utils.lazy import lazy_exports

# public name -> the submodule that defines it
_SOURCES = {
    "clustering": ("clustering_metrics", "kmeans_assign", "pair_f1"),
    "neighbours": ("knn",),
    "probe": ("linear_probe",),
    "ranking": ("METRIC_NAMES", "evaluate", "mean_metrics", "per_query_metrics"),
}
__getattr__, __dir__ = lazy_exports(__name__, _SOURCES)
__all__ = sorted(name for names in _SOURCES.values() for name in names)
