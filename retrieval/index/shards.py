"""Embedding shards: ``shards/shard-NNNNNN.npz`` files holding catalogue ids, vectors and outcomes.

A shard is written to a temporary file, fsynced and renamed into place (``os.replace`` is atomic), so
a shard file is either complete or absent. Besides the vectors it carries the outcomes of its batch
(sha256, size, errors, duplicates) so that a shard written just before a crash, but not yet recorded in
the catalogue, can be reconciled without decoding its images again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.index.catalogue import Outcome
from retrieval.io import TEMPORARY_GLOB, atomic_write, fsync_dir

SHARD_PATTERN = re.compile(r"^shard-(\d{6,})\.npz$")


@dataclass
class Shard:
    name: str
    ids: np.ndarray  # int64 [n] catalogue ids of the vectors
    vectors: np.ndarray  # float32 [n, d], L2-normalised
    outcomes: list[Outcome]  # done rows (with sha256, size) and the batch's errors and duplicates


class ShardStore:
    def __init__(self, folder: str | Path, read_only: bool = False) -> None:
        """The shards in ``folder``; a writer's store (the default) creates it and deletes interrupted writes."""
        self.folder = Path(folder)
        if read_only:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(TEMPORARY_GLOB):  # a write interrupted before its rename
            stale.unlink(missing_ok=True)

    def names(self) -> list[str]:
        return sorted(p.name for p in self.folder.iterdir() if SHARD_PATTERN.match(p.name))

    def next_name(self) -> str:
        numbers = [int(SHARD_PATTERN.match(n).group(1)) for n in self.names()]
        return f"shard-{(max(numbers) + 1 if numbers else 0):06d}.npz"

    def write(self, ids: np.ndarray, vectors: np.ndarray, outcomes: list[Outcome]) -> str:
        """Write one shard atomically and return its name."""
        import io

        name = self.next_name()
        records = [o.__dict__ | {"shard": name} for o in outcomes]
        buffer = io.BytesIO()
        np.savez(
            buffer,
            ids=np.asarray(ids, dtype=np.int64),
            vectors=np.asarray(vectors, dtype=np.float32),
            outcomes=np.array(json.dumps(records)),
        )
        atomic_write(self.folder / name, buffer.getvalue())
        return name

    def read(self, name: str, with_outcomes: bool = True) -> Shard:
        with np.load(self.folder / name, allow_pickle=False) as data:
            outcomes = [Outcome(**r) for r in json.loads(str(data["outcomes"]))] if with_outcomes else []
            return Shard(name, data["ids"], data["vectors"], outcomes)

    def read_ids(self, name: str) -> np.ndarray:
        """The catalogue ids a shard holds vectors for (without loading the vectors)."""
        with np.load(self.folder / name, allow_pickle=False) as data:
            return data["ids"]

    def __iter__(self) -> Iterator[Shard]:
        for name in self.names():
            yield self.read(name, with_outcomes=False)
