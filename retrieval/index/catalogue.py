"""The writer's SQLite catalogue: ``Catalogue``, the one connection that creates the schema (WAL journal) and writes
every change in one transaction: rows planned, outcomes recorded, labels and paths changed, rows removed.

The schema, statuses and meta keys are ``catalogue_schema``'s; the read queries, which ``Catalogue`` shares, and the
read-only ``CatalogueReader`` are ``catalogue_reader``'s. Their names are importable from here too (the writing side
names them all through this module).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrieval.index.catalogue_reader import CatalogueQueries, CatalogueReader
from retrieval.index.catalogue_schema import (
    LAST_RECORDED_SHARD,
    ROW_COLUMNS,
    SCHEMA,
    THROUGHPUT_META,
    UPGRADE_MODEL_PATH,
    Status,
)
from retrieval.index.sources import GalleryItem, ListingError

__all__ = [
    "LAST_RECORDED_SHARD", "ROW_COLUMNS", "SCHEMA", "THROUGHPUT_META", "UPGRADE_MODEL_PATH", "Catalogue",
    "CatalogueQueries", "CatalogueReader", "Outcome", "PlannedRow", "Status",
]


@dataclass(frozen=True)
class Outcome:
    """What happened to one image; written to the catalogue together with its shard."""

    id: int
    status: Status
    sha256: str | None = None
    size: int | None = None
    error: str | None = None
    duplicate_of: int | None = None
    shard: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", Status(self.status))  # shards store the value: read back as a Status


@dataclass(frozen=True)
class PlannedRow:
    """A row planned with an id its caller chose (a build from embeddings: the input's own id, or its position)."""

    id: int
    path: str
    label: str | None = None
    sha256: str | None = None
    size: int | None = None
    extra: dict[str, str | float | int] | None = None  # columns kept for a search's `where`, as a manifest's


class Catalogue(CatalogueQueries):
    """A thin layer over the ``images`` and ``meta`` tables; every write is one transaction."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # isolation_level=None: explicit BEGIN/COMMIT, so a batch of updates is one atomic transaction.
        self.db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")  # a committed shard survives power loss
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Catalogue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for sql, params in statements:
                self.db.execute(sql, params)
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def set_meta(self, **values: str) -> None:
        self._transaction(
            ("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (k, v)) for k, v in values.items()
        )

    def delete_meta(self, *keys: str) -> None:
        self._transaction(("DELETE FROM meta WHERE key = ?", (key,)) for key in keys)

    def forget_shards(self, names: Sequence[str]) -> None:
        """Clear the shard of the rows (not indexed ones: their vector is there) that name one of ``names``,
        before those files are deleted."""
        self._transaction(("UPDATE images SET shard = NULL WHERE shard = ? AND status != ?", (name, Status.DONE))
                          for name in names)

    # --- planning
    def plan(
        self, items: Sequence[GalleryItem], source: str | None = None, errors: Sequence[ListingError] = ()
    ) -> int:
        """Insert the images not yet catalogued as ``pending``, all in one transaction; returns how many.

        A path already present keeps its row (and id), so planning twice is harmless; a ``removed``
        path that is added again goes back to ``pending``. With a ``source`` (``Gallery.source``), the same
        transaction replaces that source's listing errors by ``errors`` (a folder made readable drops its).
        """
        if errors and source is None:
            raise ValueError("listing errors are kept per source: give the source they were found in")
        before = self.db.total_changes
        self._transaction(
            [
                (
                    "INSERT OR IGNORE INTO images(path, label, status) VALUES (?, ?, ?)",
                    (i.path, i.label, Status.PENDING),
                )
                for i in items
            ]
            + [
                (
                    "UPDATE images SET status=?, error=NULL, duplicate_of=NULL, shard=NULL "
                    "WHERE path = ? AND status = ?",
                    (Status.PENDING, i.path, Status.REMOVED),
                )
                for i in items
            ]
            + [
                (
                    "INSERT OR IGNORE INTO metadata(id, data) SELECT id, ? FROM images WHERE path = ?",
                    (json.dumps(i.extra, ensure_ascii=False), i.path),
                )
                for i in items
                if i.extra
            ]
            + ([("DELETE FROM listing_errors WHERE source = ?", (source,))] if source is not None else [])
            + [
                (
                    "INSERT OR REPLACE INTO listing_errors(source, path, error) VALUES (?, ?, ?)",
                    (source, e.path, e.error),
                )
                for e in errors
            ]
        )
        return self.db.total_changes - before

    def plan_rows(self, rows: Iterable[PlannedRow], meta: Mapping[str, str]) -> int:
        """Insert ``rows`` as ``pending`` under their own ids, and the ``meta`` values that record them, in ONE
        transaction; returns how many rows. ``rows`` is consumed as the transaction goes (a generator keeps memory
        bounded). An id or path catalogued already (sqlite3.IntegrityError), or any error ``rows`` raises, rolls
        the whole plan back: the rows are planned all together, with their record, or not at all."""
        planned = 0

        def statements() -> Iterable[tuple[str, Sequence[Any]]]:
            nonlocal planned
            for row in rows:
                yield ("INSERT INTO images(id, path, label, sha256, size, status) VALUES (?, ?, ?, ?, ?, ?)",
                       (int(row.id), row.path, row.label, row.sha256, row.size, Status.PENDING))
                if row.extra:
                    yield ("INSERT OR REPLACE INTO metadata(id, data) VALUES (?, ?)",
                           (int(row.id), json.dumps(row.extra, ensure_ascii=False)))
                planned += 1
            for key, value in meta.items():
                yield "INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (key, value)

        self._transaction(statements())
        return planned

    # --- outcomes
    def record(self, outcomes: Iterable[Outcome]) -> None:
        """Write the outcomes of one shard (done, error, duplicate) in one transaction.

        The same transaction remembers the newest shard recorded, so that after a crash only shards newer
        than it are taken as unrecorded (an old shard whose rows were removed and re-added is not).
        """
        outcomes = list(outcomes)
        shards = [o.shard for o in outcomes if o.shard]
        statements = [
            (
                "UPDATE images SET status=?, sha256=?, size=?, error=?, duplicate_of=?, shard=? WHERE id=?",
                (o.status, o.sha256, o.size, o.error, o.duplicate_of, o.shard, o.id),
            )
            for o in outcomes
        ]
        if shards:  # shard names are zero-padded: string order is shard order
            newest = max(max(shards), self.last_recorded_shard())
            statements.append(
                ("INSERT OR REPLACE INTO meta(key, value) VALUES (?, ?)", (LAST_RECORDED_SHARD, newest))
            )
        self._transaction(statements)

    def set_labels(self, labels: Sequence[tuple[str, str | None]]) -> int:
        """Set the label of each catalogued ``(path, label)``, in one transaction; returns how many changed."""
        before = self.db.total_changes
        self._transaction(("UPDATE images SET label=? WHERE path=? AND label IS NOT ?", (label, path, label))
                          for path, label in labels)
        return self.db.total_changes - before

    def rebase_paths(self, old_root: str, new_root: str) -> int:
        """Every catalogued path under ``old_root`` put under ``new_root`` instead (the gallery moved), in one
        transaction; returns how many. A path that is catalogued under ``new_root`` already: ValueError, nothing
        changed."""
        old, new = old_root.rstrip("/") + "/", new_root.rstrip("/") + "/"
        # the paths that start with ``old`` sort in [old, old with its '/' raised to '0'): exact (no LIKE, which
        # ignores case) and read through the path's own index
        sql = "UPDATE images SET path = ? || substr(path, ?) WHERE path >= ? AND path < ?"
        before = self.db.total_changes
        try:
            self._transaction([(sql, (new, len(old) + 1, old, old[:-1] + "0"))])
        except sqlite3.IntegrityError as exc:
            raise ValueError(f"the catalogue's images under {old_root} cannot move to {new_root}: some of them are "
                             f"catalogued there already (added from there before?); remove those (retrieval index "
                             "remove), or give the gallery's own folder") from exc
        return self.db.total_changes - before

    def mark_removed(self, ids: Sequence[int]) -> None:
        self._transaction(
            ("UPDATE images SET status=? WHERE id=? AND status=?", (Status.REMOVED, int(i), Status.DONE))
            for i in ids
        )
