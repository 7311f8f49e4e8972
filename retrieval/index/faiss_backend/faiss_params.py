"""What an index is made of and how it is searched: the index inside the ``IDMap2`` wrapper (where there is one),
its ids (and whether they are the catalogue's indexed rows: ``faiss_mismatch``), and its search-time parameters
(``nprobe``, ``efSearch``, ``k_factor``), how they are set and which values tuning tries.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import faiss
import numpy as np


def inner(index: faiss.Index) -> faiss.Index:
    """The index inside the IDMap2 wrapper (the index itself where there is none), downcast to its concrete class."""
    return faiss.downcast_index(index.index) if has_id_map(index) else faiss.downcast_index(index)


def has_id_map(index: faiss.Index) -> bool:
    """True when ``index`` is an ``IDMap``/``IDMap2`` wrapper (its inner index counts positions, the map holds the
    catalogue ids); False for an IVF index that keeps the ids in its lists (``faiss_keys.new_index``)."""
    return hasattr(index, "id_map")


def index_ids(index: faiss.Index) -> np.ndarray:
    """The catalogue ids an index holds, in its internal order (int64): the IDMap2's map, or an IVF's lists."""
    if has_id_map(index):
        return faiss.vector_to_array(index.id_map).astype(np.int64)
    ivf = ivf_of(index)
    if ivf is None:
        raise ValueError(f"a {type(inner(index)).__name__} without an id map holds no catalogue ids")
    lists, parts = ivf.invlists, []
    for number in range(ivf.nlist):
        size = lists.list_size(number)
        if size:
            pointer = lists.get_ids(number)
            parts.append(faiss.rev_swig_ptr(pointer, size).astype(np.int64))  # a copy, before the release
            lists.release_ids(number, pointer)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def faiss_mismatch(index: faiss.Index, done: Mapping[int, str]) -> str | None:
    """How the ids in faiss differ from the catalogue's ``done`` rows, or None when they agree."""
    present = np.sort(index_ids(index))
    expected = np.fromiter(sorted(done), np.int64, len(done))
    if np.array_equal(present, expected):
        return None
    lacking, extra = len(np.setdiff1d(expected, present)), len(np.setdiff1d(present, expected))
    return (
        f"its faiss part holds {len(present)} vectors but the catalogue has {len(expected)} indexed images "
        f"({lacking} missing from faiss, {extra} not indexed in the catalogue)"
    )


def ivf_of(index: faiss.Index) -> Any | None:
    """The IVF index inside ``index`` (also under Refine or a pre-transform), or None for other kinds."""
    try:
        return faiss.extract_index_ivf(inner(index))
    except RuntimeError:
        return None


def refine_of(index: faiss.Index) -> Any | None:
    """The ``IndexRefine`` inside the IDMap2 wrapper, or None."""
    core = inner(index)
    return core if isinstance(core, faiss.IndexRefine) else None


def hnsw_of(index: faiss.Index) -> Any | None:
    """The ``IndexHNSW`` inside the IDMap2 wrapper, or None."""
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


def search_param_grid(index: faiss.Index, k: int) -> list[dict[str, Any]]:
    """Candidate settings from cheapest to most expensive (what ``faiss_tuning`` tries)."""
    ivf, hnsw = ivf_of(index), hnsw_of(index)
    if ivf is not None:
        probes = [p for p in (2**i for i in range(17)) if p < ivf.nlist] + [ivf.nlist]
        factors = (1, 2, 4, 8, 16) if refine_of(index) is not None else (None,)
        return [{"nprobe": p} | ({"k_factor": f} if f else {}) for f in factors for p in probes]
    if hnsw is not None:
        return [{"efSearch": max(ef, k)} for ef in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    return [{}]
