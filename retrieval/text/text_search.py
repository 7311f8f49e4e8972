"""The one answer to text queries, for `retrieval search --text` and the server's text queries alike: the vector
candidates (the texts embedded by the index's text model, searched as embeddings are) and the keyword hits of the
catalogue's own text (``retrieval.text.keywords``), fused into one ranked list (``retrieval.text.fusion``), each
hit saying its ``source``. An index with keywords and no text model answers by keywords alone; one with a text model
and no keywords, by vectors alone. Read side: no writer, no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from retrieval.index.filters import Filter
from retrieval.index.search import MAX_K, SearchResult, check_k
from retrieval.index.searchable.contract import SearchableIndex
from retrieval.rerank import RerankConfig
from retrieval.text.fusion import KEYWORD, VECTOR, FusionParams, fuse
from retrieval.text.keywords import NO_HITS, KeywordHits, KeywordSearch

FUSION = FusionParams()  # the measured defaults (benchmarks/keyword_fusion.py)
MIN_POOL = 50  # candidates each side fetches at least: a keyword hit can rise from below the top k


def candidate_pool(k: int) -> int:
    """How many candidates each side (vectors, keywords) fetches for a top-``k`` answer."""
    return min(MAX_K, max(3 * k, MIN_POOL))


def search_text(index: SearchableIndex, texts: Sequence[str], k: int, vectors: np.ndarray | None = None,
                keywords: KeywordSearch | None = None, where: str | Filter | None = None,
                rerank: RerankConfig | None = None, params: FusionParams = FUSION) -> list[list[SearchResult]]:
    """Each text's top ``k`` results, best first, with ``source`` set: ``vectors`` [n, d] are the texts embedded by
    the index's text model (None: it has none), ``keywords`` the index's keyword search (None: none). ``index`` is
    a folder's or a collection's (``SearchableIndex``): its ``search`` gives the vector candidates (``where`` and
    ``rerank`` as there); keyword hits outside ``where``, or no longer indexed, are left out. Results' paths are
    the catalogue's (the caller shows them as it shows any result)."""
    k = check_k(k)
    if vectors is None and keywords is None:
        raise ValueError("a text query needs the index's text model or its keyword index; it has neither")
    pool = candidate_pool(k)
    found = index.search(vectors, pool, where=where, rerank=rerank) if vectors is not None else [[]] * len(texts)
    selected = None if where is None or keywords is None else index.matching_ids(where)
    answers = []
    for position, (text, candidates) in enumerate(zip(texts, found, strict=True)):
        hits = keywords.search(text, pool, selected) if keywords is not None else NO_HITS
        query = None if vectors is None else vectors[position]
        answers.append(_fused(index, candidates, hits, query, k, params))
    return answers


def _fused(index: SearchableIndex, candidates: list[SearchResult], hits: KeywordHits, query: np.ndarray | None, k: int,
           params: FusionParams) -> list[SearchResult]:
    """One query's vector candidates and keyword hits as its top ``k`` (``fuse``), keyword hits' rows read."""
    rows = index.indexed_rows(hits.ids.tolist()) if len(hits.ids) else {}
    keep = np.asarray([int(i) in rows for i in hits.ids.tolist()], dtype=bool)
    hits = KeywordHits(hits.ids[keep], hits.scores[keep], hits.matched[keep])
    by_id = {r.id: r for r in candidates}
    cosines = _cosines(index, query, hits.ids, by_id)
    order = np.asarray([r.score for r in candidates], dtype=np.float64)
    if any(r.rerank_score is not None for r in candidates):  # the re-ranking's order, on the cosines' scale
        order = np.sort(order)[::-1]
    fused = fuse(np.asarray([r.id for r in candidates], np.int64), order, hits.ids, hits.scores, hits.matched,
                 params, keyword_cosines=cosines, limit=k)
    results = []
    for image_id, score, cosine, source in zip(fused.ids.tolist(), fused.scores.tolist(), fused.cosines.tolist(),
                                               fused.sources, strict=True):
        if source != KEYWORD:
            results.append(dataclasses.replace(by_id[image_id], source=source))
            continue
        row = rows[image_id]
        # score: its cosine with the query where a text model embedded it, else its keyword relevance in [0, 1]
        shown = cosine if query is not None and np.isfinite(cosine) else score
        results.append(SearchResult(image_id, row["path"], row["label"], float(shown), source=KEYWORD))
    return _with_columns(index, results)


def _cosines(index: SearchableIndex, query: np.ndarray | None, ids: np.ndarray,
             known: dict[int, SearchResult]) -> np.ndarray:
    """The cosine of each keyword hit with the query: the vector candidates', else measured among those ids alone
    (``Index.search_selected``: exact for a small selection); NaN where unknown."""
    cosines = np.asarray([known[i].score if i in known else np.nan for i in ids.tolist()], dtype=np.float64)
    missing = np.sort(ids[np.isnan(cosines)])
    if query is None or not len(missing):
        return cosines
    scores, found = index.search_selected(np.asarray(query, np.float32)[None], len(missing), missing)
    measured = {int(i): float(s) for s, i in zip(scores[0].tolist(), found[0].tolist(), strict=True) if i >= 0}
    return np.asarray([measured.get(int(i), c) if np.isnan(c) else c for i, c in zip(ids.tolist(), cosines.tolist(),
                                                                                    strict=True)])


def _with_columns(index: SearchableIndex, results: list[SearchResult]) -> list[SearchResult]:
    """The keyword hits' display columns, as the vector search gives its own (where the index shows columns)."""
    extra = [r for r in results if r.source == KEYWORD and r.columns is None]
    if not extra:
        return results
    filled = {r.id: r for r in index.with_columns([extra])[0]}
    return [filled.get(r.id, r) if r.source == KEYWORD else r for r in results]


def sources_summary(results: Sequence[SearchResult]) -> dict[str, int]:
    """How many results came from each source (``vector``, ``keyword``, ``both``)."""
    counts: dict[str, int] = {}
    for result in results:
        counts[result.source or VECTOR] = counts.get(result.source or VECTOR, 0) + 1
    return counts
