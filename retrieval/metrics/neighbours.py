"""Exact k nearest neighbours, found in blocks of queries against the whole gallery (on the CPU or one CUDA GPU).

``knn`` returns each query's list; ``iter_knn_blocks`` yields the blocks' lists to a caller that reads them as they
come (``ranking`` scores them and keeps per-query values only). Conventions, fixed here so that every
caller ranks the same way:

* Similarity. ``metric="cosine"`` (default) L2-normalises both sets and ranks by inner product,
  ``"dot"`` ranks by the raw inner product, ``"euclidean"`` ranks by ascending Euclidean distance.
* Self. ``exclude_self`` removes gallery row i from query row i's list *by index*: an exact duplicate of a query
  (another row) is still a neighbour.
* Ties. Neighbours with equal scores are ranked by ascending gallery index, also when a tie straddles
  the depth cut (exact duplicates and collapsed embeddings give one well-defined ranking).
* Memory. At most ``block_size x gallery_size`` scores exist at once (never the N x N matrix); each block is read
  as deep as the deepest list it holds, so a caller that orders its queries by depth keeps shallow blocks shallow.
* Device. ``device=None`` or ``"cpu"`` computes on the CPU; ``"cuda"``/``"cuda:N"`` moves the prepared gallery
  to that GPU once and runs each block's scores, top-k and tie order there (float32 matmuls in full precision,
  never TF32), so the neighbours and their order are the CPU's. Inputs are checked and prepared (normalised) on the
  CPU either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.distances import l2_normalize
from retrieval.errors import ParameterError
from retrieval.metrics.inputs import as_embeddings
from retrieval.utils.sizes import size_text

SIMILARITIES = ("cosine", "euclidean", "dot")
# Scores held at once per block: block_size x gallery_size floats (64 MiB at float32).
DEFAULT_BLOCK_BYTES = 64 * 2**20
# On a GPU: scores of one block (the GPU does a block in milliseconds, so bigger blocks buy little), and the
# bytes per query and list position for the top-k values and indices, relevance and the float64 per-query maths.
DEVICE_BLOCK_BYTES = 256 * 2**20
DEVICE_BYTES_PER_DEPTH = 64


def check_similarity(metric: str) -> None:
    """A ValueError unless ``metric`` is one of SIMILARITIES."""
    if metric not in SIMILARITIES:
        raise ValueError(f"unknown metric {metric!r}; choose one of {', '.join(SIMILARITIES)}")


# ---------------------------------------------------------------------------------------------------
# The ranking space
# ---------------------------------------------------------------------------------------------------


@dataclass
class RankingSpace:
    """Query [n, d] and gallery [m, d] prepared for ranking: ``score = query @ gallery.T + gallery_bias`` (higher
    first)."""

    query: torch.Tensor
    gallery: torch.Tensor
    gallery_bias: torch.Tensor | None  # [m]: -|g|^2 for euclidean
    query_sq_norms: torch.Tensor | None  # [n]: |q|^2 for euclidean, to turn scores back into distances


def prepare_space(query: torch.Tensor, gallery: torch.Tensor | None, metric: str) -> RankingSpace:
    """The space ``metric`` ranks ``query`` [n, d] against ``gallery`` [m, d] in (None: the query set itself), both
    in their promoted dtype."""
    check_similarity(metric)
    dtype = torch.promote_types(query.dtype, gallery.dtype) if gallery is not None else query.dtype
    q = query.to(dtype)
    g = q if gallery is None else gallery.to(dtype)
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"query has dimension {q.shape[1]} but gallery has {g.shape[1]}; they must match")
    if metric == "cosine":
        q = l2_normalize(q)
        g = q if gallery is None else l2_normalize(g)
        return RankingSpace(q, g, None, None)
    if metric == "dot":
        return RankingSpace(q, g, None, None)
    # |q - g|^2 = |q|^2 - (2 q.g - |g|^2): rank by 2 q.g - |g|^2, the per-row |q|^2 does not change order.
    return RankingSpace(2.0 * q, g, -(g * g).sum(dim=1), (q * q).sum(dim=1))


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


def _space_on_device(space: RankingSpace, max_depth: int, device: torch.device) -> tuple[RankingSpace, int]:
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
    on_device = RankingSpace(space.query, space.gallery.to(device), bias, space.query_sq_norms)
    rows = _device_block_rows(n_gallery, itemsize, max_depth, _device_free_bytes(device), device)
    return on_device, rows


# ---------------------------------------------------------------------------------------------------
# Blocked kNN
# ---------------------------------------------------------------------------------------------------


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
    """Queries per CPU block: DEFAULT_BLOCK_BYTES of scores."""
    return max(1, DEFAULT_BLOCK_BYTES // (n_gallery * itemsize))


def iter_knn_blocks(
    space: RankingSpace,
    order: torch.Tensor,
    depths: torch.Tensor,
    exclude_self: bool,
    block_size: int | None,
    device: torch.device | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Yield (query_rows [b], scores [b, k], indices [b, k]) for the queries ``order`` [q] in blocks of b; a block's
    depth k is the largest of its queries' ``depths`` [q] (a block of depth 0 is skipped).

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


def check_block_size(block_size: int | None) -> None:
    """A ValueError unless ``block_size`` is a positive int or None (automatic)."""
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
    check_block_size(block_size)
    device = resolve_metrics_device(device)
    q = as_embeddings(query, "query")
    g = None if gallery is None else as_embeddings(gallery, "gallery")
    if exclude_self and g is not None and g.shape[0] != q.shape[0]:
        raise ValueError("exclude_self needs query and gallery to be the same set (same number of rows)")
    space = prepare_space(q, g, metric)
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
    for rows, values, indices in iter_knn_blocks(space, order, depths, exclude_self, block_size, device):
        out_scores[rows] = values
        out_indices[rows] = indices
    out_scores, out_indices = out_scores.cpu(), out_indices.cpu()
    if metric == "euclidean":
        # score = 2 q.g - |g|^2 = |q|^2 - |q - g|^2
        out_scores = (space.query_sq_norms[:, None] - out_scores).clamp_min(0.0).sqrt()
    return out_scores.numpy(), out_indices.numpy()
