"""Choosing and building a faiss index: ``--index-key auto`` and its policy, memory estimates, the index factory.

Every index uses the inner product metric (cosine on unit vectors) and faiss ids are catalogue ids. An IVF index
(alone or behind an OPQ rotation) keeps them in its lists, 8 bytes a vector; any other kind (Flat, HNSW, Refine) is
wrapped in ``IDMap2``, which adds the id and a reverse map (48 bytes a vector). Either way the ids an index holds can
be listed (``faiss_params.index_ids``).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import faiss

from retrieval.errors import ParameterError
from retrieval.utils.sizes import size_text


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
LIST_ID_BYTES = 8  # an IVF list keeps each vector's id beside its code

# The keys the budgets consider and estimate: [OPQ{m}[_{D}],]IVF{lists}[_HNSW{M}],{Flat|SQ8|SQ6|SQ4|PQ{m}[x{bits}][np]}
_IVF_KEY = re.compile(r"(?:OPQ(\d+)(?:_(\d+))?,)?IVF(\d+)(?:_HNSW(\d+))?,(Flat|SQ8|SQ6|SQ4|PQ(\d+)(?:x(\d+))?(?:np)?)")
_SQ_BITS = {"SQ8": 8, "SQ6": 6, "SQ4": 4}


def keeps_ids_in_lists(index: faiss.Index) -> bool:
    """True for an index that keeps catalogue ids itself: an IVF index, alone or behind pre-transforms (an OPQ
    rotation); ``new_index`` builds these without the ``IDMap2`` wrapper."""
    core = faiss.downcast_index(index)
    if isinstance(core, faiss.IndexPreTransform):
        core = faiss.downcast_index(core.index)
    return isinstance(core, faiss.IndexIVF)


def _hnsw_bytes(count: int, d: int, m: int) -> int:
    """An HNSW graph over ``count`` float vectors: level 0 has 2M links of 4 bytes, the upper levels about 1 / M of
    that again, plus a level entry and an offset per vector."""
    links = 2 * m * 4
    return count * (d * 4 + links + links // m + 8)


def estimated_index_bytes(key: str, n: int, d: int) -> int:
    """RAM an index of ``n`` vectors of dimension ``d`` takes with faiss key ``key``: codes, ids (in IVF lists, else
    in our IDMap2 with its reverse map), graph links, quantizers and rotations, as autofaiss estimates them; within
    1 % of faiss' serialised size (plus the reverse id map of IDMap2) for Flat, HNSW and the IVF keys of
    ``_IVF_KEY`` (tests/index/test_index_budgets.py)."""
    ids = n * IDMAP2_BYTES_PER_VECTOR
    if key == "Flat":
        return n * d * 4 + ids
    hnsw = re.fullmatch(r"HNSW(\d+)", key)
    if hnsw:
        return _hnsw_bytes(n, d, int(hnsw.group(1))) + ids
    ivf = _IVF_KEY.fullmatch(key)
    if ivf:
        opq_m, opq_d, lists, quantizer_m, code, pq_m, pq_bits = ivf.groups()
        rotated = int(opq_d or d) if opq_m else d
        rotation = rotated * d * 4 if opq_m else 0
        lists = int(lists)
        quantizer = _hnsw_bytes(lists, rotated, int(quantizer_m)) if quantizer_m else lists * rotated * 4
        if code == "Flat":
            per_vector, trained = rotated * 4, 0
        elif code in _SQ_BITS:
            per_vector, trained = math.ceil(rotated * _SQ_BITS[code] / 8), 2 * rotated * 4
        else:
            bits = int(pq_bits or 8)
            per_vector, trained = math.ceil(int(pq_m) * bits / 8), 2**bits * rotated * 4
        return n * (per_vector + LIST_ID_BYTES) + quantizer + rotation + trained
    raise ValueError(f"no memory estimate for index key {key!r}; give `index_key` auto with `max_index_memory`")


def pq_key(lists: int, m: int, bits: int) -> str:
    """An IVF-PQ key without polysemous training ("np"): that training orders the codes for a Hamming pre-filter
    that search never turns on, and it took 40x the rest of the training (docs/BENCHMARKS.md, "Tight memory
    budgets")."""
    return f"IVF{lists},PQ{m}x{bits}np"


def _budget_candidates(n: int, d: int, policy: AutoPolicy) -> list[str]:
    """The keys ``auto`` considers under a memory budget, largest first; each one measured better recall than the
    next (docs/BENCHMARKS.md, "Tight memory budgets"): 8- and 6-bit scalar codes, then product codes from 2
    dimensions a byte, each number of sub-quantizers with 8 down to 5 bits a code before it is halved (4-bit scalar
    codes lose to product codes of the same size)."""
    lists = ivf_lists(n)
    keys = (["Flat"] if n <= policy.flat_max else []) + (["HNSW32"] if n <= policy.hnsw_max else [])
    keys += [f"IVF{lists},Flat", f"IVF{lists},SQ8", f"IVF{lists},SQ6"]
    _, most_bits = pq_shape(d, min(n, policy.max_train))
    m = max(divisor for divisor in range(1, d // 2 + 1) if d % divisor == 0) if d >= 2 else 1
    while m >= 1:
        keys += [pq_key(lists, m, bits) for bits in range(most_bits, max(most_bits - 4, 0), -1)]
        m = m // 2 if m % 2 == 0 else 0
    return keys


def choose_within_memory(n: int, d: int, budget: int, policy: AutoPolicy) -> str:
    """The best key whose estimated RAM fits ``budget`` bytes; ValueError naming the smallest when none does."""
    candidates = _budget_candidates(n, d, policy)
    for key in candidates:
        if estimated_index_bytes(key, n, d) <= budget:
            return key
    smallest = candidates[-1]
    raise ParameterError(
        "max_index_memory", f"{size_text(budget)} is too small for {n} vectors of dimension {d}: the smallest "
        f"index ({smallest}) needs about {size_text(estimated_index_bytes(smallest, n, d))} (the ids alone "
        f"{size_text(n * LIST_ID_BYTES)}); give a larger budget"
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
        return pq_key(ivf_lists(n), m, bits)
    if n <= policy.hnsw_max:
        return "HNSW32"
    return f"IVF{ivf_lists(n)},Flat"


def expand_key(key: str, n: int, d: int) -> str:
    """Fill the placeholders ``{K}`` (IVF lists) and ``{m}`` (PQ sub-quantizers) of a user key."""
    m, _ = pq_shape(d, n)
    return key.replace("{K}", str(ivf_lists(n))).replace("{m}", str(m))


def new_index(key: str, d: int) -> faiss.Index:
    """An empty inner-product index of dimension ``d`` whose ids are catalogue ids: ``key`` itself for an IVF key
    (``keeps_ids_in_lists``), else ``IDMap2,<key>``; ValueError for a key faiss refuses."""
    if key.startswith("IDMap"):
        raise ValueError(f"give the index key without IDMap (it is added for you), got {key!r}")
    try:
        index = faiss.index_factory(d, key, faiss.METRIC_INNER_PRODUCT)
        if keeps_ids_in_lists(index):
            return index
        return faiss.index_factory(d, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        raise ValueError(
            f"faiss cannot build index key {key!r}: {str(exc).splitlines()[0]}; "
            "use e.g. auto, Flat, HNSW32, IVF1024,Flat, IVF1024,PQ32"
        ) from exc
