"""Clustering of embeddings and its quality: faiss k-means, NMI and pair-counting F1 against the class labels.

``retrieval.metrics.evaluate``'s "nmi" and "f1" come from ``clustering_metrics``: k-means (faiss, seeded, k-means++
where faiss has it) with as many clusters as the set has classes, on the rows it is given (the caller passes the
space its similarity ranks in: normalised rows for cosine). Everything here runs on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from retrieval.metrics.inputs import as_embeddings, as_label_array

SMALL_KMEANS_WORK = 10**7  # n * clusters * dim below which k-means runs on one thread


def kmeans_assign(embeddings: Any, num_clusters: int, niter: int = 50, seed: int = 0) -> np.ndarray:
    """Cluster index per row from faiss k-means (k-means++ init, all points used for training, fixed seed)."""
    import faiss

    x = np.ascontiguousarray(as_embeddings(embeddings, "embeddings").numpy(), dtype=np.float32)
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

    true_arr = as_label_array(true_labels, len(np.asarray(true_labels)), "true_labels")
    cluster_arr = as_label_array(cluster_labels, len(true_arr), "cluster_labels")
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


def clustering_metrics(
    space_query: torch.Tensor, query_codes: np.ndarray, want: set[str], niter: int, seed: int
) -> dict[str, float]:
    """The metrics of ``want`` among "nmi" and "f1" of ``space_query`` [n, d] clustered by k-means into as many
    clusters as ``query_codes`` [n] (int class codes) has classes."""
    from sklearn.metrics import normalized_mutual_info_score  # the train extra: imported when used

    num_classes = len(np.unique(query_codes))
    clusters = kmeans_assign(space_query, num_classes, niter=niter, seed=seed)
    out: dict[str, float] = {}
    if "nmi" in want:
        out["nmi"] = float(normalized_mutual_info_score(query_codes, clusters))
    if "f1" in want:
        out["f1"] = pair_f1(query_codes, clusters)
    return out
