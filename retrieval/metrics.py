"""Retrieval and clustering metrics: Recall@K, MAP@R, R-precision, NMI, pair F1; blocked kNN; linear probe.

Conventions (fixed here so that every caller reports the same numbers):

* Similarity. ``metric="cosine"`` (default) L2-normalises both sets and ranks by inner product,
  ``"dot"`` ranks by the raw inner product, ``"euclidean"`` ranks by ascending Euclidean distance.
* Leave-one-out. With ``gallery=None`` the query set is its own gallery and each query is removed from
  its own neighbour list *by index*: an exact duplicate of a query (another row) is still a neighbour.
* Queries with no relevant gallery item (R = 0: their class has no other item in the gallery) are left
  out of every kNN metric (Recall@K, MAP@R, R-precision), as in Musgrave et al. 2020 ("A Metric Learning
  Reality Check") and pytorch-metric-learning's AccuracyCalculator. If no query has R > 0 there is
  nothing to measure and ``evaluate`` raises ValueError.
* Ties. Neighbours with equal scores are ranked by ascending gallery index, also when a tie straddles
  the depth cut (exact duplicates and collapsed embeddings give one well-defined ranking).
* NMI and F1 are computed on the query set only: k-means (faiss, seeded) with as many clusters as the
  query set has classes, on the same embedding space the similarity uses (normalised for cosine).
* Memory. Neighbours are found in blocks of queries against the whole gallery, so at most
  ``block_size x gallery_size`` scores exist at once (never the N x N matrix); the depth of each block is
  the largest R in that block, and queries are processed sorted by R so that blocks of small classes
  stay shallow.
* Device. ``device=None`` or ``"cpu"`` computes on the CPU; ``"cuda"``/``"cuda:N"`` moves the prepared gallery
  to that GPU once and runs each block's scores, top-k, tie order and relevance counting there (float32 matmuls
  in full precision, never TF32), so the neighbours and their order are the CPU's; only per-query results come
  back. Inputs are checked and prepared (normalised) on the CPU either way; NMI and F1 (faiss k-means) stay
  on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.distances import l2_normalize
from retrieval.errors import ParameterError
from retrieval.sizes import size_text

SIMILARITIES = ("cosine", "euclidean", "dot")
METRIC_NAMES = ("recall", "map@r", "r_precision", "nmi", "f1")
KNN_METRICS = frozenset({"recall", "map@r", "r_precision"})
# Scores held at once per block: block_size x gallery_size floats (64 MiB at float32).
DEFAULT_BLOCK_BYTES = 64 * 2**20
# On a GPU: scores of one block (the GPU does a block in milliseconds, so bigger blocks buy little), and the
# bytes per query and list position for the top-k values and indices, relevance and the float64 per-query maths.
DEVICE_BLOCK_BYTES = 256 * 2**20
DEVICE_BYTES_PER_DEPTH = 64
SMALL_KMEANS_WORK = 10**7  # n * clusters * dim below which k-means runs on one thread


Reorder = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (query rows, their lists) -> the lists reordered


# ---------------------------------------------------------------------------------------------------
# Input checking and conversion
# ---------------------------------------------------------------------------------------------------


def _as_embeddings(x: Any, name: str) -> torch.Tensor:
    """A [n, d] float32/float64 CPU tensor, or a ValueError that says what is wrong."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu()
    else:
        try:
            t = torch.from_numpy(np.asarray(x))
        except TypeError as err:
            raise ValueError(f"{name} must be a numeric array [n, d]; got {type(x).__name__}") from err
    if t.ndim != 2:
        raise ValueError(f"{name} must be 2-D [n, d]; got shape {tuple(t.shape)} (reshape to [n, d])")
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}); pass at least one row and column")
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)):
        raise ValueError(f"{name} must hold real numbers; got dtype {t.dtype}")
    if t.dtype != torch.float64:
        t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN or inf; check the model output before evaluating")
    return t.contiguous()


def _as_label_array(labels: Any, n: int, name: str) -> np.ndarray:
    """Labels as a 1-D numpy array (ints or strings) of length n."""
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D [n]; got shape {arr.shape}")
    if len(arr) != n:
        raise ValueError(f"{name} has {len(arr)} entries but its embeddings have {n} rows")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must be integer or string class labels; got non-integer floats")
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iubUSO":
        raise ValueError(f"{name} must be integer or string class labels; got dtype {arr.dtype}")
    return arr


def _encode_labels(query_labels: np.ndarray, gallery_labels: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Map (possibly string) labels of both sets to shared int64 codes 0..C-1."""
    if gallery_labels is None:
        _, codes = np.unique(query_labels, return_inverse=True)
        return (codes.astype(np.int64).ravel(),)
    if query_labels.dtype.kind != gallery_labels.dtype.kind and "U" in (
        query_labels.dtype.kind,
        gallery_labels.dtype.kind,
    ):
        raise ValueError("query_labels and gallery_labels must both be strings or both be integers")
    both = np.concatenate([query_labels, gallery_labels])
    _, codes = np.unique(both, return_inverse=True)
    codes = codes.astype(np.int64).ravel()
    return codes[: len(query_labels)], codes[len(query_labels) :]


def _check_similarity(metric: str) -> None:
    if metric not in SIMILARITIES:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(SIMILARITIES)}")


# ---------------------------------------------------------------------------------------------------
# Device (CPU or one CUDA GPU)
# ---------------------------------------------------------------------------------------------------


def resolve_metrics_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device the kNN blocks run on, None for the CPU; a ParameterError that names the fix otherwise."""
    if device is None:
        return None
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as err:
            raise ParameterError("device", f"must be None, 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from err
    elif not isinstance(device, torch.device):
        raise ParameterError("device", f"must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device; got {device!r}")
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ParameterError("device", f"{str(device)!r} is not supported: the metrics run on the CPU or a CUDA GPU;"
                                       " use device='cpu' or 'cuda'")
    if not torch.cuda.is_available():
        raise ParameterError("device", f"{str(device)!r} was requested but no CUDA GPU is available"
                                       " (torch.cuda.is_available() is False); use device='cpu'")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ParameterError("device", f"'cuda:{index}' was requested but only {count} CUDA GPU(s) are visible;"
                                       f" use 'cuda:0'..'cuda:{count - 1}' or device='cpu'")
    return torch.device("cuda", index)


@contextlib.contextmanager
def _exact_float32_matmul() -> Iterator[None]:
    """cuBLAS float32 matmuls in full IEEE precision inside, whatever the caller set; restored after.

    TF32 (allow_tf32, set_float32_matmul_precision("high")) keeps 10 mantissa bits: scores off by ~1e-3 would
    reorder neighbours against the CPU's. torch >= 2.9 has the per-backend ``fp32_precision``; reading the old
    ``allow_tf32`` after setting it raises, so the new API is used where it exists.
    """
    matmul = torch.backends.cuda.matmul
    try:
        saved = matmul.fp32_precision
    except AttributeError:  # torch < 2.9: only the legacy flag
        saved_tf32 = matmul.allow_tf32
        matmul.allow_tf32 = False
        try:
            yield
        finally:
            matmul.allow_tf32 = saved_tf32
        return
    matmul.fp32_precision = "ieee"
    try:
        yield
    finally:
        matmul.fp32_precision = saved


def _device_free_bytes(device: torch.device) -> int:
    """Bytes this process can still allocate on ``device``: free memory plus what torch's allocator caches unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _device_block_rows(n_gallery: int, itemsize: int, max_depth: int, available: int, device: torch.device) -> int:
    """Queries per block on a GPU: a score block of at most DEVICE_BLOCK_BYTES whose worst-case working set fits.

    Per query row the worst case is its scores, a sorted copy with int64 indices (a tie straddling the cut sorts
    the whole row) and the list's own work; half of the memory left is kept back for cuBLAS, the allocator's
    rounding and the caller (a training run holds the model there).
    """
    per_row = n_gallery * (3 * itemsize + 8) + max_depth * DEVICE_BYTES_PER_DEPTH
    rows = min(max(1, DEVICE_BLOCK_BYTES // (n_gallery * itemsize)), available // 2 // per_row)
    if rows < 1:
        raise ParameterError("device", f"{device} has {size_text(available)} free after the gallery, too little for"
                                       f" one query's scores ({size_text(2 * per_row)} with headroom); use"
                                       " device='cpu' or free GPU memory")
    return int(rows)


def _space_on_device(space: _Space, max_depth: int, device: torch.device) -> tuple[_Space, int]:
    """(space with its gallery on ``device``, queries per block); checks that it fits before moving anything.

    The queries stay on the CPU and travel one block at a time: a block is small, the query set may not be.
    """
    gallery_bytes = space.gallery.numel() * space.gallery.element_size()
    if space.gallery_bias is not None:
        gallery_bytes += space.gallery_bias.numel() * space.gallery_bias.element_size()
    free = _device_free_bytes(device)
    n_gallery, itemsize = space.gallery.shape[0], space.gallery.element_size()
    one_row = 2 * (n_gallery * (3 * itemsize + 8) + max_depth * DEVICE_BYTES_PER_DEPTH)
    if gallery_bytes + one_row > free:
        raise ParameterError("device", f"{device} cannot hold the gallery ({size_text(gallery_bytes)}) and one block"
                                       f" of scores: {size_text(free)} is free; use device='cpu' or free GPU memory")
    bias = None if space.gallery_bias is None else space.gallery_bias.to(device)
    on_device = _Space(space.query, space.gallery.to(device), bias, space.query_sq_norms)
    rows = _device_block_rows(n_gallery, itemsize, max_depth, _device_free_bytes(device), device)
    return on_device, rows


# ---------------------------------------------------------------------------------------------------
# Blocked kNN
# ---------------------------------------------------------------------------------------------------


@dataclass
class _Space:
    """Query and gallery prepared for ranking: ``score = query @ gallery.T + gallery_bias`` (higher first)."""

    query: torch.Tensor
    gallery: torch.Tensor
    gallery_bias: torch.Tensor | None  # -|g|^2 for euclidean
    query_sq_norms: torch.Tensor | None  # |q|^2 for euclidean, to turn scores back into distances


def _prepare_space(query: torch.Tensor, gallery: torch.Tensor | None, metric: str) -> _Space:
    _check_similarity(metric)
    dtype = torch.promote_types(query.dtype, gallery.dtype) if gallery is not None else query.dtype
    q = query.to(dtype)
    g = q if gallery is None else gallery.to(dtype)
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"query has dimension {q.shape[1]} but gallery has {g.shape[1]}; they must match")
    if metric == "cosine":
        q = l2_normalize(q)
        g = q if gallery is None else l2_normalize(g)
        return _Space(q, g, None, None)
    if metric == "dot":
        return _Space(q, g, None, None)
    # |q - g|^2 = |q|^2 - (2 q.g - |g|^2): rank by 2 q.g - |g|^2, the per-row |q|^2 does not change order.
    return _Space(2.0 * q, g, -(g * g).sum(dim=1), (q * q).sum(dim=1))


def _order_ties_by_index(values: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Within runs of equal values (rows already sorted descending), put lower indices first.

    One integer sort on (run number, index): cheaper than two stable sorts. In float32 a 6000-deep list
    nearly always holds a few equal neighbours, so this runs on most rows of deep blocks.
    """
    run = torch.zeros_like(indices)
    run[:, 1:] = (values[:, 1:] != values[:, :-1]).cumsum(dim=1)
    _, order = (run * (int(indices.max()) + 1) + indices).sort(dim=1)
    return values.gather(1, order), indices.gather(1, order)


def _topk_index_tiebreak(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k per row, best first; equal scores ordered by ascending column index (also at the k-th cut).

    torch.topk orders ties arbitrarily and picks arbitrary members of a tie that straddles the k-th
    position. One extra neighbour shows a straddling tie (the (k+1)-th equals the k-th); those rows are
    redone with a full stable sort (rare: an exact tie at the cut).
    """
    depth = min(k + 1, scores.shape[1])
    values, indices = scores.topk(depth, dim=1, largest=True, sorted=True)
    if depth > k:
        tie_at_cut = torch.nonzero(values[:, k] == values[:, k - 1]).flatten()
        values, indices = values[:, :k], indices[:, :k]
        if len(tie_at_cut):
            full_values, full_indices = scores[tie_at_cut].sort(dim=1, descending=True, stable=True)
            values[tie_at_cut] = full_values[:, :k]
            indices[tie_at_cut] = full_indices[:, :k]
    tie_inside = torch.nonzero((values[:, 1:] == values[:, :-1]).any(dim=1)).flatten()
    if len(tie_inside):
        values[tie_inside], indices[tie_inside] = _order_ties_by_index(values[tie_inside], indices[tie_inside])
    return values, indices


def _auto_block_size(n_gallery: int, itemsize: int) -> int:
    return max(1, DEFAULT_BLOCK_BYTES // (n_gallery * itemsize))


def _iter_knn_blocks(
    space: _Space,
    order: torch.Tensor,
    depths: torch.Tensor,
    exclude_self: bool,
    block_size: int | None,
    device: torch.device | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (query_rows, scores, indices) for queries ``order`` in blocks; depth = max ``depths`` in block.

    ``scores`` are ranking scores (higher = nearer); with ``exclude_self`` row i never returns column i.
    ``order`` and ``depths`` are CPU tensors; with a CUDA ``device`` the yielded tensors (rows too) are on it.
    """
    n_gallery = space.gallery.shape[0]
    step = block_size or _auto_block_size(n_gallery, space.gallery.element_size())
    if device is not None:
        space, device_rows = _space_on_device(space, int(depths.max()) if len(depths) else 1, device)
        step = min(step, device_rows)  # a caller's block_size never exceeds what the GPU holds
    for start in range(0, len(order), step):
        rows = order[start : start + step]
        k = int(depths[start : start + step].max())
        if k == 0:
            continue
        if device is None:
            scores = space.query[rows] @ space.gallery.T
        else:
            block = space.query[rows].to(device)
            rows = rows.to(device)
            with _exact_float32_matmul():
                scores = block @ space.gallery.T
        if space.gallery_bias is not None:
            scores += space.gallery_bias
        if exclude_self:
            scores[torch.arange(len(rows), device=scores.device), rows] = -torch.inf
        values, indices = _topk_index_tiebreak(scores, k)
        yield rows, values, indices


def _check_block_size(block_size: int | None) -> None:
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"block_size must be a positive int or None (automatic); got {block_size!r}")


def knn(
    query: Any,
    gallery: Any = None,
    k: int = 10,
    exclude_self: bool = False,
    metric: str = "cosine",
    block_size: int | None = None,
    device: str | torch.device | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The k nearest gallery items of each query, computed in blocks of queries.

    Args:
        query: [n, d] embeddings (numpy or torch, float32/float64).
        gallery: [m, d] embeddings; None searches the query set itself.
        k: neighbours per query.
        exclude_self: drop gallery row i from query row i's list (by index; for query == gallery).
        metric: "cosine" | "dot" (scores are similarities, descending) or "euclidean" (scores are
            Euclidean distances, ascending).
        block_size: queries per block; None picks one so that a block of scores is ~64 MiB (on a GPU: at most
            ~256 MiB and what its free memory holds, which also caps a given block_size).
        device: None or "cpu" (the CPU), "cuda", "cuda:N" or a torch.device: where the blocks are scored and
            ranked (the same neighbours in the same order; scores equal within float32 rounding).

    Returns:
        (scores [n, k], indices [n, k]) numpy arrays, nearest first; ties ordered by gallery index.
    """
    _check_block_size(block_size)
    device = resolve_metrics_device(device)
    q = _as_embeddings(query, "query")
    g = None if gallery is None else _as_embeddings(gallery, "gallery")
    if exclude_self and g is not None and g.shape[0] != q.shape[0]:
        raise ValueError("exclude_self needs query and gallery to be the same set (same number of rows)")
    space = _prepare_space(q, g, metric)
    available = space.gallery.shape[0] - int(exclude_self)
    if not isinstance(k, (int, np.integer)) or k < 1 or k > available:
        minus_self = " - 1" if exclude_self else ""
        raise ValueError(f"k must be an int in [1, {available}] (gallery size{minus_self}); got {k!r}")
    n = q.shape[0]
    # on a GPU the lists are gathered there and come back once (n x k is small next to a block of scores)
    out_scores = torch.empty(n, int(k), dtype=space.query.dtype, device=device)
    out_indices = torch.empty(n, int(k), dtype=torch.int64, device=device)
    order = torch.arange(n)
    depths = torch.full((n,), int(k))
    for rows, values, indices in _iter_knn_blocks(space, order, depths, exclude_self, block_size, device):
        out_scores[rows] = values
        out_indices[rows] = indices
    out_scores, out_indices = out_scores.cpu(), out_indices.cpu()
    if metric == "euclidean":
        # score = 2 q.g - |g|^2 = |q|^2 - |q - g|^2
        out_scores = (space.query_sq_norms[:, None] - out_scores).clamp_min(0.0).sqrt()
    return out_scores.numpy(), out_indices.numpy()


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
    space: _Space,
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
    for rows, _, indices in _iter_knn_blocks(space, order, depth[order], exclude_self, block_size, device):
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
# Clustering metrics
# ---------------------------------------------------------------------------------------------------


def kmeans_assign(embeddings: Any, num_clusters: int, niter: int = 50, seed: int = 0) -> np.ndarray:
    """Cluster index per row from faiss k-means (k-means++ init, all points used for training, fixed seed)."""
    import faiss

    x = np.ascontiguousarray(_as_embeddings(embeddings, "embeddings").numpy(), dtype=np.float32)
    n, d = x.shape
    if not 1 <= num_clusters <= n:
        raise ValueError(f"num_clusters must be in [1, {n}] (number of rows); got {num_clusters}")
    if num_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    kmeans = faiss.Kmeans(d, num_clusters, niter=niter, seed=seed, verbose=False)
    kmeans.cp.max_points_per_centroid = n  # train on every point, no subsampling
    kmeans.cp.min_points_per_centroid = 1  # small sets are fine here; do not warn
    if hasattr(faiss, "ClusteringInitMethod_KMEANS_PLUS_PLUS"):  # faiss >= 1.14; random init otherwise
        # random seeds often put two seeds in one true class and none in another: k-means++ avoids that
        kmeans.cp.init_method = faiss.ClusteringInitMethod_KMEANS_PLUS_PLUS
    # Small problems run single-threaded: OpenMP start-up and spinning cost far more than the work
    # (0.6 s instead of <1 ms for 100 points on a busy 2-core machine). The setting is restored after.
    threads = faiss.omp_get_max_threads()
    if n * num_clusters * d < SMALL_KMEANS_WORK:
        faiss.omp_set_num_threads(1)
    try:
        kmeans.train(x)
        _, assignment = kmeans.index.search(x, 1)
    finally:
        faiss.omp_set_num_threads(threads)
    return assignment.ravel().astype(np.int64)


def pair_f1(true_labels: Any, cluster_labels: Any) -> float:
    """Pair-counting clustering F1 (Song et al. 2016, lifted structure, sec. 5).

    Over all unordered pairs: precision = pairs in the same cluster and class / pairs in the same
    cluster; recall = the same / pairs in the same class; F1 = 2PR / (P + R). The pair counts come from
    scikit-learn's ``pair_confusion_matrix`` (from a sparse contingency table; it counts ordered pairs, twice the
    unordered ones, which leaves the ratios as they are). A 0/0 precision or recall counts as 0, except when there
    are no same-class and no same-cluster pairs at all (all singletons on both sides), which agree perfectly: 1.0.
    """
    from sklearn.metrics.cluster import pair_confusion_matrix

    true_arr = _as_label_array(true_labels, len(np.asarray(true_labels)), "true_labels")
    cluster_arr = _as_label_array(cluster_labels, len(true_arr), "cluster_labels")
    if len(true_arr) == 0:
        raise ValueError("pair_f1 needs at least one item")
    (_, apart_same_cluster), (apart_same_class, together_and_same) = pair_confusion_matrix(true_arr, cluster_arr)
    together_and_same = int(together_and_same)
    same_cluster = together_and_same + int(apart_same_cluster)
    same_class = together_and_same + int(apart_same_class)
    if same_cluster == 0 and same_class == 0:
        return 1.0
    precision = together_and_same / same_cluster if same_cluster else 0.0
    recall = together_and_same / same_class if same_class else 0.0
    if precision + recall == 0:
        return 0.0
    return 2.0 * precision * recall / (precision + recall)


def _clustering_metrics(
    space_query: torch.Tensor, query_codes: np.ndarray, want: set[str], niter: int, seed: int
) -> dict[str, float]:
    from sklearn.metrics import normalized_mutual_info_score

    num_classes = len(np.unique(query_codes))
    clusters = kmeans_assign(space_query, num_classes, niter=niter, seed=seed)
    out: dict[str, float] = {}
    if "nmi" in want:
        out["nmi"] = float(normalized_mutual_info_score(query_codes, clusters))
    if "f1" in want:
        out["f1"] = pair_f1(query_codes, clusters)
    return out


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
    """Retrieval and clustering metrics of embeddings (conventions in the module docstring).

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
    _check_similarity(metric)
    _check_block_size(block_size)
    dev = resolve_metrics_device(device)
    want = _check_metric_names(metrics)
    inputs = _Inputs.of(query, query_labels, gallery, gallery_labels, metric, same_items)
    out: dict[str, float] = {}
    if want & KNN_METRICS:
        out.update(mean_metrics(inputs.per_query(ks, want & KNN_METRICS, block_size, reorder, min_depth, dev)))
    if want & {"nmi", "f1"}:
        # Cluster in the space the similarity uses: normalised rows for cosine, raw otherwise.
        cluster_space = inputs.space.query if metric == "cosine" else inputs.query
        out.update(_clustering_metrics(cluster_space, inputs.query_codes, want, kmeans_niter, seed))
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
    _check_similarity(metric)
    _check_block_size(block_size)
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
    space: _Space

    @classmethod
    def of(cls, query: Any, query_labels: Any, gallery: Any, gallery_labels: Any, metric: str,
           same_items: bool) -> _Inputs:
        """Check and prepare the inputs (conventions in the module docstring)."""
        _check_similarity(metric)
        q = _as_embeddings(query, "query")
        q_labels = _as_label_array(query_labels, q.shape[0], "query_labels")
        if (gallery is None) != (gallery_labels is None):
            raise ValueError("pass gallery and gallery_labels together (or neither, for leave-one-out)")
        exclude_self = gallery is None or same_items
        g = None if gallery is None else _as_embeddings(gallery, "gallery")
        if same_items and g is not None:
            g_labels = _as_label_array(gallery_labels, g.shape[0], "gallery_labels")
            if g.shape[0] != q.shape[0] or not np.array_equal(g_labels, q_labels):
                raise ValueError("same_items needs the gallery to be the query set's images in the same order (same "
                                 f"labels); got {q.shape[0]} query and {g.shape[0]} gallery rows")
        if exclude_self:
            (q_codes,) = _encode_labels(q_labels, None)
            g_codes = q_codes  # same_items: the gallery's labels are the query's
        else:
            g_labels = _as_label_array(gallery_labels, g.shape[0], "gallery_labels")
            q_codes, g_codes = _encode_labels(q_labels, g_labels)
        return cls(q, q_codes, g_codes, exclude_self, _prepare_space(q, g, metric))

    def per_query(self, ks: Sequence[int], want: set[str], block_size: int | None, reorder: Reorder | None,
                  min_depth: int, device: torch.device | None) -> dict[str, np.ndarray]:
        """The kNN metrics in ``want`` per query (``_retrieval_per_query``)."""
        available = self.space.gallery.shape[0] - int(self.exclude_self)
        ks = _check_ks(ks, available) if "recall" in want else (1,)
        return _retrieval_per_query(self.space, torch.from_numpy(self.query_codes),
                                    torch.from_numpy(self.gallery_codes), ks, want, self.exclude_self, block_size,
                                    reorder, min_depth, device)


# ---------------------------------------------------------------------------------------------------
# Linear probe
# ---------------------------------------------------------------------------------------------------


def linear_probe(
    train_emb: Any,
    train_labels: Any,
    test_emb: Any,
    test_labels: Any,
    C: float = 1.0,
    max_iter: int = 1000,
    seed: int = 0,
) -> float:
    """Test accuracy of a logistic-regression classifier on standardised frozen embeddings (DCDL)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x_train = _as_embeddings(train_emb, "train_emb").numpy()
    x_test = _as_embeddings(test_emb, "test_emb").numpy()
    if x_train.shape[1] != x_test.shape[1]:
        raise ValueError(f"train_emb has dimension {x_train.shape[1]} but test_emb has {x_test.shape[1]}")
    y_train = _as_label_array(train_labels, len(x_train), "train_labels")
    y_test = _as_label_array(test_labels, len(x_test), "test_labels")
    if len(np.unique(y_train)) < 2:
        raise ValueError("linear_probe needs at least two classes in train_labels")
    scaler = StandardScaler().fit(x_train)
    classifier = LogisticRegression(C=C, max_iter=max_iter, random_state=seed)
    classifier.fit(scaler.transform(x_train), y_train)
    return float((classifier.predict(scaler.transform(x_test)) == y_test).mean())
