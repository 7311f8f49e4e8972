"""Backward compatibility of a new embedder with an old one, measured and said plainly (torch-free on import: the
app reads reports with it; the metrics are computed by ``retrieval.metrics``, imported when used)."""

from __future__ import annotations

from typing import Any

import numpy as np

from retrieval.errors import ParameterError

# the metrics BCT's empirical criterion compares: M(new queries, old gallery) >= M(old queries, old gallery)
COMPATIBILITY_METRICS = ("recall@1", "map@r")


def compatibility_metrics(new_query: np.ndarray, old_query: np.ndarray, query_labels: np.ndarray,
                          new_gallery: np.ndarray | None = None, old_gallery: np.ndarray | None = None,
                          gallery_labels: np.ndarray | None = None) -> dict[str, Any]:
    """Backward compatibility of a new embedder with an old one (Shen et al., BCT, CVPR 2020, sec. 3): ``new``
    (new queries, new gallery), ``old`` (old, old), ``cross_model`` (new queries against the gallery the old model
    embedded) and ``compatible``, BCT's criterion: cross_model >= old on each of ``COMPATIBILITY_METRICS``.

    Without a separate gallery each image is a query against the others (leave-one-out); in ``cross_model`` the
    query's own old embedding is left out too (``same_items``)."""
    from retrieval.metrics import evaluate

    ks = tuple(k for k in (1, 2, 4, 8) if k < len(query_labels)) or (1,)
    names = ["recall", "map@r", "r_precision"]
    if (new_gallery is None) != (old_gallery is None):
        raise ParameterError("old_gallery", "must be given with new_gallery (or neither, for leave-one-out)")
    if new_gallery is None:
        new = evaluate(new_query, query_labels, ks=ks, metrics=names)
        old = evaluate(old_query, query_labels, ks=ks, metrics=names)
        cross = evaluate(new_query, query_labels, old_query, query_labels, ks=ks, metrics=names, same_items=True)
    else:
        new = evaluate(new_query, query_labels, new_gallery, gallery_labels, ks=ks, metrics=names)
        old = evaluate(old_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
        cross = evaluate(new_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
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
