"""The fusion of a text query's vector hits and keyword hits: the same list as a slow, obvious reference written
here (random cases), the gate (a keyword match below ``min_matched`` moves nothing; no keyword hit leaves the vector
order as it was), each hit's source, keywords alone, and plain RRF."""

from __future__ import annotations

import math

import numpy as np
import pytest

from retrieval.text.fusion import FusionParams, fuse, reciprocal_rank_fusion


def reference(vector_ids, vector_scores, keyword_ids, keyword_scores, matched, params, cosines, limit):
    """The module docstring's formula, one hit at a time."""
    vector = {}
    for i, s in zip(vector_ids, vector_scores, strict=True):
        if i >= 0 and i not in vector:
            vector[i] = s
    if not vector:
        top = max([max(s, 0.0) for s in keyword_scores], default=0.0)
        rel = [(m * (max(s, 0.0) / top if top > 0 else 1.0), i) for i, s, m in zip(keyword_ids, keyword_scores,
                                                                                  matched, strict=True)]
        order = sorted(range(len(rel)), key=lambda n: (-rel[n][0], n))[:limit]
        return [rel[n][1] for n in order], ["keyword"] * len(order)
    top = max([max(s, 0.0) for s in keyword_scores], default=0.0)
    floor = min(vector.values())
    entries = []  # (fused, tie order, id, source)
    real = {}
    for i, s, m in zip(keyword_ids, keyword_scores, matched, strict=True):
        if m >= params.min_matched - 1e-9:
            real[i] = max(real.get(i, 0.0), m * (max(s, 0.0) / top if top > 0 else 1.0))
    for n, (i, s) in enumerate(vector.items()):
        entries.append((s + params.keyword_weight * real.get(i, 0.0), n, i, "both" if i in real else "vector"))
    extra = len(vector)
    for n, i in enumerate(keyword_ids):
        if i in real and i not in vector and all(e[2] != i for e in entries):
            c = cosines[n] if cosines is not None and not math.isnan(cosines[n]) else floor
            entries.append((c + params.keyword_weight * real[i], extra + n, i, "keyword"))
    entries.sort(key=lambda e: (-e[0], e[1]))
    entries = entries[:limit]
    return [e[2] for e in entries], [e[3] for e in entries]


@pytest.mark.parametrize("seed", range(40))
def test_fusion_matches_the_slow_reference(seed):
    rng = np.random.default_rng(seed)
    nv, nk = rng.integers(0, 30), rng.integers(0, 20)
    vector_ids = rng.choice(60, nv, replace=False)
    vector_scores = np.sort(rng.uniform(-0.2, 0.9, nv))[::-1]
    keyword_ids = rng.choice(60, nk, replace=False)
    keyword_scores = np.sort(rng.uniform(0.1, 12, nk))[::-1]
    matched = rng.choice([0.25, 1 / 3, 0.5, 2 / 3, 1.0], nk)
    cosines = np.where(rng.random(nk) < 0.5, rng.uniform(-0.2, 0.9, nk), np.nan) if seed % 2 else None
    params = FusionParams(keyword_weight=float(rng.choice([0.0, 0.05, 0.2, 1.0])),
                          min_matched=float(rng.choice([0.3, 0.5, 1.0])))
    limit = int(rng.integers(1, 40))
    if nv == 0 and nk == 0:
        return
    got = fuse(vector_ids, vector_scores, keyword_ids, keyword_scores, matched, params, cosines, limit)
    ids, sources = reference(vector_ids.tolist(), vector_scores.tolist(), keyword_ids.tolist(),
                             keyword_scores.tolist(), matched.tolist(), params,
                             None if cosines is None else cosines.tolist(), limit)
    assert got.ids.tolist() == ids and got.sources == sources


def test_no_keyword_hit_leaves_the_vector_order_as_it_is():
    ids, scores = np.array([5, 3, 9]), np.array([0.8, 0.7, 0.1])
    fused = fuse(ids, scores, np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
    assert fused.ids.tolist() == [5, 3, 9] and fused.sources == ["vector"] * 3
    assert fused.scores.tolist() == pytest.approx([0.8, 0.7, 0.1])


def test_a_weak_keyword_match_moves_nothing_and_a_real_one_rises():
    ids, scores = np.array([5, 3, 9]), np.array([0.8, 0.75, 0.7])
    weak = fuse(ids, scores, np.array([9, 42]), np.array([10.0, 9.0]), np.array([0.25, 0.25]),
                FusionParams(keyword_weight=0.2, min_matched=0.5))
    assert weak.ids.tolist() == [5, 3, 9] and weak.sources == ["vector"] * 3
    real = fuse(ids, scores, np.array([9, 42]), np.array([10.0, 9.0]), np.array([1.0, 1.0]),
                FusionParams(keyword_weight=0.2, min_matched=0.5))
    assert real.ids.tolist()[0] == 9 and real.sources[0] == "both"
    assert "keyword" in real.sources and real.ids.tolist().index(42) == real.sources.index("keyword")


def test_keywords_alone_rank_by_relevance():
    fused = fuse(np.zeros(0, np.int64), np.zeros(0), np.array([1, 2, 3]), np.array([4.0, 8.0, 2.0]),
                 np.array([1.0, 0.5, 1.0]))
    assert fused.ids.tolist() == [1, 2, 3]  # 1 and 2 equally relevant: the keyword order
    assert fused.scores.tolist() == pytest.approx([0.5, 0.5, 0.25])
    assert fused.sources == ["keyword"] * 3 and np.isnan(fused.cosines).all()


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError, match="keyword_weight"):
        FusionParams(keyword_weight=-1)
    with pytest.raises(ValueError, match="min_matched"):
        FusionParams(min_matched=0)


def test_reciprocal_rank_fusion_sums_reciprocal_ranks():
    fused = reciprocal_rank_fusion(np.array([1, 2, 3]), np.array([3, 4]), k=60)
    # 3: 1/63 + 1/61; 1: 1/61; 2: 1/62; 4: 1/62
    assert fused.tolist() == [3, 1, 2, 4]


def test_keyword_hits_alone_keep_the_cosines_they_were_given():
    fused = fuse(np.zeros(0, np.int64), np.zeros(0), np.asarray([4, 7]), np.asarray([2.0, 1.0]),
                       np.asarray([1.0, 1.0]), keyword_cosines=np.asarray([0.31, 0.42]))
    assert fused.ids.tolist() == [4, 7] and fused.cosines.tolist() == [0.31, 0.42]


def test_a_re_ranked_text_answer_keeps_the_re_ranking_order():
    from retrieval.index.search import SearchResult
    from retrieval.text.keywords import NO_HITS
    from retrieval.text.text_search import FUSION, _fused

    # the re-ranking put the lower cosines first: with no keyword hit, its order is the answer's
    candidates = [SearchResult(i, f"{i}.png", None, score, rerank_score=10.0 - n)
                  for n, (i, score) in enumerate([(3, 0.2), (1, 0.9), (2, 0.5)])]
    answer = _fused(object(), candidates, NO_HITS, np.zeros(4, np.float32), 3, FUSION)
    assert [r.id for r in answer] == [3, 1, 2] and [r.score for r in answer] == [0.2, 0.9, 0.5]
