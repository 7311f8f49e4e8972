"""How two embedders relate, measured and said plainly: backward compatibility (BCT's three blocks) and, without
labels, how much one changes each image's neighbours. Torch-free on import: the app reads reports with it; the
metrics are computed by ``retrieval.metrics`` and the neighbours by faiss, imported when used."""

from __future__ import annotations

from typing import Any

import numpy as np

from retrieval.errors import ParameterError

# the metrics BCT's empirical criterion compares: M(new queries, old gallery) >= M(old queries, old gallery)
COMPATIBILITY_METRICS = ("recall@1", "map@r")
# label-free: the mean share of an image's top-KEPT_K neighbours that a model keeps from another's (a training
# run's --eval-extra sets: from the pretrained backbone's; WiSE-FT's curve: from the start's)
KEPT_K = 10
KEPT = f"neighbours_kept@{KEPT_K}"


def compatibility_metrics(new_query: np.ndarray, old_query: np.ndarray, query_labels: np.ndarray,
                          new_gallery: np.ndarray | None = None, old_gallery: np.ndarray | None = None,
                          gallery_labels: np.ndarray | None = None,
                          cross_query: np.ndarray | None = None) -> dict[str, Any]:
    """Backward compatibility of a new embedder with an old one (Shen et al., BCT, CVPR 2020, sec. 3): ``new``
    (new queries, new gallery), ``old`` (old, old), ``cross_model`` (new queries against the gallery the old model
    embedded) and ``compatible``, BCT's criterion: cross_model >= old on each of ``COMPATIBILITY_METRICS``.

    ``cross_query``: the new queries as they meet the old gallery, for a new model of another embedding size (its
    projection into the old space, ``retrieval.models.in_compatible_space``); default ``new_query``. ``new``
    stays on the new model's own embeddings.

    Without a separate gallery each image is a query against the others (leave-one-out); in ``cross_model`` the
    query's own old embedding is left out too (``same_items``)."""
    from retrieval.metrics import evaluate

    ks = tuple(k for k in (1, 2, 4, 8) if k < len(query_labels)) or (1,)
    names = ["recall", "map@r", "r_precision"]
    if (new_gallery is None) != (old_gallery is None):
        raise ParameterError("old_gallery", "must be given with new_gallery (or neither, for leave-one-out)")
    cross_query = new_query if cross_query is None else cross_query
    if np.shape(cross_query)[-1] != np.shape(old_query)[-1]:
        raise ParameterError("cross_query", f"the new model's queries have {np.shape(cross_query)[-1]} dimensions, "
                                            f"the old model's {np.shape(old_query)[-1]}: embeddings of two sizes "
                                            "cannot be compared; a new size needs a model trained compatible with "
                                            "the old one, which learns a projection into its space")
    if new_gallery is None:
        new = evaluate(new_query, query_labels, ks=ks, metrics=names)
        old = evaluate(old_query, query_labels, ks=ks, metrics=names)
        cross = evaluate(cross_query, query_labels, old_query, query_labels, ks=ks, metrics=names, same_items=True)
    else:
        new = evaluate(new_query, query_labels, new_gallery, gallery_labels, ks=ks, metrics=names)
        old = evaluate(old_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
        cross = evaluate(cross_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
    compatible = all(cross[name] >= old[name] for name in COMPATIBILITY_METRICS)
    return {"new": new, "old": old, "cross_model": cross, "compatible": compatible}


def compatibility_sentence(blocks: dict[str, Any]) -> str:
    """BCT's criterion said plainly, with the numbers it compares."""
    cross, old = blocks["cross_model"], blocks["old"]
    compared = ", ".join(f"{name} {cross[name]:.3f} {'>=' if cross[name] >= old[name] else '<'} {old[name]:.3f}"
                         for name in COMPATIBILITY_METRICS)
    if blocks["compatible"]:
        return (f"compatible: new queries find the old gallery's images at least as well as old queries do "
                f"(cross-model vs old/old: {compared}); the index need not be re-embedded before the new model "
                "serves it")
    return (f"not compatible: new queries find the old gallery's images worse than old queries do (cross-model vs "
            f"old/old: {compared}); re-embed the gallery with the new model before it serves")


def top_k(vectors: np.ndarray, k: int) -> np.ndarray:
    """Exact top-``k`` neighbours [n, k] of each unit row among the others (itself left out), by inner product."""
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    _, found = index.search(np.ascontiguousarray(vectors, dtype=np.float32), k + 1)
    rows = np.arange(len(vectors))[:, None]
    kept = np.where(found == rows, -1, found)  # itself, wherever ties put it
    return np.stack([row[row >= 0][:k] for row in kept])


def neighbour_overlap(first: np.ndarray, second: np.ndarray, k: int = 10) -> np.ndarray:
    """Per row i: the share of i's ``k`` nearest rows under ``first`` that are among its ``k`` nearest under
    ``second`` (rows: the same images, embedded two ways; unit vectors). float64 [n] in [0, 1]."""
    if len(first) != len(second):
        raise ParameterError("second", f"must embed the same {len(first)} images as first, got {len(second)} rows")
    if not 1 <= k < len(first):
        raise ParameterError("k", f"must be between 1 and {len(first) - 1} (the images less one), got {k}")
    a, b = top_k(first, k), top_k(second, k)
    return np.asarray([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b, strict=True)])
