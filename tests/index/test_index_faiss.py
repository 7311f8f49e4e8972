"""faiss side of the index: automatic choice, tuning to the recall target, exact search and recall helpers."""

from __future__ import annotations

import threading

import faiss
import numpy as np
import pytest
from index_builds import clustered_unit_vectors, write_vector_index

from retrieval.index.faiss_backend import faiss_gpu, faiss_keys, faiss_measure, faiss_params
from retrieval.index.faiss_backend.faiss_build import build_faiss
from retrieval.index.search import Index

D = 32


@pytest.fixture
def small_policy():
    """Lowered thresholds so that HNSW, IVF and IVF-PQ are chosen at test sizes (passed to ``build_faiss``)."""
    return faiss_keys.AutoPolicy(flat_max=500, hnsw_max=2_000, tune_queries=200, max_train=20_000)


@pytest.mark.parametrize(
    ("n", "budget", "expected"),
    [
        (400, None, "Flat"),
        (1_500, None, "HNSW32"),
        (6_000, None, "IVF,Flat"),
        (6_000, 6_000 * D * 2, "IVF,SQ8"),
    ],
)
def test_auto_index_reaches_recall_target(tmp_path, small_policy, monkeypatch, n, budget, expected):
    centres = np.random.default_rng(99).standard_normal((64, D))
    gallery = clustered_unit_vectors(n, 0, centres)
    if budget is not None:
        monkeypatch.setattr(faiss_keys, "available_memory", lambda: int(budget / small_policy.memory_fraction))
    layout, catalogue, store = write_vector_index(tmp_path, gallery)
    built = build_faiss(layout, catalogue, store, "auto", D, policy=small_policy)
    key = built["index_key"]
    assert key.replace(str(faiss_keys.ivf_lists(n)), "") == expected
    assert built["tuning"]["target_met"] and built["tuning"]["recall_10_at_10"] >= 0.95
    layout.write_info({"index_key": key, "params": built["params"], "embedding_dim": D, "model_hash": "x"})
    catalogue.close()
    # fresh queries from the same distribution, never seen in tuning: recall against exact search
    queries = clustered_unit_vectors(300, 1, centres)
    exact = np.argsort(-(queries @ gallery.T), axis=1, kind="stable")[:, :10] + 1
    with Index.open(tmp_path) as index:
        _, found = index.search_arrays(queries, 10)
    assert faiss_measure.recall_at(found, exact, 10, 10) >= 0.95
    if "IVF" in key:
        assert 1 <= built["params"]["nprobe"] < faiss_keys.ivf_lists(n)  # tuned, not exhaustive
    if "HNSW" in key:
        assert built["params"]["efSearch"] >= 10


def test_choose_index_key_thresholds():
    big = 10**15
    assert faiss_keys.choose_index_key(100_000, 128, big) == "Flat"
    assert faiss_keys.choose_index_key(100_001, 128, big) == "HNSW32"
    assert faiss_keys.choose_index_key(2_000_000, 128, big) == "IVF4096,Flat"
    assert faiss_keys.choose_index_key(2_000_000, 128, 2_000_000 * 128 * 2) == "IVF4096,SQ8"
    assert faiss_keys.choose_index_key(2_000_000, 128, 2_000_000 * 64) == "IVF4096,PQ32x8np"
    assert faiss_keys.expand_key("IVF{K},PQ{m}", 1_000_000, 96) == "IVF4096,PQ24"
    with pytest.raises(ValueError, match="cannot build index key"):
        faiss_keys.new_index("NotAKey", D)


def test_recall_helper_matches_a_slow_loop():
    rng = np.random.default_rng(0)
    exact = np.stack([rng.permutation(30)[:10] for _ in range(20)])
    found = np.where(rng.random((20, 10)) < 0.3, rng.integers(0, 30, (20, 10)), exact)
    for n_true, r in ((1, 1), (10, 10), (1, 10)):
        slow = []
        for q in range(20):
            hits = sum(1 for t in exact[q, :n_true] if t in list(found[q, :r]))
            slow.append(hits / n_true)
        assert faiss_measure.recall_at(found, exact, n_true, r) == pytest.approx(np.mean(slow))


def test_exact_knn_over_chunks_matches_brute_force():
    rng = np.random.default_rng(3)
    gallery = rng.standard_normal((257, D)).astype(np.float32)
    queries = rng.standard_normal((9, D)).astype(np.float32)
    ids = np.arange(257) * 7 + 5
    chunks = [(ids[s : s + 50], gallery[s : s + 50]) for s in range(0, 257, 50)]
    scores, found = faiss_measure.exact_knn(queries, chunks, 10)
    for q in range(9):
        brute = [float(np.dot(queries[q].astype(np.float64), g)) for g in gallery.astype(np.float64)]
        order = sorted(range(257), key=lambda i: -brute[i])[:10]
        assert found[q].tolist() == [int(ids[i]) for i in order]
        np.testing.assert_allclose(scores[q], [brute[i] for i in order], rtol=1e-4, atol=1e-4)


def test_require_gpu_message():
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        assert faiss_gpu.require_gpu() is not None
        with pytest.raises(ValueError, match="at most k=2048"):
            faiss_gpu.check_gpu_k(4096)
        return
    with pytest.raises(RuntimeError, match="`gpu` "):
        faiss_gpu.require_gpu()


@pytest.mark.parametrize(
    ("key", "cheap", "dear"),
    [
        ("IVF16,Flat", {"nprobe": 1}, {"nprobe": 16}),
        ("HNSW16", {"efSearch": 10}, {"efSearch": 512}),
        ("IVF16,PQ8x4,Refine(Flat)", {"nprobe": 1, "k_factor": 1}, {"nprobe": 16, "k_factor": 8}),
    ],
)
def test_search_params_reach_the_wrapped_index(key, cheap, dear):
    """faiss' ParameterSpace sets nprobe / efSearch / k_factor through the IDMap2 (and Refine) wrappers: read back
    from the index that uses them; the dearer setting finds more of the exact neighbours (so the search used them)."""
    centres = np.random.default_rng(5).standard_normal((16, D))
    gallery = clustered_unit_vectors(2_000, 0, centres)
    queries = clustered_unit_vectors(50, 1, centres)
    index = faiss_keys.new_index(key, D)
    index.train(gallery)
    index.add_with_ids(gallery, np.arange(2_000) + 1)
    exact = np.argsort(-(queries @ gallery.T), axis=1, kind="stable")[:, :10] + 1
    recall = []
    for params in (cheap, dear):
        faiss_params.set_search_params(index, params)
        core = faiss_params.inner(index)
        if "nprobe" in params:
            assert faiss.extract_index_ivf(index).nprobe == params["nprobe"]
        if "efSearch" in params:
            assert core.hnsw.efSearch == params["efSearch"]
        if "k_factor" in params:
            assert core.k_factor == params["k_factor"]
        recall.append(faiss_measure.recall_at(index.search(queries, 10)[1], exact, 10, 10))
    assert recall[0] < recall[1]
    with pytest.raises(ValueError, match="'efSearch' does not apply"):
        faiss_params.set_search_params(faiss_keys.new_index("Flat", D), {"efSearch": 16})


@pytest.mark.parametrize("key", ["Flat", "IVF16,Flat"])
def test_a_gpu_copy_answers_with_catalogue_ids_whether_or_not_the_index_has_an_id_map(key, monkeypatch):
    """The GPU searcher maps an IDMap2's inner positions back to ids, and leaves an IVF index's own ids as they are
    (the copy to the GPU stands in here for a CPU copy: the mapping is what is tested)."""
    centres = np.random.default_rng(5).standard_normal((16, D))
    gallery = clustered_unit_vectors(2_000, 0, centres)
    index = faiss_keys.new_index(key, D)
    index.train(gallery)
    index.add_with_ids(gallery, np.arange(2_000) * 3 + 7)
    faiss_params.set_search_params(index, {"nprobe": 16} if "IVF" in key else {})
    monkeypatch.setattr(faiss, "index_cpu_to_gpu", lambda resources, device, cpu_index: cpu_index, raising=False)
    searcher = faiss_gpu.GpuSearcher(index, resources=object())
    queries = gallery[:20]
    assert np.array_equal(searcher.search(queries, 5)[1], index.search(queries, 5)[1])
    assert np.array_equal(searcher.search(queries, 1)[1].ravel(), np.arange(20) * 3 + 7)


@pytest.mark.parametrize("id_map", [False, True], ids=["ids-in-lists", "idmap2"])
def test_concurrent_first_reconstructions_of_an_ivf_index_all_get_their_vectors(id_map):
    """The first reads of an IVF index's vectors make its direct map; faiss marks the map's type before filling it,
    so a thread that read the type alone could find a half-made map and fail."""
    from retrieval.index.faiss_backend.faiss_search import reconstructed_vectors

    dim, count, threads = 8, 60_000, 16
    vectors = clustered_unit_vectors(count, 3, np.random.default_rng(2).standard_normal((32, dim)))
    ids = np.arange(count, dtype=np.int64) * 7 + 11  # sparse catalogue ids
    failures = 0
    for _ in range(4):
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, 16, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vectors)
        index = faiss.IndexIDMap2(ivf) if id_map else ivf
        index.add_with_ids(vectors, ids)
        wanted = ids[[0, count // 2, count - 1]]
        start = threading.Barrier(threads)
        got: list[object] = []

        def read(index=index, wanted=wanted, start=start, got=got) -> None:
            start.wait()
            try:
                got.append(reconstructed_vectors(index, wanted))
            except Exception as exc:  # noqa: BLE001  (what a failed read raises is the finding)
                got.append(exc)

        workers = [threading.Thread(target=read) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        expected = vectors[[0, count // 2, count - 1]]
        failures += sum(not isinstance(v, np.ndarray) or not np.allclose(v, expected) for v in got)
    assert failures == 0
