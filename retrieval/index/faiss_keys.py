"""Choosing and building a faiss index: ``--index-key auto`` and its policy, memory estimates, the index factory.

Every index is ``IDMap2,<key>`` with the inner product metric (cosine on unit vectors), so faiss ids are catalogue
ids and the ids an index holds can always be listed (``faiss_params.index_ids``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import faiss

from retrieval.errors import ParameterError


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
    the reverse id map for Flat, HNSW and IVF-Flat/SQ8/PQ (tests/index/test_index_budgets.py)."""
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
    raise ValueError(f"no memory estimate for index key {key!r}; give `index_key` auto with `max_index_memory`")


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
    raise ParameterError(
        "max_index_memory", f"{budget / 2**20:.0f} MiB is too small for {n} vectors of dimension {d}: the smallest "
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
    """An empty ``IDMap2,<key>`` inner-product index of dimension ``d``; ValueError for a key faiss refuses."""
    if key.startswith("IDMap"):
        raise ValueError(f"give the index key without IDMap (it is added for you), got {key!r}")
    try:
        return faiss.index_factory(d, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(
            f"faiss cannot build index key {key!r}: {str(exc).splitlines()[0]}; "
            "use e.g. auto, Flat, HNSW32, IVF1024,Flat, IVF1024,PQ32"
        ) from exc
