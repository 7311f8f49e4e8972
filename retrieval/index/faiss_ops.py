"""faiss index construction, automatic choice, search-parameter tuning, recall, latency, GPU helpers.

Every index is ``IDMap2,<inner>`` with the inner product metric (cosine on unit vectors), so faiss ids
are catalogue ids and the ids an index holds can always be listed (``id_map``).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from retrieval.index.layout import repair_command
from retrieval.io import NotRegularFileError, atomic_write, open_regular

GPU_MAX_K = 2048  # faiss GPU k-selection limit (also for nprobe)
INSTALL_GPU = "pip uninstall faiss-cpu && pip install faiss-gpu (or conda install -c pytorch faiss-gpu)"


@dataclass(frozen=True)
class AutoPolicy:
    """How ``--index-key auto`` chooses and tunes; ``AUTO_POLICY`` by default, another one (e.g. lower sizes in tests)
    is passed as ``policy`` (``IngestOptions.policy`` for the index commands)."""

    flat_max: int = 100_000  # exact search below this many vectors
    hnsw_max: int = 1_000_000  # HNSW up to here (no training, high recall); IVF above (faster to build)
    memory_fraction: float = 0.5  # raw float32 vectors above this share of free memory -> IVF-SQ8/PQ
    target_recall: float = 0.95  # 10-recall@10 against exact search that tuning must reach
    max_train: int = 200_000  # training sample for IVF/PQ
    tune_queries: int = 1_000  # held-out queries for tuning and stats
    # budgets (`index build --max-index-memory --max-query-ms`): the index's estimated RAM, and the p50 time of one
    # query that tuning may spend; None: no such limit
    max_index_memory: int | None = None
    max_query_ms: float | None = None


AUTO_POLICY = AutoPolicy()


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``), falling back to free physical pages."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def ivf_lists(n: int) -> int:
    """About 4 sqrt(n) lists (a power of two), with >= 50 training points per list (faiss' minimum)."""
    target = 2 ** round(math.log2(max(4 * math.sqrt(max(n, 1)), 1)))
    return int(max(1, min(target, 65_536, max(1, n // 50))))


def pq_shape(d: int, n_train: int) -> tuple[int, int]:
    """(m sub-quantizers, bits): 4 dimensions per 8-bit code where d allows; fewer bits for small samples."""
    m = (
        max(divisor for divisor in range(1, d // 2 + 1) if d % divisor == 0 and d // divisor >= 4)
        if d >= 8
        else 1
    )
    bits = int(min(8, max(1, math.floor(math.log2(max(n_train, 2) / 39)))))
    return m, bits


IDMAP2_BYTES_PER_VECTOR = 48  # IndexIDMap2: the id (8 bytes) and its entry in the reverse hash map (~40)


def estimated_index_bytes(key: str, n: int, d: int) -> int:
    """RAM an index of ``n`` vectors of dimension ``d`` takes with faiss key ``key`` (inside our IDMap2): codes,
    list ids, graph links and quantizers, as autofaiss estimates them; within 1 % of faiss' serialised size plus
    the reverse id map for Flat, HNSW and IVF-Flat/SQ8/PQ (tests/test_index_budgets.py)."""
    ids = n * IDMAP2_BYTES_PER_VECTOR
    if key == "Flat":
        return n * d * 4 + ids
    hnsw = re.fullmatch(r"HNSW(\d+)", key)
    if hnsw:  # level 0 has 2M links of 4 bytes, the upper levels about 1 / M of that again
        links = 2 * int(hnsw.group(1)) * 4
        return n * (d * 4 + links + links // int(hnsw.group(1)) + 8) + ids
    ivf = re.fullmatch(r"IVF(\d+),(Flat|SQ8|PQ(\d+)(?:x(\d+))?)", key)
    if ivf:
        lists, code = int(ivf.group(1)), ivf.group(2)
        per_vector = {"Flat": d * 4, "SQ8": d}.get(code) or math.ceil(int(ivf.group(3)) * int(ivf.group(4) or 8) / 8)
        quantizer = lists * d * 4 + (2 ** int(ivf.group(4) or 8) * d * 4 if code.startswith("PQ") else 0)
        return n * (per_vector + 8) + quantizer + ids
    raise ValueError(f"no memory estimate for index key {key!r}; give --index-key auto with --max-index-memory")


def _budget_candidates(n: int, d: int, policy: AutoPolicy) -> list[str]:
    """The keys ``auto`` considers under a memory budget, best recall first."""
    lists = ivf_lists(n)
    keys = (["Flat"] if n <= policy.flat_max else []) + (["HNSW32"] if n <= policy.hnsw_max else [])
    keys += [f"IVF{lists},Flat", f"IVF{lists},SQ8"]
    m, bits = pq_shape(d, min(n, policy.max_train))
    while m >= 1:
        keys.append(f"IVF{lists},PQ{m}x{bits}")
        m = m // 2 if m % 2 == 0 and d % (m // 2 or 1) == 0 else 0
    return keys


def choose_within_memory(n: int, d: int, budget: int, policy: AutoPolicy) -> str:
    """The best key whose estimated RAM fits ``budget`` bytes; ValueError naming the smallest when none does."""
    candidates = _budget_candidates(n, d, policy)
    for key in candidates:
        if estimated_index_bytes(key, n, d) <= budget:
            return key
    smallest = candidates[-1]
    raise ValueError(
        f"--max-index-memory {budget / 2**20:.0f} MiB is too small for {n} vectors of dimension {d}: the smallest "
        f"index ({smallest}) needs about {estimated_index_bytes(smallest, n, d) / 2**20:.0f} MiB (the ids alone "
        f"{n * (IDMAP2_BYTES_PER_VECTOR + 8) / 2**20:.0f} MiB); give a larger budget"
    )


def choose_index_key(
    n: int, d: int, memory_budget: int | None = None, policy: AutoPolicy | None = None
) -> str:
    """Flat for small galleries; HNSW32 or IVF-Flat above; IVF-SQ8, then IVF-PQ, when memory demands. Under an
    explicit budget (``policy.max_index_memory``) the best key whose estimated RAM fits it."""
    policy = policy or AUTO_POLICY
    if policy.max_index_memory is not None:
        return choose_within_memory(n, d, policy.max_index_memory, policy)
    if memory_budget is None:
        memory_budget = int(available_memory() * policy.memory_fraction)
    if n <= policy.flat_max:
        return "Flat"
    if n * d * 4 > memory_budget:
        # 8-bit scalar codes (a quarter of float32) still reach the recall target on the data we tried;
        # PQ codes (d/4 bytes) only when even those do not fit, and then the target may be out of reach.
        if n * d <= memory_budget:
            return f"IVF{ivf_lists(n)},SQ8"
        m, bits = pq_shape(d, min(n, policy.max_train))
        return f"IVF{ivf_lists(n)},PQ{m}x{bits}"
    if n <= policy.hnsw_max:
        return "HNSW32"
    return f"IVF{ivf_lists(n)},Flat"


def expand_key(key: str, n: int, d: int) -> str:
    """Fill the placeholders ``{K}`` (IVF lists) and ``{m}`` (PQ sub-quantizers) of a user key."""
    m, _ = pq_shape(d, n)
    return key.replace("{K}", str(ivf_lists(n))).replace("{m}", str(m))


def new_index(key: str, d: int) -> faiss.Index:
    if key.startswith("IDMap"):
        raise ValueError(f"give the index key without IDMap (it is added for you), got {key!r}")
    try:
        return faiss.index_factory(d, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(
            f"faiss cannot build index key {key!r}: {str(exc).splitlines()[0]}; "
            "use e.g. auto, Flat, HNSW32, IVF1024,Flat, IVF1024,PQ32"
        ) from exc


def inner(index: faiss.Index) -> faiss.Index:
    """The index inside the IDMap2 wrapper, downcast to its concrete class."""
    return faiss.downcast_index(index.index) if hasattr(index, "id_map") else faiss.downcast_index(index)


def index_ids(index: faiss.Index) -> np.ndarray:
    return faiss.vector_to_array(index.id_map).astype(np.int64)


# --- search parameters -----------------------------------------------------------------------------
def _ivf(index: faiss.Index) -> Any | None:
    try:
        return faiss.extract_index_ivf(inner(index))
    except RuntimeError:
        return None


def _refine(index: faiss.Index) -> Any | None:
    core = inner(index)
    return core if isinstance(core, faiss.IndexRefine) else None


def _hnsw(index: faiss.Index) -> Any | None:
    core = inner(index)
    return core if isinstance(core, faiss.IndexHNSW) else None


# index.json's names for search parameters -> faiss ParameterSpace's, where they differ (IndexRefine's k_factor)
FAISS_PARAMETER_NAMES = {"k_factor": "k_factor_rf"}


def set_search_params(index: faiss.Index, params: dict[str, Any]) -> None:
    """Set search-time parameters (nprobe, efSearch, k_factor) with faiss' ``ParameterSpace``, which finds the
    index they belong to inside the IDMap2, Refine and pre-transform wrappers."""
    if not params:
        return
    space = faiss.ParameterSpace()
    for name, value in params.items():
        try:
            space.set_index_parameter(index, FAISS_PARAMETER_NAMES.get(name, name), float(value))
        except RuntimeError as exc:
            raise ValueError(f"search parameter {name!r} does not apply to this index") from exc


def filtered_search_params(index: faiss.Index, selector: faiss.IDSelector, fraction: float) -> Any | None:
    """Search parameters that restrict a search to ``selector``'s ids, with the probing widened by
    ``FILTER_WIDEN`` / fraction (IVF nprobe, HNSW efSearch; ``fraction``: the share of the index selected), so that
    at least as many matching vectors are scanned as an unfiltered search scans; None where faiss cannot filter
    this index type: the caller post-filters then."""
    widen = FILTER_WIDEN / max(fraction, 1e-9)
    ivf, hnsw, refine = _ivf(index), _hnsw(index), _refine(index)
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


def search_param_grid(index: faiss.Index, k: int) -> list[dict[str, Any]]:
    """Candidate settings from cheapest to most expensive."""
    ivf, hnsw = _ivf(index), _hnsw(index)
    if ivf is not None:
        probes = [p for p in (2**i for i in range(17)) if p < ivf.nlist] + [ivf.nlist]
        factors = (1, 2, 4, 8, 16) if _refine(index) is not None else (None,)
        return [{"nprobe": p} | ({"k_factor": f} if f else {}) for f in factors for p in probes]
    if hnsw is not None:
        return [{"efSearch": max(ef, k)} for ef in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    return [{}]


# --- recall and latency ----------------------------------------------------------------------------
def exact_knn(
    queries: np.ndarray, shards: Iterable[tuple[np.ndarray, np.ndarray]], k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product over (ids, vectors) chunks, never holding the whole gallery."""
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    for ids, vectors in shards:
        if len(ids) == 0:
            continue
        scores, positions = faiss.knn(queries, vectors, min(k, len(ids)), metric=faiss.METRIC_INNER_PRODUCT)
        labels = np.where(positions >= 0, ids[np.clip(positions, 0, None)], -1)
        pad = k - scores.shape[1]
        if pad:
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
            labels = np.pad(labels, ((0, 0), (0, pad)), constant_values=-1)
        heap.add_result(np.ascontiguousarray(scores, dtype=np.float32), np.ascontiguousarray(labels))
    heap.finalize()
    return heap.D, heap.I


def recall_at(found: np.ndarray, exact: np.ndarray, n_true: int, r: int) -> float:
    """``n_true``-recall@``r``: share of the exact top ``n_true`` found among the first ``r`` results."""
    truth, got = exact[:, :n_true], found[:, :r]
    hits = [
        len(set(t[t >= 0]) & set(g[g >= 0])) / max(1, int((t >= 0).sum()))
        for t, g in zip(truth, got, strict=True)
    ]
    return float(np.mean(hits)) if hits else float("nan")


def latency_ms(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, repeats: int = 200
) -> dict[str, float]:
    """p50/p99 wall time of single-query searches, in milliseconds."""
    times = []
    for i in range(min(repeats, len(queries))):
        start = time.perf_counter()
        search(queries[i : i + 1])
        times.append((time.perf_counter() - start) * 1e3)
    return {"p50_ms": float(np.percentile(times, 50)), "p99_ms": float(np.percentile(times, 99))}


@dataclass
class Tuning:
    params: dict[str, Any]
    recall_1_at_1: float
    recall_10_at_10: float
    target_met: bool
    latency_ms: float | None = None  # p50 of one query at these params (measured under a --max-query-ms budget)
    latency_met: bool | None = None


def drop_self(ids: np.ndarray, self_ids: np.ndarray | None, k: int) -> np.ndarray:
    """Results without each query's own id (queries taken from the gallery act as held-out queries)."""
    if self_ids is None:
        return ids[:, :k]
    out = np.full((len(ids), k), -1, dtype=np.int64)
    for row, (found, own) in enumerate(zip(ids, self_ids, strict=True)):
        kept = found[found != own][:k]
        out[row, : len(kept)] = kept
    return out


def tune_search_params(
    index: faiss.Index,
    queries: np.ndarray,
    exact_ids: np.ndarray,
    target: float = 0.95,
    k: int = 10,
    self_ids: np.ndarray | None = None,
    max_query_ms: float | None = None,
) -> Tuning:
    """The cheapest setting whose 10-recall@10 against exact search reaches ``target`` (within ``max_query_ms``
    per query when given: ``_tune_within_latency``).

    Parameters are tried from cheapest to most expensive; when none reaches the target the most
    expensive one is kept and ``target_met`` is False. With ``self_ids`` (queries that are gallery
    vectors), each query's own id is dropped from the results, so that they measure like unseen
    queries (``exact_ids`` must be prepared the same way).
    """
    if max_query_ms is not None:
        return _tune_within_latency(index, queries, exact_ids, target, k, self_ids, max_query_ms)
    last = None
    for params in search_param_grid(index, k):
        set_search_params(index, params)
        _, found = index.search(queries, k + (self_ids is not None))
        found = drop_self(found, self_ids, k)
        last = Tuning(params, recall_at(found, exact_ids, 1, 1), recall_at(found, exact_ids, k, k), False)
        if last.recall_10_at_10 >= target:
            last.target_met = True
            return last
    return last


def _tune_within_latency(index: faiss.Index, queries: np.ndarray, exact_ids: np.ndarray, target: float, k: int,
                         self_ids: np.ndarray | None, max_query_ms: float) -> Tuning:
    """Under a latency budget: the cheapest setting reaching ``target`` within ``max_query_ms`` (p50 of single
    queries), else the best recall within it, else (nothing is that fast) the fastest setting, marked unmet."""
    within: list[Tuning] = []
    fastest: Tuning | None = None
    for params in search_param_grid(index, k):
        set_search_params(index, params)
        _, found = index.search(queries, k + (self_ids is not None))
        found = drop_self(found, self_ids, k)
        latency = latency_ms(lambda q: index.search(q, k), queries, repeats=100)["p50_ms"]
        tuning = Tuning(params, recall_at(found, exact_ids, 1, 1), recall_at(found, exact_ids, k, k),
                        False, round(latency, 4), latency <= max_query_ms)
        tuning.target_met = tuning.recall_10_at_10 >= target
        fastest = tuning if fastest is None or latency < fastest.latency_ms else fastest
        if not tuning.latency_met:
            if within and _refine(index) is None:  # one nprobe/efSearch axis: settings only get slower from here
                break
            continue
        within.append(tuning)
        if tuning.target_met:
            break
    chosen = max(within, key=lambda t: (t.target_met, t.recall_10_at_10, -t.latency_ms)) if within else fastest
    set_search_params(index, chosen.params)
    return chosen


# --- files -----------------------------------------------------------------------------------------
# An IVF index merged on disk (the Ray engine's ``merge_ondisk``) keeps its lists in a file beside index.faiss.
ON_DISK_LISTS = "index-*.ivfdata"


def new_lists_file(folder: str | Path) -> Path:
    """A fresh ``index-<time>.ivfdata`` path in ``folder`` (matched by ``ON_DISK_LISTS``), absolute."""
    return Path(folder).resolve() / f"index-{time.time_ns()}.ivfdata"


class DamagedIndexFileError(RuntimeError):
    """An index.faiss whose content does not fit its size or kind: refused before faiss reads it."""


# faiss' index header: fourcc, d (int32), ntotal (int64), two unused int64, is_trained (byte), metric (int32); a
# metric above 1 adds a float argument. Then per kind: IndexFlat's vectors (a count of floats, then the floats);
# IndexIDMap/IDMap2's inner index, then its ids (a count, then int64s).
_HEADER = struct.Struct("<4siqqq?i")
_COUNT = struct.Struct("<Q")
_FLAT = (b"IxFI", b"IxF2", b"IxFl")  # inner product, L2, other metric
_ID_MAPS = (b"IxM2", b"IxMp")


def _header(head: bytes, offset: int, path: Path) -> tuple[bytes, int, int, int]:
    """(fourcc, d, ntotal, the offset after the header) of the index header at ``offset``."""
    if len(head) < offset + _HEADER.size:
        raise DamagedIndexFileError(f"{path} ends inside its header")
    fourcc, d, ntotal, _, _, _, metric = _HEADER.unpack_from(head, offset)
    return fourcc, d, ntotal, offset + _HEADER.size + (4 if metric > 1 else 0)


def check_index_file(path: str | Path) -> None:
    """Refuse (``DamagedIndexFileError``) an index.faiss whose header declares more than its size can hold, before
    faiss reads it: faiss allocates what the file declares first, so a forged count costs that much memory.

    Exact for IndexFlat (alone or in an IDMap/IDMap2); for another index in an IDMap2 a bound: its ids alone take
    8 bytes per vector in this file (IVF lists kept on disk are in another file, the ids are not).
    """
    path = Path(path)
    try:
        handle = open_regular(path)
    except NotRegularFileError as exc:
        raise DamagedIndexFileError(f"{path} is not a regular file") from exc
    except OSError:
        return  # missing or unreadable: faiss says so as it always did (a writer's repair rebuilds on its error)
    with handle:
        size = os.fstat(handle.fileno()).st_size
        head = handle.read(2 * (_HEADER.size + 4) + _COUNT.size)
        fourcc, d, ntotal, at = _header(head, 0, path)
        if d <= 0 or ntotal < 0:
            raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d}")
        ids_at = None
        if fourcc in _ID_MAPS:
            if ntotal * 8 > size:
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors, whose ids alone take "
                                            f"{ntotal * 8} bytes, but the file holds {size} bytes")
            inner_fourcc, inner_d, inner_ntotal, inner_at = _header(head, at, path)
            if (inner_d, inner_ntotal) != (d, ntotal):
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d}, its inner index "
                                            f"{inner_ntotal} of dimension {inner_d}")
            if inner_fourcc not in _FLAT:
                return
            fourcc, at = inner_fourcc, inner_at
            ids_at = at + _COUNT.size + ntotal * d * 4
        if fourcc not in _FLAT:
            return
        expected = at + _COUNT.size + ntotal * d * 4 + (_COUNT.size + ntotal * 8 if ids_at is not None else 0)
        if size != expected:
            raise DamagedIndexFileError(f"{path} declares {ntotal} vectors of dimension {d} ({expected} bytes) "
                                        f"but the file holds {size} bytes")
        counts = [(at, ntotal * d)] + ([(ids_at, ntotal)] if ids_at is not None else [])
        for offset, wanted in counts:
            handle.seek(offset)
            (declared,) = _COUNT.unpack(handle.read(_COUNT.size))
            if declared != wanted:
                raise DamagedIndexFileError(f"{path} declares {ntotal} vectors but one of its arrays {declared} "
                                            f"entries instead of {wanted}")


def read_index(path: str | Path) -> faiss.Index:
    """Read an ``index.faiss``; lists kept on disk are mapped read-only from the file beside it.

    faiss records the lists file by absolute path; ``IO_FLAG_ONDISK_SAME_DIR`` looks for it in the folder of
    ``path`` instead, so that an index folder still opens after it was moved or copied to another machine. A file
    that cannot be the index its header declares is refused first (``check_index_file``), with the fix named.
    """
    path = Path(path).resolve()
    try:
        check_index_file(path)
    except DamagedIndexFileError as exc:
        fix = f"`{repair_command(path.parent)} --rebuild` to rebuild it from the shards"
        raise DamagedIndexFileError(f"{exc}: it is damaged or was not written by this program; run {fix}") from None
    if not any(path.parent.glob(ON_DISK_LISTS)):
        return faiss.read_index(str(path))
    with faiss_prints_to_stderr():
        return faiss.read_index(str(path), faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)


def on_disk_lists(index: faiss.Index) -> Any | None:
    """The ``OnDiskInvertedLists`` of an IVF index whose lists live in a file, else None."""
    ivf = _ivf(index)
    lists = faiss.downcast_InvertedLists(ivf.invlists) if ivf is not None else None
    return lists if isinstance(lists, faiss.OnDiskInvertedLists) else None


def detach_on_disk_lists(index: faiss.Index, folder: Path, keep_entries: bool = True) -> bool:
    """Copy-on-write: give an index with on-disk lists a new lists file in ``folder`` before it is changed.

    The new file holds the old lists' entries (or none, with ``keep_entries`` False: the caller empties the
    index anyway), so changes never touch the file that the current index.faiss names and that searching
    processes map: a crash mid-update leaves the old index whole, and the old file is only deleted once the new
    index.faiss is in place (``write_index_atomic``). False, and nothing done, for lists held in memory.
    """
    old = on_disk_lists(index)
    if old is None:
        return False
    ivf = _ivf(index)
    with faiss_prints_to_stderr():
        new = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(new_lists_file(folder)))
        if keep_entries:
            sources = faiss.InvertedListsPtrVector()
            sources.push_back(old)
            new.merge_from_multiple(sources.data(), sources.size())
    ivf.replace_invlists(new, True)
    new.this.disown()  # the index owns (and frees) it now
    return True


def write_index_atomic(index: faiss.Index, path: Path) -> None:
    """Write index.faiss atomically; lists kept on disk are synced to their file first, and lists files that
    the new index.faiss does not name (replaced by ``detach_on_disk_lists``, or left by a killed build) are
    deleted after it is in place (a process that still maps one keeps reading it until it reopens)."""
    path = Path(path)
    lists = on_disk_lists(index)
    keep = Path(lists.filename).name if lists is not None else None
    if lists is not None:
        with open(lists.filename, "rb+") as handle:  # the mapped pages reach the disk before index.faiss names them
            os.fsync(handle.fileno())
    with faiss_prints_to_stderr():
        atomic_write(path, lambda tmp: faiss.write_index(index, str(tmp)))
    for stale in path.parent.glob(ON_DISK_LISTS):
        if stale.name != keep:
            with contextlib.suppress(OSError):
                stale.unlink()


@contextlib.contextmanager
def faiss_prints_to_stderr() -> Iterator[None]:
    """faiss reports on-disk list work with printf on C's stdout; send it to stderr while this block runs, so
    that stdout stays machine-readable (the CLI prints JSON there)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no C library to flush (not POSIX): leave stdout alone
        yield
        return
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


# --- GPU -------------------------------------------------------------------------------------------
def require_gpu() -> Any:
    """faiss GPU resources, or a clear error saying what is missing."""
    if not hasattr(faiss, "StandardGpuResources"):
        raise RuntimeError(
            f"--gpu needs faiss with GPU support, but this faiss is CPU-only; install it: "
            f"{INSTALL_GPU}, or drop --gpu"
        )
    if faiss.get_num_gpus() < 1:
        raise RuntimeError(
            "--gpu was given but faiss sees no CUDA GPU (faiss.get_num_gpus() == 0); drop --gpu"
        )
    return faiss.StandardGpuResources()


def check_gpu_k(k: int) -> None:
    if k > GPU_MAX_K:
        raise ValueError(f"faiss on GPU returns at most k={GPU_MAX_K} neighbours, asked for k={k}; lower -k")


class GpuSearcher:
    """Searches a CPU ``IDMap2`` index's inner index on the GPU and maps positions back to ids."""

    def __init__(self, index: faiss.Index, resources: Any = None) -> None:
        self.resources = resources or require_gpu()
        self.ids = index_ids(index)
        self.gpu_index = faiss.index_cpu_to_gpu(self.resources, 0, inner(index))

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        check_gpu_k(k)
        scores, positions = self.gpu_index.search(queries, k)
        return scores, np.where(positions >= 0, self.ids[np.clip(positions, 0, None)], -1)


def train_on_gpu(index: faiss.Index, sample: np.ndarray, resources: Any) -> None:
    """Train IVF coarse quantisers with GPU k-means (HNSW and Flat need no training)."""
    ivf = _ivf(index)
    if ivf is not None:
        ivf.clustering_index = faiss.index_cpu_to_gpu(resources, 0, faiss.IndexFlatL2(ivf.d))
    index.train(sample)
