"""Budgets: `index build --max-index-memory SIZE --max-query-ms MS` picks the index type by
its estimated RAM and its search settings by measured time per query, and `index stats` says what it chose."""

from __future__ import annotations

import json
import re

import faiss
import numpy as np
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import load_models_as
from PIL import Image

from retrieval.index.faiss_backend import faiss_keys, faiss_measure, faiss_params, faiss_tuning

N, D = 20_000, 64


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("key", ["Flat", "HNSW32", "IVF128,Flat", "IVF128,SQ8", "IVF128,SQ6", "IVF128,SQ4",
                                 "IVF128,PQ16x4", "IVF128_HNSW16,PQ16x8np", "OPQ8_96,IVF128_HNSW32,PQ8np"])
def test_the_memory_estimate_matches_what_faiss_stores(vectors, key):
    """faiss' serialised index (codes, ids, links, quantizers, rotations), plus IDMap2's reverse map of ~40 bytes per
    id where there is an IDMap2: an IVF index keeps the ids in its lists instead."""
    index = faiss_keys.new_index(key, D)
    if not index.is_trained:
        index.train(vectors[:2_000])  # enough for the sizes; training OPQ on all of them takes minutes
    index.add_with_ids(vectors, np.arange(N, dtype=np.int64))
    wrapped = key in ("Flat", "HNSW32")
    assert faiss_params.has_id_map(index) == wrapped
    stored = len(faiss.serialize_index(index)) + (40 * N if wrapped else 0)
    assert faiss_keys.estimated_index_bytes(key, N, D) == pytest.approx(stored, rel=0.01)


def test_a_shrinking_budget_walks_down_from_exact_to_compressed_codes():
    policy = faiss_keys.AutoPolicy(flat_max=N, hnsw_max=N)
    budgets = np.geomspace(10**8, 3.5 * 10**5, 60).astype(int)
    chosen = [faiss_keys.choose_within_memory(N, D, int(budget), policy) for budget in budgets]
    sizes = [faiss_keys.estimated_index_bytes(key, N, D) for key in chosen]
    assert all(size <= budget for size, budget in zip(sizes, budgets, strict=True))
    assert sizes == sorted(sizes, reverse=True)  # a smaller budget never takes a larger index
    kinds = list(dict.fromkeys(key.split(",")[-1] if "," in key else key for key in chosen))
    assert kinds[0] == "Flat" and "SQ8" in kinds and "PQ32x5np" in kinds and kinds[-1].startswith("PQ")
    with pytest.raises(ValueError, match="max_index_memory 256 KiB is too small for 20000 vectors"):
        faiss_keys.choose_within_memory(N, D, 2**18, policy)
    policy = faiss_keys.AutoPolicy(max_index_memory=int(budgets[-1]))
    assert faiss_keys.choose_index_key(N, D, policy=policy) == chosen[-1]


def test_tuning_under_a_latency_budget_keeps_within_it_or_says_it_cannot(vectors, monkeypatch):
    index = faiss_keys.new_index("IVF256,Flat", D)
    index.train(vectors)
    index.add_with_ids(vectors, np.arange(N, dtype=np.int64))
    # a query's time grows with the lists it scans, as it does on a quiet machine (measured times on a shared one
    # are noise at these sizes)
    ivf = faiss_params.ivf_of(index)
    monkeypatch.setattr(faiss_tuning, "latency_ms", lambda search, queries, repeats: {"p50_ms": 0.01 * ivf.nprobe})
    queries = vectors[:200] + 0.01
    _, exact = faiss_measure.exact_knn(queries, [(np.arange(N, dtype=np.int64), vectors)], 10)
    plain = faiss_tuning.tune_search_params(index, queries, exact, 0.95)
    generous = faiss_tuning.tune_search_params(index, queries, exact, 0.95, max_query_ms=1e6)
    assert generous.params == plain.params and generous.latency_met and generous.target_met
    impossible = faiss_tuning.tune_search_params(index, queries, exact, 0.95, max_query_ms=1e-9)
    assert impossible.latency_met is False and impossible.params == {"nprobe": 1}  # the fastest setting
    tight = faiss_tuning.tune_search_params(index, queries, exact, 1.0, max_query_ms=generous.latency_ms * 3)
    assert tight.latency_met and tight.latency_ms <= generous.latency_ms * 3


def test_the_command_line_builds_under_budgets_and_stats_says_what_it_chose(tmp_path, monkeypatch):
    from retrieval.cli.main import main

    rng = np.random.default_rng(0)
    for i in range(60):
        (tmp_path / "g" / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(tmp_path / "g" / f"c{i % 3}/{i}.png")
    load_models_as(monkeypatch, lambda path, providers="auto": FakeEmbedder())
    result = CliRunner().invoke(main, ["index", "build", "--model", "m.onnx", "--images", str(tmp_path / "g"),
                                       "--out", str(tmp_path / "idx"), "--workers", "0", "--max-index-memory",
                                       "100K", "--max-query-ms", "50"])
    assert result.exit_code == 0, result.output
    assert re.search(r"about \d+(\.\d+)? KiB of --max-index-memory 100 KiB", result.output), result.output
    assert "within --max-query-ms 50" in result.output
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    budget = info["budget"]
    assert budget["max_index_memory"] == 100 * 1024 and budget["estimated_bytes"] <= 100 * 1024
    assert budget["memory_met"] and budget["latency_met"] and budget["latency_ms"] <= 50
    stats = CliRunner().invoke(main, ["index", "stats", str(tmp_path / "idx"), "--json"])
    assert json.loads(stats.output[stats.output.index("{"):])["budget"] == budget
    for bad, message in (("4X", "is not a size"), ("-1G", "is not a size")):
        refused = CliRunner().invoke(main, ["index", "build", "--model", "m.onnx", "--images", str(tmp_path / "g"),
                                            "--out", str(tmp_path / "other"), "--max-index-memory", bad])
        assert refused.exit_code == 2 and message in refused.output
    over = CliRunner().invoke(main, ["index", "build", "--model", "m.onnx", "--images", str(tmp_path / "g"),
                                     "--out", str(tmp_path / "flat"), "--workers", "0", "--index-key", "Flat",
                                     "--max-index-memory", "1K"])
    assert over.exit_code == 1 and "--index-key Flat needs about" in over.output and "--index-key auto" in over.output


def test_a_tight_budget_spends_its_bytes_on_codes_not_on_an_id_map():
    """500,000 x 128 in 40 MiB: an IVF index keeps its ids in its lists (8 bytes a vector, no IDMap2 at 48), which
    leaves room for 64-byte product codes (2 dimensions a byte) where the wrapper left 16."""
    n, d, budget = 500_000, 128, 40 * 2**20
    key = faiss_keys.choose_within_memory(n, d, budget, faiss_keys.AUTO_POLICY)
    assert key == "IVF2048,PQ64x8np"
    assert n * 72 < faiss_keys.estimated_index_bytes(key, n, d) <= budget
    assert faiss_params.has_id_map(faiss_keys.new_index(key, d)) is False
    # between two numbers of sub-quantizers, fewer bits a code: 20 MiB takes 28-byte codes, not 16-byte ones
    assert faiss_keys.choose_within_memory(n, d, 20 * 2**20, faiss_keys.AUTO_POLICY) == "IVF2048,PQ32x7np"
