"""Ranking metrics of embeddings: Recall@K, MAP@R, R-precision (and, through ``clustering``, NMI and F1).

``evaluate`` is the one entry point every caller reports with; ``per_query_metrics`` gives its kNN metrics per query
(``mean_metrics`` of them is ``evaluate``'s numbers). The neighbours come from ``neighbours``' blocked kNN, whose
conventions (similarity, tie order, memory, device) hold here too. Conventions of the metrics themselves:

* Leave-one-out. With ``gallery=None`` the query set is its own gallery and each query is removed from
  its own neighbour list *by index*: an exact duplicate of a query (another row) is still a neighbour.
* Queries with no relevant gallery item (R = 0: their class has no other item in the gallery) are left
  out of every kNN metric (Recall@K, MAP@R, R-precision), as in Musgrave et al. 2020 ("A Metric Learning
  Reality Check") and pytorch-metric-learning's AccuracyCalculator. If no query has R > 0 there is
  nothing to measure and ``evaluate`` raises ValueError.
* Depth. Each block of queries is read as deep as the largest R (or K) in it, and queries are processed sorted by
  R so that blocks of small classes stay shallow.
* NMI and F1 are computed on the query set only: k-means (faiss, seeded) with as many clusters as the
  query set has classes, on the same embedding space the similarity uses (normalised for cosine).
* Device. With a CUDA ``device`` each block's relevance and per-query values are computed on the GPU beside its
  lists; only per-query results come back. NMI and F1 (faiss k-means) stay on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.metrics.clustering import clustering_metrics
from retrieval.metrics.inputs import as_embeddings, as_label_array, encode_labels
from retrieval.metrics.neighbours import (
    RankingSpace,
    check_block_size,
    check_similarity,
    iter_knn_blocks,
    prepare_space,
    resolve_metrics_device,
)

METRIC_NAMES = ("recall", "map@r", "r_precision", "nmi", "f1")
KNN_METRICS = frozenset({"recall", "map@r", "r_precision"})

Reorder = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query rows [b], their lists [b, k]) -> lists reordered


# ---------------------------------------------------------------------------------------------------
# Retrieval metrics (per-query, accumulated over blocks)
# ---------------------------------------------------------------------------------------------------


def _relevant_counts(
    query_codes: torch.Tensor, gallery_codes: torch.Tensor, exclude_self: bool
) -> torch.Tensor:
    """R per query: gallery items with the query's label, minus the query itself when excluded."""
    num_classes = int(max(query_codes.max(), gallery_codes.max())) + 1
    class_sizes = torch.bincount(gallery_codes, minlength=num_classes)
    return class_sizes[query_codes] - int(exclude_self)


def _average_precision_at_r(relevant: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """MAP@R per query (Musgrave et al. 2020): (1/R) sum_{i<=R} P(i) rel(i), P(i) = precision at i."""
    ranks = torch.arange(1, relevant.shape[1] + 1, dtype=torch.float64, device=relevant.device)
    within_r = ranks[None, :] <= r[:, None]
    hits = relevant & within_r
    precision_at_i = hits.cumsum(dim=1, dtype=torch.float64) / ranks
    return (precision_at_i * hits).sum(dim=1) / r.to(torch.float64)


def _r_precision(relevant: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Relevant items among the top R, divided by R."""
    ranks = torch.arange(1, relevant.shape[1] + 1, device=relevant.device)
    hits = relevant & (ranks[None, :] <= r[:, None])
    return hits.sum(dim=1, dtype=torch.float64) / r.to(torch.float64)


def _retrieval_per_query(
    space: RankingSpace,
    query_codes: torch.Tensor,
    gallery_codes: torch.Tensor,
    ks: Sequence[int],
    want: set[str],
    exclude_self: bool,
    block_size: int | None,
    reorder: Reorder | None = None,
    min_depth: int = 0,
    device: torch.device | None = None,
) -> dict[str, np.ndarray]:
    """Each kNN metric per query (float64 [n]), NaN for a query with no relevant gallery item (left out)."""
    r = _relevant_counts(query_codes, gallery_codes, exclude_self)
    scored = torch.nonzero(r > 0).flatten()
    if len(scored) == 0:
        raise ValueError(
            "no query has a relevant gallery item (every query's class is absent from the gallery"
            " or has a single item); retrieval metrics are undefined for this split"
        )
    need_r = bool(want & {"map@r", "r_precision"})
    depth = torch.full_like(r, max(ks) if "recall" in want else 0)
    if need_r:
        depth = torch.maximum(depth, r)
    # a re-ranked list is read as deep as its shortlist, which the gallery bounds
    depth = torch.maximum(depth, torch.full_like(r, min(min_depth, len(gallery_codes) - int(exclude_self))))
    # Sorting by depth keeps blocks of small classes shallow (topk cost and memory grow with depth).
    order = scored[torch.argsort(depth[scored], stable=True)]
    # Per-query values stored by query index and averaged once at the end, so that the result does
    # not depend on the block size or order (floating-point sums would).
    n = len(query_codes)
    # The blocks' relevance and per-query values are computed where the lists are (a GPU keeps them there);
    # the order and depths stay on the CPU, which slices them per block without waiting on the GPU.
    here = device or torch.device("cpu")
    query_codes, gallery_codes, r_here = query_codes.to(here), gallery_codes.to(here), r.to(here)
    recall_hits = {k: torch.zeros(n, dtype=torch.float64, device=here) for k in ks}
    average_precision = torch.zeros(n, dtype=torch.float64, device=here)
    r_precision = torch.zeros(n, dtype=torch.float64, device=here)
    for rows, _, indices in iter_knn_blocks(space, order, depth[order], exclude_self, block_size, device):
        if reorder is not None:  # a NumPy callback: the block's lists go to the CPU and back
            lists = reorder(rows.cpu().numpy(), indices.cpu().numpy())
            indices = torch.from_numpy(np.ascontiguousarray(lists, dtype=np.int64)).to(here)
        relevant = gallery_codes[indices] == query_codes[rows][:, None]
        if "recall" in want:
            for k in ks:
                recall_hits[k][rows] = relevant[:, :k].any(dim=1).to(torch.float64)
        if "map@r" in want:
            average_precision[rows] = _average_precision_at_r(relevant, r_here[rows])
        if "r_precision" in want:
            r_precision[rows] = _r_precision(relevant, r_here[rows])
    # only the per-query values come back; they are averaged on the CPU, as without a device
    values: dict[str, torch.Tensor] = {}
    if "recall" in want:
        values.update({f"recall@{k}": recall_hits[k] for k in ks})
    if "map@r" in want:
        values["map@r"] = average_precision
    if "r_precision" in want:
        values["r_precision"] = r_precision
    unscored = (r <= 0).numpy()
    out: dict[str, np.ndarray] = {}
    for name, value in values.items():
        out[name] = value.cpu().numpy()
        out[name][unscored] = np.nan
    return out


def mean_metrics(per_query: dict[str, np.ndarray]) -> dict[str, float]:
    """The metrics ``per_query_metrics`` gives per query, averaged over the queries it measured (not NaN)."""
    # torch's float64 mean, the sum every report has always used (so the numbers stay what they were)
    return {name: float(torch.from_numpy(values[~np.isnan(values)]).mean()) for name, values in per_query.items()}


# ---------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------


def _check_ks(ks: Sequence[int], available: int) -> tuple[int, ...]:
    ks = tuple(ks)
    if not ks or not all(isinstance(k, (int, np.integer)) and k >= 1 for k in ks):
        raise ValueError(f"ks must be a non-empty sequence of positive ints; got {ks!r}")
    if max(ks) > available:
        raise ValueError(
            f"recall@{max(ks)} needs at least {max(ks)} gallery items per query but only {available} are"
            " available; pass smaller ks"
        )
    return tuple(sorted(set(int(k) for k in ks)))


def _check_metric_names(metrics: Sequence[str] | None) -> set[str]:
    if metrics is None:
        return set(METRIC_NAMES)
    if isinstance(metrics, str):
        metrics = [metrics]
    unknown = [m for m in metrics if m not in METRIC_NAMES]
    if unknown or not metrics:
        raise ValueError(f"unknown metrics {unknown}; choose from {', '.join(METRIC_NAMES)}")
    return set(metrics)


def evaluate(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    metrics: Sequence[str] | None = None,
    block_size: int | None = None,
    metric: str = "cosine",
    kmeans_niter: int = 50,
    seed: int = 0,
    same_items: bool = False,
    reorder: Reorder | None = None,
    min_depth: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Retrieval and clustering metrics of embeddings (conventions in the module docstring and
    ``neighbours``').

    Args:
        query, query_labels: [n, d] embeddings and [n] integer or string labels (numpy or torch).
        gallery, gallery_labels: the searched set; None = leave-one-out on the query set.
        ks: the K of each ``recall@K`` (a hit if any of the top K shares the query's label).
        metrics: subset of "recall", "map@r", "r_precision", "nmi", "f1" (default: all).
        block_size: queries per kNN block (None: ~64 MiB of scores per block). Results do not depend on it.
        metric: "cosine" (default), "euclidean" or "dot".
        kmeans_niter, seed: k-means iterations and seed for NMI/F1.
        same_items: gallery row i is query row i's image embedded another way (another model): it is left out of
            query i's list, as in leave-one-out; the rows and labels must then match.
        reorder, min_depth: re-rank each block's lists (rows, lists) -> lists, read at least min_depth deep.
        device: None or "cpu" (the CPU), "cuda", "cuda:N" or a torch.device: where the kNN blocks and their
            relevance run (the same metrics as the CPU's); NMI and F1 run on the CPU.

    Returns:
        {"recall@K": ..., "map@r": ..., "r_precision": ..., "nmi": ..., "f1": ...} as floats in [0, 1].
    """
    check_similarity(metric)
    check_block_size(block_size)
    dev = resolve_metrics_device(device)
    want = _check_metric_names(metrics)
    inputs = _Inputs.of(query, query_labels, gallery, gallery_labels, metric, same_items)
    out: dict[str, float] = {}
    if want & KNN_METRICS:
        out.update(mean_metrics(inputs.per_query(ks, want & KNN_METRICS, block_size, reorder, min_depth, dev)))
    if want & {"nmi", "f1"}:
        # Cluster in the space the similarity uses: normalised rows for cosine, raw otherwise.
        cluster_space = inputs.space.query if metric == "cosine" else inputs.query
        out.update(clustering_metrics(cluster_space, inputs.query_codes, want, kmeans_niter, seed))
    return out


def per_query_metrics(
    query: Any,
    query_labels: Any,
    gallery: Any = None,
    gallery_labels: Any = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    metrics: Sequence[str] = ("recall", "map@r", "r_precision"),
    block_size: int | None = None,
    metric: str = "cosine",
    same_items: bool = False,
    device: str | torch.device | None = None,
) -> dict[str, np.ndarray]:
    """``evaluate``'s kNN metrics per query (same arguments): float64 [n] in query order, NaN for a query with
    no relevant gallery item; ``mean_metrics`` of it is ``evaluate``'s numbers (a bootstrap resamples it)."""
    check_similarity(metric)
    check_block_size(block_size)
    dev = resolve_metrics_device(device)
    want = _check_metric_names(metrics)
    if want - KNN_METRICS:
        raise ValueError(f"per-query values exist for {', '.join(sorted(KNN_METRICS))} only, not "
                         f"{', '.join(sorted(want - KNN_METRICS))} (a clustering is one number for the whole set)")
    inputs = _Inputs.of(query, query_labels, gallery, gallery_labels, metric, same_items)
    return inputs.per_query(ks, want, block_size, None, 0, dev)


@dataclass
class _Inputs:
    """Checked inputs of ``evaluate`` and ``per_query_metrics``: the prepared space and the label codes."""

    query: torch.Tensor
    query_codes: np.ndarray
    gallery_codes: np.ndarray
    exclude_self: bool
    space: RankingSpace

    @classmethod
    def of(cls, query: Any, query_labels: Any, gallery: Any, gallery_labels: Any, metric: str,
           same_items: bool) -> _Inputs:
        """Check and prepare the inputs (conventions in the module docstring)."""
        check_similarity(metric)
        q = as_embeddings(query, "query")
        q_labels = as_label_array(query_labels, q.shape[0], "query_labels")
        if (gallery is None) != (gallery_labels is None):
            raise ValueError("pass gallery and gallery_labels together (or neither, for leave-one-out)")
        exclude_self = gallery is None or same_items
        g = None if gallery is None else as_embeddings(gallery, "gallery")
        if same_items and g is not None:
            g_labels = as_label_array(gallery_labels, g.shape[0], "gallery_labels")
            if g.shape[0] != q.shape[0] or not np.array_equal(g_labels, q_labels):
                raise ValueError("same_items needs the gallery to be the query set's images in the same order (same "
                                 f"labels); got {q.shape[0]} query and {g.shape[0]} gallery rows")
        if exclude_self:
            (q_codes,) = encode_labels(q_labels, None)
            g_codes = q_codes  # same_items: the gallery's labels are the query's
        else:
            g_labels = as_label_array(gallery_labels, g.shape[0], "gallery_labels")
            q_codes, g_codes = encode_labels(q_labels, g_labels)
        return cls(q, q_codes, g_codes, exclude_self, prepare_space(q, g, metric))

    def per_query(self, ks: Sequence[int], want: set[str], block_size: int | None, reorder: Reorder | None,
                  min_depth: int, device: torch.device | None) -> dict[str, np.ndarray]:
        """The kNN metrics in ``want`` per query (``_retrieval_per_query``)."""
        available = self.space.gallery.shape[0] - int(self.exclude_self)
        ks = _check_ks(ks, available) if "recall" in want else (1,)
        return _retrieval_per_query(self.space, torch.from_numpy(self.query_codes),
                                    torch.from_numpy(self.gallery_codes), ks, want, self.exclude_self, block_size,
                                    reorder, min_depth, device)
