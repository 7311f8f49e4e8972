"""Filtered search: a query restricted to a selection of ids (``Index.search(..., where=)``).

A small selection is scored exactly from the vectors an index stores uncompressed (``stored_vectors``,
``exact_among``); otherwise faiss' ``IDSelector`` restricts the search, probing widened by the selection's share
(``filtered_search_params``); index types faiss cannot filter are searched unfiltered and post-filtered
(``post_filtered_search``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import faiss
import numpy as np

from retrieval.index.faiss_backend.faiss_params import has_id_map, hnsw_of, inner, ivf_of, refine_of

_DIRECT_MAPS = threading.Lock()  # an IVF index gets its direct map once, whichever thread asks first


def filtered_search_params(index: faiss.Index, selector: faiss.IDSelector, fraction: float) -> Any | None:
    """Search parameters that restrict a search to ``selector``'s ids, with the probing widened by
    ``FILTER_WIDEN`` / fraction (IVF nprobe, HNSW efSearch; ``fraction``: the share of the index selected), so that
    at least as many matching vectors are scanned as an unfiltered search scans; None where faiss cannot filter
    this index type: the caller post-filters then."""
    widen = FILTER_WIDEN / max(fraction, 1e-9)
    ivf, hnsw, refine = ivf_of(index), hnsw_of(index), refine_of(index)
    nprobe = int(min(ivf.nlist, math.ceil(ivf.nprobe * widen))) if ivf is not None else 0
    if refine is not None:
        # the selector goes to the base index (the refine step re-ranks what it returns); IDMap2 translates only
        # the outer params' selector to its internal positions, so this one is translated here
        translated = faiss.IDSelectorTranslated(index.id_map, selector)
        base = faiss.SearchParametersIVF(sel=translated, nprobe=nprobe) if ivf is not None else \
            faiss.SearchParameters(sel=translated)
        params = faiss.IndexRefineSearchParameters(k_factor=refine.k_factor, base_index_params=base)
        params.referenced_objects = [base, translated, selector]  # SWIG keeps only pointers to them
        return params
    if ivf is not None:
        return faiss.SearchParametersIVF(sel=selector, nprobe=nprobe)
    if hnsw is not None:
        ef = int(min(MAX_FILTERED_EF, math.ceil(hnsw.hnsw.efSearch * widen)))
        return faiss.SearchParametersHNSW(sel=selector, efSearch=ef)
    if isinstance(inner(index), faiss.IndexFlat):
        return faiss.SearchParameters(sel=selector)
    return None


MAX_FILTERED_EF = 4096  # HNSW's widened efSearch under a filter stops here
# Twice the probes of an unfiltered search per matching vector: a filter that follows the picture (a label) puts
# the query's filtered neighbours in lists farther away; at 1 / share, recall@10 was 0.971 on 1M vectors with 10 %
# of the clusters selected, 0.992 at 2 / share (docs/BENCHMARKS.md, "Filtered search")
FILTER_WIDEN = 2.0


MAX_POST_FILTER_FETCH = 16_384  # results one post-filtered query fetches at most (memory and sort per request)
# A selection this small is scored exactly from the vectors an index stores uncompressed (Flat, HNSW-Flat): 8,192
# rows of 512 floats are 16 MiB, and HNSW's widened efSearch (capped) loses recall below about 1 % of the index
EXACT_SELECTION_MAX = 8_192


def stored_vectors(index: faiss.Index, ids: np.ndarray) -> np.ndarray | None:
    """The float32 vectors [n, d] an index stores for ``ids`` where it keeps them exactly (Flat, HNSW-Flat); None
    for one that compresses them or keeps them in lists (IVF, PQ, SQ)."""
    if not isinstance(inner(index), (faiss.IndexFlat, faiss.IndexHNSWFlat)):
        return None
    return index.reconstruct_batch(np.ascontiguousarray(ids, dtype=np.int64))


class NoStoredVectors(ValueError):
    """The index cannot give back the vectors of its results (re-ranking reads them)."""


def reconstructed_vectors(index: faiss.Index, ids: np.ndarray) -> np.ndarray:
    """The vectors [n, d] faiss holds for ``ids`` (all of them held): stored exactly (Flat, HNSW-Flat), else decoded
    from an IVF index's lists through a direct map made on first use (8 bytes a vector inside IDMap2, about 40 for
    an IVF index keeping catalogue ids; exact for IVF-Flat, for SQ and PQ the codes' approximation, which is what
    their search scores). A ValueError names an index type that cannot give them back (``NoStoredVectors``)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    vectors = stored_vectors(index, ids)
    if vectors is not None:
        return vectors
    ivf = ivf_of(index)
    if ivf is not None:
        # read the map's type under the lock only: faiss sets it before it fills the map (DirectMap::set_type),
        # so a thread that saw the type alone could read a half-made map
        with _DIRECT_MAPS:
            if ivf.direct_map.type == faiss.DirectMap.NoMap:
                # inside IDMap2 the list ids are positions 0..n-1 (an array); catalogue ids kept in the lists are
                # sparse (a hash table, about 40 bytes a vector, made on first use)
                ivf.set_direct_map_type(faiss.DirectMap.Array if has_id_map(index) else faiss.DirectMap.Hashtable)
    try:
        return index.reconstruct_batch(ids)
    except RuntimeError as exc:
        raise NoStoredVectors(f"this index ({type(inner(index)).__name__}) cannot give back the vectors of its "
                              "results, which re-ranking reads; rebuild it (`retrieval index build`) with the "
                              "index key Flat, HNSW32 or IVF...,Flat, or search without re-ranking") from exc


def exact_among(queries: np.ndarray, vectors: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Inner-product top-k of each query among ``vectors`` (whose ids are ``ids``), best first: scores float32
    [q, min(k, n)], ids int64."""
    scores = queries @ vectors.T
    k = min(k, len(ids))
    top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    top_scores = np.take_along_axis(scores, top, 1)
    order = np.argsort(-top_scores, axis=1, kind="stable")
    return np.take_along_axis(top_scores, order, 1).astype(np.float32), ids[np.take_along_axis(top, order, 1)]


def post_filtered_search(index: faiss.Index, queries: np.ndarray, k: int, selected: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Top-k among the ``selected`` ids (sorted int64) by over-fetching: the unfiltered top 2k / share + k (at
    most ``MAX_POST_FILTER_FETCH``), of which the selected ones are kept in score order (ids -1 and scores -inf
    where fewer were found). For index types faiss cannot filter; it misses matches an unfiltered search does not
    reach (docs/BENCHMARKS.md, "Filtered search")."""
    fraction = len(selected) / max(index.ntotal, 1)
    fetch = int(min(index.ntotal, MAX_POST_FILTER_FETCH, math.ceil(2 * k / max(fraction, 1e-9)) + k))
    scores, ids = index.search(queries, fetch)
    keep = np.isin(ids, selected)
    order = np.argsort(~keep, axis=1, kind="stable")[:, :k]  # the kept ones first, in score order
    scores = np.take_along_axis(np.where(keep, scores, -np.inf), order, 1).astype(np.float32)
    return scores, np.take_along_axis(np.where(keep, ids, -1), order, 1)
