"""The indexed vectors as the catalogue sees them, read from the shards (``faiss_params.faiss_mismatch`` checks
that faiss holds the same ids).

Read side: the writer builds faiss from these, and ``index stats``, the diagnostics and the tests read them, so
this module imports neither the writer nor torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from retrieval.index.shards import ShardStore

Chunks = Iterable[tuple[np.ndarray, np.ndarray]]  # (ids, vectors) pairs, e.g. one per shard


def done_chunks(store: ShardStore, done: Mapping[int, str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, vectors) of the ``done`` rows (id -> shard, from ``Catalogue.done_shards``), shard by shard.

    Each vector is read from the shard the catalogue names: an image removed and added again also has an
    older vector in an older shard, which must not come back.
    """
    for shard in store:
        mask = np.fromiter((done.get(int(i)) == shard.name for i in shard.ids), bool, len(shard.ids))
        if mask.any():
            yield shard.ids[mask], np.ascontiguousarray(shard.vectors[mask])


def gather_rows(
    store: ShardStore, done: Mapping[int, str], positions: np.ndarray, with_ids: bool = False
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The vectors (and ids) at global ``positions`` (in shard order over the done rows)."""
    wanted = np.sort(positions)
    out, out_ids, offset = [], [], 0
    for ids, vectors in done_chunks(store, done):
        local = wanted[(wanted >= offset) & (wanted < offset + len(ids))] - offset
        out.append(vectors[local])
        out_ids.append(ids[local])
        offset += len(ids)
    vectors = np.ascontiguousarray(np.concatenate(out))
    return (vectors, np.concatenate(out_ids)) if with_ids else vectors

