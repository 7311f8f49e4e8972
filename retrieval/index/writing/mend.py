"""Mending, the first steps of every writer: record the shards a crash left unrecorded, and give every ``done``
row a shard that holds its vector (step 3 of the writer's resumability, see ``writer``).
"""

from __future__ import annotations

from retrieval.index.catalogue import Catalogue, Outcome, Status
from retrieval.index.shards import ShardStore


def reconcile(catalogue: Catalogue, store: ShardStore) -> int:
    """Record the outcomes of shards written before a crash but not yet marked; returns how many rows."""
    last = catalogue.last_recorded_shard()
    fixed = 0
    for name in store.names():
        if name <= last:  # recorded (its rows may since have been removed and re-added: not stale news)
            continue
        shard = store.read(name)
        statuses = catalogue.status_of([o.id for o in shard.outcomes])
        todo = [o for o in shard.outcomes if statuses.get(o.id) == Status.PENDING]
        catalogue.record(todo)
        fixed += len(todo)
    return fixed


def missing_vectors(catalogue: Catalogue, store: ShardStore) -> set[int]:
    """Ids of ``done`` rows whose vector is not in the shard the catalogue names (reads only the ids)."""
    done = catalogue.done_shards()
    missing = set(done)
    for name in store.names():
        if missing:
            missing.difference_update(i for i in store.read_ids(name).tolist() if done.get(i) == name)
    return missing


def mend_done_rows(catalogue: Catalogue, store: ShardStore) -> dict[str, int]:
    """Give every ``done`` row a shard holding its vector: re-point it to another shard that holds the
    same image (same sha256), else send it back to ``pending`` to be embedded again.

    Two writers at once could overwrite each other's shards (same next name) and leave rows so.
    """
    missing = missing_vectors(catalogue, store)
    if not missing:
        return {"repointed": 0, "requeued": 0}
    rows = catalogue.rows(sorted(missing))
    found: dict[int, str] = {}
    for name in reversed(store.names()):  # newest first
        shard = store.read(name)
        held = set(shard.ids.tolist())
        for o in shard.outcomes:
            if o.id in missing and o.id not in found and o.status == Status.DONE and o.id in held:
                if o.sha256 is not None and o.sha256 == rows[o.id]["sha256"]:
                    found[o.id] = name
    repointed = [
        Outcome(i, Status.DONE, rows[i]["sha256"], rows[i]["size"], shard=name) for i, name in sorted(found.items())
    ]
    requeued = [Outcome(i, Status.PENDING) for i in sorted(missing - found.keys())]
    catalogue.record(repointed + requeued)
    return {"repointed": len(repointed), "requeued": len(requeued)}


def mend(catalogue: Catalogue, store: ShardStore) -> dict[str, int]:
    """Steps every writer runs first: record unrecorded shards, then check each done row's vector."""
    return {"reconciled": reconcile(catalogue, store), **mend_done_rows(catalogue, store)}
