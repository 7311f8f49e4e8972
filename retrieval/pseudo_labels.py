"""Pseudo-labels for fine-tuning an embedder without labels, refreshed from the current embeddings each epoch, and the
label-free figures a report shows of them. Plain functions over NumPy arrays (no torch on import):

    cluster_pseudo_labels           DBSCAN over the k-reciprocal Jaccard distance (SpCL, Cluster Contrast)
    mutual_neighbour_pseudo_labels  connected components of the mutual kNN graph (after Iscen et al.)
    pseudo_label_summary            clusters, singletons, the largest cluster and a size histogram
    pseudo_label_stability          adjusted Rand index between two epochs' labels
    moved_most                      per-image neighbours kept between two embeddings, and the images that moved most

Conventions of every labelling here: labels are int64 [N], contiguous 0..C-1, every image labelled (an image no
cluster takes is a singleton: its own label, as SpCL keeps un-clustered images as instances); groups are numbered by
size, largest first, equal sizes by their first row, so the same partition always gets the same numbers. An all-zero
embedding has no direction: it is always a singleton. NaN or inf in the embeddings is a ``ParameterError``
(a ValueError).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from retrieval.compatibility import KEPT_K, neighbour_overlap
from retrieval.errors import ParameterError

# cluster_pseudo_labels holds about CLUSTER_BYTES_PER_PAIR bytes per image pair at its peak (the distances and the
# k-reciprocal sets as dense N x N matrices, rerank.methods' own layout; then the sums of minima and the N x N float32
# Jaccard matrix DBSCAN reads): measured 1.7 GB for 10,000 images (tracemalloc; ~40 s on two busy CPU cores); beyond
# MAX_CLUSTER_IMAGES it refuses rather than exhaust a training machine's memory
MAX_CLUSTER_IMAGES = 10_000
CLUSTER_BYTES_PER_PAIR = 20
_TRIPLE_BLOCK = 2**22  # (image, image, shared column) terms of the Jaccard sums gathered at once (~100 MB)


# --- inputs ------------------------------------------------------------------------------------------------------
def _embeddings(embeddings: Any, name: str = "embeddings") -> np.ndarray:
    """``embeddings`` as float32 [N, D] (N, D >= 1), finite, or a ParameterError that says what is wrong."""
    array = np.asarray(embeddings)
    if array.ndim != 2 or array.shape[0] < 1 or array.shape[1] < 1:
        raise ParameterError(name, f"must be a 2-D array [N, D] with N, D >= 1, got shape {array.shape}")
    if array.dtype.kind not in "fiu":
        raise ParameterError(name, f"must hold real numbers, got dtype {array.dtype}")
    array = np.ascontiguousarray(array, dtype=np.float32)
    bad = ~np.isfinite(array).all(axis=1)
    if bad.any():
        raise ParameterError(name, f"holds NaN or inf in {int(bad.sum())} of {len(array)} rows (first: row "
                                   f"{int(np.argmax(bad))}); check the model's output before labelling")
    return array


def _unit_and_directed(embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows scaled to unit length float32 [N, D], rows that have a direction [N] bool: not all zero)."""
    norms = np.linalg.norm(embeddings.astype(np.float64), axis=1)
    directed = norms > 0
    unit = embeddings / np.where(directed, norms, 1.0)[:, None]
    return np.ascontiguousarray(unit, dtype=np.float32), directed


def _labels(labels: Any, name: str, n: int | None = None) -> np.ndarray:
    """``labels`` as int64 [N] of non-negative ints, or a ParameterError."""
    array = np.asarray(labels)
    if array.ndim != 1 or len(array) == 0:
        raise ParameterError(name, f"must be a 1-D array of N >= 1 labels, got shape {array.shape}")
    if n is not None and len(array) != n:
        raise ParameterError(name, f"must label the same {n} images, got {len(array)} labels")
    if array.dtype.kind == "f" and np.all(np.isfinite(array)) and np.all(array == np.round(array)):
        array = array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise ParameterError(name, f"must be integer labels, got dtype {array.dtype}")
    if array.min() < 0:
        raise ParameterError(name, "holds a negative label: give each un-clustered image a label of its own (as "
                                   "these functions do), not DBSCAN's -1")
    return array.astype(np.int64)


def _numbered(groups: np.ndarray) -> np.ndarray:
    """Any group ids [N] (>= 0) renumbered 0..C-1: largest group first, equal sizes by their first row."""
    _, first, inverse, counts = np.unique(groups, return_index=True, return_inverse=True, return_counts=True)
    order = np.lexsort((first, -counts))
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order))
    return rank[inverse.ravel()]


def _with_singletons(n: int, rows: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Labels [n]: ``rows`` take their ``groups`` (-1: none), every other row a singleton; numbered by ``_numbered``."""
    full = np.arange(n, dtype=np.int64) + n  # ids n.. for singletons, apart from every group id (< n)
    full[rows[groups >= 0]] = groups[groups >= 0]
    return _numbered(full)


# --- the k-reciprocal Jaccard distance ---------------------------------------------------------------------------
def _k_reciprocal_weights(unit: np.ndarray, k1: int, k2: int) -> Any:
    """Zhong et al.'s V [N, N] of every image over the set of all (k-reciprocal sets R*(i, k1), weights exp(-d), each
    row summing to 1, local query expansion over k2) as a scipy CSR matrix of float64: the steps of
    ``rerank.methods.k_reciprocal_distances``, with its own helpers, for all N rows rather than one query's (that
    function returns the query's row of distances only). The sets are found as it finds them (dense N x N);
    the weights are kept sparse (a few dozen per row), the local query expansion a sparse product."""
    from scipy.sparse import csr_matrix

    from retrieval.rerank.methods import PAIR_BLOCK, _members, _reciprocal, _smallest

    m = len(unit)
    gram = unit @ unit.T
    squared = np.diag(gram).copy()
    distance = np.maximum(squared[:, None] + squared[None, :] - 2.0 * gram, 0.0).astype(np.float64)
    del gram
    largest = distance.max(axis=1, keepdims=True)
    distance /= np.where(largest > 0, largest, 1.0)
    rank = _smallest(distance, max(k1 + 1, k2))  # the nearest of each image, itself first
    reciprocal = _reciprocal(rank, k1)
    half = int(np.around(k1 / 2))  # rounds half to even, as the authors' code and rerank.methods do
    half_lists, half_sizes = _members(_reciprocal(rank, half), rank, half)
    padded = np.concatenate([reciprocal, np.zeros((m, 1), dtype=bool)], axis=1)
    del reciprocal
    pairs_i, pairs_j = np.nonzero(padded[:, :m])
    blocks = [slice(start, start + PAIR_BLOCK) for start in range(0, len(pairs_i), PAIR_BLOCK)]
    joins = np.concatenate([padded[pairs_i[b, None], half_lists[pairs_j[b]]].sum(axis=1)
                            > 2.0 / 3.0 * half_sizes[pairs_j[b]] for b in blocks] or [np.zeros(0, dtype=bool)])
    for b in blocks:  # every join decided before any is written, as R(i, k1) is read whole before R*(i) grows
        joined = joins[b]
        padded[pairs_i[b][joined][:, None], half_lists[pairs_j[b][joined]]] = True
    expanded = padded[:, :m]
    np.fill_diagonal(expanded, True)
    rows, columns = np.nonzero(expanded)
    del padded, expanded
    values = np.exp(-distance[rows, columns])
    del distance
    values /= np.bincount(rows, weights=values, minlength=m)[rows]
    weights = csr_matrix((values, (rows, columns)), shape=(m, m))
    if k2 > 1:
        nearest = rank[:, : min(k2, m)]
        mean = csr_matrix((np.full(nearest.size, 1.0 / nearest.shape[1]),
                           (np.repeat(np.arange(m), nearest.shape[1]), nearest.ravel())), shape=(m, m))
        weights = mean @ weights
    return weights


def k_reciprocal_jaccard(embeddings: np.ndarray, k1: int = 30, k2: int = 6) -> np.ndarray:
    """Zhong et al.'s Jaccard distance d_J [N, N] float32 between all images (lambda = 0), row i equal to
    ``rerank.k_reciprocal_distances(x_i, the others, k1, k2, 0)``; dense, at most ``MAX_CLUSTER_IMAGES`` images.

    d_J(i, j) = 1 - sum_k min(V_ik, V_jk) / sum_k max(V_ik, V_jk); the sums of minima run over the columns both rows
    weigh (V is sparse: a few dozen per row), and sum max = sum V_i + sum V_j - sum min. Zero rows take part as
    ``k_reciprocal_distances`` takes them (``cluster_pseudo_labels`` leaves them out first)."""
    x = _embeddings(embeddings)
    n = len(x)
    _check_cluster_size(n)
    if k1 < 1 or k2 < 1:
        raise ParameterError("k1", f"and k2 must be at least 1, got k1={k1}, k2={k2}")
    unit, _ = _unit_and_directed(x)
    weights = _k_reciprocal_weights(unit, int(k1), int(k2))
    sums = np.asarray(weights.sum(axis=1)).ravel()
    by_column = weights.tocsc()
    by_column.sort_indices()
    rows, values, counts = by_column.indices.astype(np.int64), by_column.data, np.diff(by_column.indptr)
    starts = by_column.indptr[:-1].astype(np.int64)
    del weights, by_column
    shared = np.zeros(n * n, dtype=np.float64)  # sum_k min(V_ik, V_jk), summed column by column
    for size in np.unique(counts[counts > 0]):
        at = starts[counts == size][:, None] + np.arange(size)  # [columns weighed by `size` images, size]
        step = max(1, _TRIPLE_BLOCK // (size * size))
        for block in range(0, len(at), step):
            members, weight = rows[at[block:block + step]], values[at[block:block + step]]
            flat = members[:, :, None] * n + members[:, None, :]
            np.add.at(shared, flat.ravel(), np.minimum(weight[:, :, None], weight[:, None, :]).ravel())
    shared = shared.reshape(n, n)
    jaccard = np.empty((n, n), dtype=np.float32)
    step = max(1, _TRIPLE_BLOCK // n)
    for start in range(0, n, step):  # a block of rows at a time: no more N x N float64 temporaries
        block = shared[start:start + step]
        larger = sums[start:start + step, None] + sums[None, :] - block
        jaccard[start:start + step] = np.clip(1.0 - block / np.where(larger > 0, larger, 1.0), 0.0, 1.0)
    np.fill_diagonal(jaccard, 0.0)
    return jaccard


def _check_cluster_size(n: int) -> None:
    if n > MAX_CLUSTER_IMAGES:
        raise ParameterError("embeddings", f"has {n:,} images; the k-reciprocal Jaccard distance is computed as "
                                           f"dense N x N matrices (~{CLUSTER_BYTES_PER_PAIR} bytes per pair: "
                                           f"{CLUSTER_BYTES_PER_PAIR * n * n / 1e9:.1f} GB here), so at most "
                                           f"{MAX_CLUSTER_IMAGES:,} are clustered at once: cluster a random sample "
                                           "of that size (and give the rest their nearest clustered image's label), "
                                           "or use mutual_neighbour_pseudo_labels, which finds neighbours in blocks")


# --- the labellings ----------------------------------------------------------------------------------------------
def cluster_pseudo_labels(embeddings: np.ndarray, eps: float = 0.6, min_samples: int = 4, k1: int = 30,
                          k2: int = 6) -> np.ndarray:
    """Pseudo-labels [N] int64 as SpCL (Ge et al., NeurIPS 2020) and Cluster Contrast (Dai et al. 2021) make them.

    DBSCAN (scikit-learn, ``metric="precomputed"``, ``eps``, ``min_samples`` counting the image itself) over the
    k-reciprocal Jaccard distance (``k_reciprocal_jaccard``, k1, k2: Zhong et al. 2017, lambda = 0) of the
    L2-normalised embeddings; the papers' defaults. DBSCAN's noise (-1) and all-zero rows become singletons.
    Numbered largest cluster first, equal sizes by first row, singletons after all clusters in row order.

    Memory: not blocked. The distance is dense (N x N float32, and the k-reciprocal sets and weights before it as
    ``rerank.methods`` builds them, ~``CLUSTER_BYTES_PER_PAIR`` bytes per pair at the peak); above
    ``MAX_CLUSTER_IMAGES`` images it raises a ParameterError that says to cluster a sample."""
    from sklearn.cluster import DBSCAN

    x = _embeddings(embeddings)
    n = len(x)
    if not eps > 0:
        raise ParameterError("eps", f"must be a positive distance (the Jaccard distance lies in [0, 1]), got {eps}")
    if min_samples < 1:
        raise ParameterError("min_samples", f"must be at least 1, got {min_samples}")
    _check_cluster_size(n)
    unit, directed = _unit_and_directed(x)
    rows = np.flatnonzero(directed)
    if len(rows) == 0:
        return np.arange(n, dtype=np.int64)
    distance = k_reciprocal_jaccard(unit[rows], k1, k2)
    groups = DBSCAN(eps=float(eps), min_samples=int(min_samples), metric="precomputed").fit_predict(distance)
    return _with_singletons(n, rows, groups.astype(np.int64))


def mutual_neighbour_pseudo_labels(embeddings: np.ndarray, k: int = 5, device: str | None = None) -> np.ndarray:
    """Pseudo-labels [N] int64: connected components of the mutual k-nearest-neighbour graph by cosine.

    i and j are linked when each is among the other's k nearest (itself excluded; ties by lower row, the
    project's ``retrieval.metrics.knn``, in blocks: never N x N; ``device`` "cuda" runs its blocks on a GPU). In the
    spirit of Iscen et al., "Mining on Manifolds" (CVPR 2018), who take as positives the images near an anchor on the
    data manifold (a random walk's manifold similarity over the kNN graph) but far from it in Euclidean terms; here
    the manifold is simply the mutual kNN graph's components, with no random walk and no hard-positive choice, and
    every member of a component is a positive. Exact duplicate embeddings (after normalisation) are one node and
    share a label (else ties would link only the first k + 1 of them). Components of one image are singletons, as
    are all-zero rows. A chain of mutual links can join distinct classes into one giant component:
    ``pseudo_label_summary``'s ``largest_share`` shows it. k is lowered to N - 1 on fewer images."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    from retrieval.metrics.neighbours import knn

    x = _embeddings(embeddings)
    n = len(x)
    if k < 1:
        raise ParameterError("k", f"must be at least 1, got {k}")
    unit, directed = _unit_and_directed(x)
    rows = np.flatnonzero(directed)
    _, first, node_of = np.unique(unit[rows], axis=0, return_index=True, return_inverse=True)
    by_first = np.argsort(first)  # nodes in the order of their first row, so that ties go by row as in knn
    nodes = unit[rows][first[by_first]]
    renumber = np.empty(len(by_first), dtype=np.int64)
    renumber[by_first] = np.arange(len(by_first))
    node_of = renumber[node_of.ravel()]
    m = len(nodes)
    if m < 2:
        return _with_singletons(n, rows, np.zeros(len(rows), dtype=np.int64))
    depth = min(int(k), m - 1)
    _, found = knn(nodes, k=depth, exclude_self=True, metric="dot", device=device)
    linked = coo_matrix((np.ones(m * depth, dtype=np.int8), (np.repeat(np.arange(m), depth), found.ravel())),
                        shape=(m, m)).tocsr()
    mutual = linked.multiply(linked.T)
    _, components = connected_components(mutual, directed=False)
    return _with_singletons(n, rows, components.astype(np.int64)[node_of])


# --- what a report shows -----------------------------------------------------------------------------------------
def _size_buckets(largest: int) -> list[tuple[int, int]]:
    """Size ranges [low, high] 1, 2-3, 4-7, 8-15, ... up to the one holding ``largest``."""
    buckets, low = [], 1
    while low <= max(largest, 1):
        buckets.append((low, 2 * low - 1))
        low *= 2
    return buckets


def pseudo_label_summary(labels: np.ndarray) -> dict[str, Any]:
    """The figures of a labelling [N] (non-negative ints; a label held once is a singleton), JSON-ready.

    ``images``; ``clusters`` (labels held by >= 2 images), ``clustered_images`` and ``clustered_share``;
    ``singletons``; ``largest_cluster`` and ``largest_share`` (0 without clusters; a share near 1 is one giant
    cluster: collapsed embeddings, or chained mutual neighbours); ``median_cluster_size`` (None without clusters);
    ``size_histogram``: [(bucket, groups)] for sizes "1", "2-3", "4-7", "8-15", ... up to the largest, the number
    of groups (singletons in "1") of each size, a bar chart's bars."""
    array = _labels(labels, "labels")
    n = len(array)
    _, sizes = np.unique(array, return_counts=True)
    clusters = sizes[sizes >= 2]
    largest = int(clusters.max()) if len(clusters) else 0
    histogram = [(str(low) if low == high else f"{low}-{high}", int(((sizes >= low) & (sizes <= high)).sum()))
                 for low, high in _size_buckets(int(sizes.max()))]
    return {"images": n, "clusters": len(clusters), "clustered_images": int(clusters.sum()),
            "clustered_share": float(clusters.sum() / n), "singletons": int((sizes == 1).sum()),
            "largest_cluster": largest, "largest_share": largest / n,
            "median_cluster_size": float(np.median(clusters)) if len(clusters) else None,
            "size_histogram": histogram}


def pseudo_label_stability(previous: np.ndarray, current: np.ndarray) -> float:
    """Adjusted Rand index between two labellings [N] of the same images (scikit-learn): 1.0 for the same
    partition whatever the numbers, about 0 for unrelated ones (it can dip below 0)."""
    from sklearn.metrics import adjusted_rand_score

    before = _labels(previous, "previous")
    after = _labels(current, "current", len(before))
    return float(adjusted_rand_score(before, after))


def moved_most(before: np.ndarray, after: np.ndarray, k: int = KEPT_K, count: int = 12) -> dict[str, Any]:
    """How far two embeddings [N, D] and [N, D'] of the same images change each image's neighbours, label-free.

    ``overlap`` [N] float64: the share of each image's k nearest under ``before`` still among its k nearest under
    ``after`` (``compatibility.neighbour_overlap`` on L2-normalised rows, zero rows kept as zero, as training's
    ``kept_neighbours``); ``mean_overlap``: its mean, the report's neighbours-kept figure; ``k``: the k used
    (lowered to N - 1 on fewer images); ``rows`` [count] int64: the images that moved most, lowest overlap first,
    ties by larger cosine change 1 - cos(before_i, after_i) (computed where D == D', else ties by row), then by row;
    ``rows_overlap`` and ``rows_cosine_change`` [count] float64 theirs (NaN where D != D')."""
    from retrieval.utils.unit_rows import l2_normalize_rows

    before, after = _embeddings(before, "before"), _embeddings(after, "after")
    n = len(before)
    if len(after) != n:
        raise ParameterError("after", f"must embed the same {n} images as before, got {len(after)} rows")
    if n < 2:
        raise ParameterError("before", f"needs at least 2 images to have neighbours, got {n}")
    if k < 1 or count < 0:
        raise ParameterError("k", f"must be at least 1 and count at least 0, got k={k}, count={count}")
    k = min(int(k), n - 1)
    overlap = neighbour_overlap(l2_normalize_rows(before, zero_rows="keep"),
                                l2_normalize_rows(after, zero_rows="keep"), k)
    if before.shape[1] == after.shape[1]:  # in float64 from the inputs: an unchanged row changes by 0, not by 1e-7
        a, b = before.astype(np.float64), after.astype(np.float64)
        norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
        change = 1.0 - np.einsum("ij,ij->i", a, b) / np.where(norms > 0, norms, 1.0)
    else:
        change = np.full(n, np.nan)
    tie_break = -np.round(np.nan_to_num(change, nan=0.0), 9)  # changes equal to 1e-9: a tie, by row
    order = np.lexsort((np.arange(n), tie_break, overlap))[: min(int(count), n)]
    return {"k": k, "overlap": overlap, "mean_overlap": float(overlap.mean()), "rows": order.astype(np.int64),
            "rows_overlap": overlap[order], "rows_cosine_change": change[order]}
