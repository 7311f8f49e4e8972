"""Embedding shards: ``shards/shard-NNNNNN.npz`` (local engine) or ``shard-NNNNNN.parquet`` (Ray engine)
files holding catalogue ids, vectors and outcomes; one store reads both, numbered in one sequence.

A parquet shard has one row per image of its batch: ``id``, ``path``, ``status``, ``sha256``, ``size``,
``error``, ``duplicate_of`` and ``embedding`` (float32 [d], null unless the row is ``done``); it needs
``pyarrow`` (installed with Ray: ``pip install "ray[data]>=2.40"``).

A shard is written to a temporary file, fsynced and renamed into place (``os.replace`` is atomic), so
a shard file is either complete or absent. Besides the vectors it carries the outcomes of its batch
(sha256, size, errors, duplicates) so that a shard written just before a crash, but not yet recorded in
the catalogue, can be reconciled without decoding its images again.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from retrieval.index.catalogue import Outcome
from retrieval.utils.io import TEMPORARY_GLOB, atomic_write

SHARD_PATTERN = re.compile(r"^shard-(\d{6,})\.(npz|parquet)$")
OUTCOME_COLUMNS = ("id", "status", "sha256", "size", "error", "duplicate_of")


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

    def next_name(self, suffix: str = "npz") -> str:
        numbers = [int(SHARD_PATTERN.match(n).group(1)) for n in self.names()]
        return f"shard-{(max(numbers) + 1 if numbers else 0):06d}.{suffix}"

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

    def write_parquet(
        self,
        ids: np.ndarray,
        vectors: np.ndarray,
        outcomes: list[Outcome],
        paths: Mapping[int, str],
        metadata: Mapping[str, str] | None = None,
    ) -> str:
        """Write one parquet shard atomically (``vectors[i]`` belongs to ``ids[i]``), ``metadata`` in its schema
        (informational: readers ignore it); return its name."""
        pa, pq = _pyarrow()
        name = self.next_name("parquet")
        vectors = np.asarray(vectors, dtype=np.float32)
        row_of = {int(i): row for row, i in enumerate(np.asarray(ids).tolist())}
        embedding = pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), vectors.shape[1])
        take = pa.array([row_of.get(o.id) for o in outcomes], pa.int64())  # null: no vector for that row
        columns = {c: [getattr(o, c) for o in outcomes] for c in OUTCOME_COLUMNS}
        table = pa.table(
            {
                "id": pa.array(columns["id"], pa.int64()),
                "path": pa.array([paths[o.id] for o in outcomes], pa.string()),
                **{c: pa.array(columns[c], pa.string()) for c in ("status", "sha256", "error")},
                **{c: pa.array(columns[c], pa.int64()) for c in ("size", "duplicate_of")},
                "embedding": embedding.take(take),
            }
        )
        if metadata:
            table = table.replace_schema_metadata(dict(metadata))
        buffer = pa.BufferOutputStream()
        pq.write_table(table, buffer)
        atomic_write(self.folder / name, buffer.getvalue().to_pybytes())
        return name

    def _read_parquet(self, name: str, with_outcomes: bool) -> Shard:
        _, pq = _pyarrow()
        columns = ["id", "embedding"] + (list(OUTCOME_COLUMNS[1:]) if with_outcomes else [])
        table = pq.read_table(self.folder / name, columns=columns)
        embedding = table.column("embedding").combine_chunks()
        held = embedding.is_valid().to_numpy(zero_copy_only=False)
        ids = table.column("id").to_numpy()[held].astype(np.int64)
        valid = embedding.filter(embedding.is_valid())
        d = embedding.type.list_size
        vectors = np.asarray(valid.values.to_numpy(zero_copy_only=False), np.float32).reshape(len(ids), d)
        outcomes = []
        if with_outcomes:
            rows = table.drop_columns(["embedding"]).to_pylist()
            outcomes = [Outcome(**row, shard=name) for row in rows]
        return Shard(name, ids, vectors, outcomes)

    def read(self, name: str, with_outcomes: bool = True) -> Shard:
        if name.endswith(".parquet"):
            return self._read_parquet(name, with_outcomes)
        with np.load(self.folder / name, allow_pickle=False) as data:
            outcomes = [Outcome(**r) for r in json.loads(str(data["outcomes"]))] if with_outcomes else []
            return Shard(name, data["ids"], data["vectors"], outcomes)

    def read_ids(self, name: str) -> np.ndarray:
        """The catalogue ids a shard holds vectors for (without loading the vectors)."""
        if name.endswith(".parquet"):
            return self._read_parquet(name, with_outcomes=False).ids
        with np.load(self.folder / name, allow_pickle=False) as data:
            return data["ids"]

    def __iter__(self) -> Iterator[Shard]:
        for name in self.names():
            yield self.read(name, with_outcomes=False)


def _pyarrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            'parquet shards (written by the ray engine) need pyarrow: pip install "ray[data]>=2.40"'
        ) from exc
    return pa, pq
