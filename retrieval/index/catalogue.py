"""The SQLite catalogue: one row per gallery image, with its processing status.

Statuses: ``pending`` (planned, not yet embedded), ``done`` (its vector is in a shard and counts as
indexed), ``error`` (unreadable; ``error`` says why), ``duplicate`` (same sha256 as ``duplicate_of``),
``removed`` (taken out with ``retrieval index remove``). The catalogue and the shards are the source
of truth; the faiss file is derived from them and can always be rebuilt.

Paths the listing could not take (a name that is not UTF-8, a folder that cannot be read) have no image
row: they are kept in ``listing_errors``, per ``--images`` source, and reported with the image errors.

The schema and the row columns are defined here once. Two classes share every read query
(``CatalogueQueries``): ``Catalogue``, the writers' one connection (it creates the schema, WAL journal), and
``CatalogueReader``, the search path's read-only connections, one per thread, which never write.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import weakref
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from retrieval.index.sources import GalleryItem, ListingError


class Status(str, Enum):
    """A catalogue row's processing status; stored in SQLite and in the shards as its value."""

    PENDING = "pending"
    DONE = "done"
    ERROR = "error"
    DUPLICATE = "duplicate"
    REMOVED = "removed"

    def __str__(self) -> str:  # the value in f-strings and messages, on every Python version
        return self.value


# meta keys of an unfinished ``retrieval index upgrade`` (``retrieval.index.upgrade``): other writers are refused
UPGRADE_MODEL_PATH = "upgrade_model_path"


SCHEMA = f"""
CREATE TABLE IF NOT EXISTS images (
    id INTEGER PRIMARY KEY,
    path TEXT NOT NULL UNIQUE,
    label TEXT,
    sha256 TEXT,
    size INTEGER,
    status TEXT NOT NULL DEFAULT '{Status.PENDING}',
    error TEXT,
    duplicate_of INTEGER,
    shard TEXT
);
CREATE INDEX IF NOT EXISTS images_status ON images(status);
CREATE INDEX IF NOT EXISTS images_sha256 ON images(sha256);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
-- a manifest row's other columns (JSON object), for a search's `where`; absent for folder galleries
CREATE TABLE IF NOT EXISTS metadata (id INTEGER PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS listing_errors (
    source TEXT NOT NULL,
    path TEXT NOT NULL,
    error TEXT NOT NULL,
    PRIMARY KEY (source, path)
);
"""


# The columns of a catalogue row as ``rows`` and the other row queries return it (a dict per row).
ROW_COLUMNS = ("id", "path", "label", "sha256", "size", "status", "error", "duplicate_of")
_STATUS = ROW_COLUMNS.index("status")
_COLUMNS = ", ".join(ROW_COLUMNS)
_SELECT_ROWS = f"SELECT {_COLUMNS} FROM images"

LAST_RECORDED_SHARD = "last_recorded_shard"
THROUGHPUT_META = "throughput"  # per engine: images decoded + embedded + written to shards, seconds, images/s


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


class CatalogueQueries:
    """Every read query of the catalogue, over ``self.db`` (the writer's connection, or the reader's one for the
    calling thread)."""

    db: sqlite3.Connection

    # --- meta
    def get_meta(self, key: str, default: str | None = None) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else default

    def last_recorded_shard(self) -> str:
        return self.get_meta(LAST_RECORDED_SHARD, "") or ""

    # --- queries
    def pending(self) -> list[tuple[int, str]]:
        return self.db.execute("SELECT id, path FROM images WHERE status=? ORDER BY id", (Status.PENDING,)).fetchall()

    def status_of(self, ids: Sequence[int]) -> dict[int, Status]:
        out: dict[int, Status] = {}
        for chunk in _chunks([int(i) for i in ids], 900):  # SQLite's bound-parameter limit
            marks = ",".join("?" * len(chunk))
            rows = self.db.execute(f"SELECT id, status FROM images WHERE id IN ({marks})", chunk)
            out.update((i, Status(status)) for i, status in rows)
        return out

    def done_shards(self) -> dict[int, str]:
        """id -> the shard holding its vector, for every ``done`` row, in id order."""
        return dict(self.db.execute("SELECT id, shard FROM images WHERE status = ? ORDER BY id", (Status.DONE,)))

    def ids_with_status(self, status: Status) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT id FROM images WHERE status=? ORDER BY id", (status,))]

    def ids_for_paths(self, paths: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for chunk in _chunks(list(paths), 900):
            marks = ",".join("?" * len(chunk))
            out.update(self.db.execute(f"SELECT path, id FROM images WHERE path IN ({marks})", chunk))
        return out

    def paths_named(self, name: str, limit: int = 3) -> list[str]:
        """Up to ``limit`` catalogued paths whose file name is ``name``, in path order (a full scan: for messages)."""
        escaped = name.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        rows = self.db.execute("SELECT path FROM images WHERE path LIKE ? ESCAPE '\\' ORDER BY path LIMIT ?",
                               (f"%/{escaped}", int(limit)))
        return [row[0] for row in rows]

    def done_sha256(self) -> dict[str, int]:
        """sha256 -> id of the indexed images, to spot exact duplicates."""
        return dict(
            self.db.execute("SELECT sha256, id FROM images WHERE status=? AND sha256 IS NOT NULL", (Status.DONE,))
        )

    def rows(self, ids: Sequence[int], status: Status | None = None) -> dict[int, dict[str, Any]]:
        """id -> row (``ROW_COLUMNS``) for the ``ids`` catalogued (with ``status``, if given); others are absent."""
        out: dict[int, dict[str, Any]] = {}
        for chunk in _chunks(sorted({int(i) for i in ids}), 900):
            marks = ",".join("?" * len(chunk))
            for row in self.db.execute(f"{_SELECT_ROWS} WHERE id IN ({marks})", chunk):
                if status is None or row[_STATUS] == status:  # tested here: by primary key alone the lookup is faster
                    out[row[0]] = _row(row)
        return out

    # --- the indexed (``done``) rows, as search and serve see them
    def indexed_row(self, image_id: int) -> dict[str, Any] | None:
        return self.rows([image_id], Status.DONE).get(int(image_id))

    def indexed_count(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM images WHERE status=?", (Status.DONE,)).fetchone()[0]

    def row_by_sha256(self, sha256: str) -> dict[str, Any] | None:
        """The indexed row whose file has this sha256 (exact duplicates are catalogued as ``duplicate``)."""
        sql = f"{_SELECT_ROWS} WHERE status=? AND sha256 = ? ORDER BY id LIMIT 1"
        row = self.db.execute(sql, (Status.DONE, sha256)).fetchone()
        return None if row is None else _row(row)

    def path_range(self) -> tuple[str | None, str | None]:
        """The first and last path of the indexed rows in string order (None, None when there are none)."""
        sql = "SELECT MIN(path), MAX(path) FROM images WHERE status=?"
        first, last = self.db.execute(sql, (Status.DONE,)).fetchone()
        return first, last

    def filter_rows(
        self, within: Collection[int] | None = None, status: Status | None = Status.DONE
    ) -> tuple[list[int], list[str], list[str | None], dict[int, str]]:
        """The ids, paths and labels in id order of the rows with ``status`` (None: any) whose id is ``within``
        (None: any), and id -> metadata JSON (a manifest's columns) of those rows."""
        wanted = None if within is None else {int(i) for i in within}
        where, params = ("WHERE i.status=?", (status,)) if status is not None else ("", ())
        ids, paths, labels = [], [], []
        for i, path, label in self.db.execute(f"SELECT i.id, i.path, i.label FROM images i {where} ORDER BY i.id",
                                              params):
            if wanted is None or i in wanted:
                ids.append(int(i))
                paths.append(path)
                labels.append(label)
        kept = set(ids)
        try:
            sql = f"SELECT m.id, m.data FROM metadata m JOIN images i ON i.id = m.id {where}"
            extra = {int(i): data for i, data in self.db.execute(sql, params) if i in kept}
        except sqlite3.OperationalError:  # a catalogue written before metadata was kept
            extra = {}
        return ids, paths, labels, extra

    def shards_of(self, ids: Collection[int]) -> dict[int, str]:
        """id -> the shard the catalogue names for the vector of each of ``ids`` that has one, whatever its status
        (a row sent back to ``pending`` has none), in id order."""
        wanted = {int(i) for i in ids}
        sql = "SELECT id, shard FROM images WHERE shard IS NOT NULL ORDER BY id"
        return {int(i): shard for i, shard in self.db.execute(sql) if i in wanted}

    def label_counts(self) -> dict[str | None, int]:
        """Indexed images per label (None: the unlabelled ones)."""
        sql = "SELECT label, COUNT(*) FROM images WHERE status=? GROUP BY label"
        return {label: int(count) for label, count in self.db.execute(sql, (Status.DONE,))}

    def labelled(self) -> list[tuple[int, str]]:
        """(id, label) of every indexed image that has a label, by id."""
        sql = "SELECT id, label FROM images WHERE status=? AND label IS NOT NULL ORDER BY id"
        return [(int(i), str(label)) for i, label in self.db.execute(sql, (Status.DONE,))]

    def sample(self, count: int) -> list[dict[str, Any]]:
        """Up to ``count`` indexed rows spread evenly over the catalogue (examples for the UI)."""
        step = max(1, self.indexed_count() // max(1, count))
        sql = (
            f"SELECT {_COLUMNS} FROM (SELECT *, ROW_NUMBER() OVER (ORDER BY id) - 1 AS n FROM images "
            "WHERE status=?) WHERE n % ? = 0 ORDER BY id LIMIT ?"
        )
        return [_row(row) for row in self.db.execute(sql, (Status.DONE, step, count))]

    def duplicates(self, limit: int) -> tuple[int, list[tuple[dict[str, Any], dict[str, Any] | None]]]:
        """How many rows are exact duplicates, and up to ``limit`` of them (by id) with their twin's row."""
        total = self.db.execute("SELECT COUNT(*) FROM images WHERE status=?", (Status.DUPLICATE,)).fetchone()[0]
        sql = f"{_SELECT_ROWS} WHERE status=? ORDER BY id LIMIT ?"
        copies = [_row(row) for row in self.db.execute(sql, (Status.DUPLICATE, int(limit)))]
        twins = self.rows([c["duplicate_of"] for c in copies if c["duplicate_of"] is not None])
        return int(total), [(c, twins.get(c["duplicate_of"])) for c in copies]

    def counts(self) -> dict[str, int]:
        """Images per status (keyed by its value), ``total`` images, and ``not_listed``: paths the listing could
        not take."""
        counts = dict.fromkeys((s.value for s in Status), 0)
        counts.update(self.db.execute("SELECT status, COUNT(*) FROM images GROUP BY status"))
        counts["total"] = sum(counts[s.value] for s in Status)
        counts["not_listed"] = self.db.execute("SELECT COUNT(*) FROM listing_errors").fetchone()[0] \
            if self._has_listing_errors() else 0
        return counts

    def _has_listing_errors(self) -> bool:
        """Catalogues written before the listing's errors were kept have no such table until a writer opens them
        (the schema is created with IF NOT EXISTS); a read-only reader must not fail on them."""
        sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'listing_errors'"
        return self.db.execute(sql).fetchone() is not None

    def error_count(self) -> int:
        """Images that could not be read plus paths that could not be listed: the build's errors."""
        counts = self.counts()
        return counts[Status.ERROR.value] + counts["not_listed"]

    def error_examples(self, limit: int = 10) -> list[dict[str, Any]]:
        """Up to ``limit`` errors: the listing's first (id None: never catalogued), then the images'."""
        sql = "SELECT path, error FROM listing_errors ORDER BY source, path LIMIT ?"
        listed = [
            {"id": None, "path": path, "error": error, "duplicate_of": None}
            for path, error in (self.db.execute(sql, (limit,)) if self._has_listing_errors() else ())
        ]
        return listed + self.problems(Status.ERROR, limit - len(listed)) if len(listed) < limit else listed

    def iter_errors(self) -> Iterator[dict[str, Any]]:
        """Every error, in ``error_examples``' order, one row at a time (a gallery may have millions)."""
        if self._has_listing_errors():
            for path, error in self.db.execute("SELECT path, error FROM listing_errors ORDER BY source, path"):
                yield {"id": None, "path": path, "error": error}
        for image_id, path, error in self.db.execute(
                "SELECT id, path, error FROM images WHERE status=? ORDER BY id", (Status.ERROR,)):
            yield {"id": image_id, "path": path, "error": error}

    def problems(self, status: Status, limit: int = 20) -> list[dict[str, Any]]:
        sql = "SELECT id, path, error, duplicate_of FROM images WHERE status=? ORDER BY id LIMIT ?"
        return [
            dict(zip(("id", "path", "error", "duplicate_of"), r, strict=True))
            for r in self.db.execute(sql, (status, limit))
        ]


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


class _Connection(sqlite3.Connection):
    """A plain SQLite connection that can be referenced weakly (``CatalogueReader.close`` finds the live ones)."""


class CatalogueReader(CatalogueQueries):
    """Read-only catalogue queries from any thread: one read-only SQLite connection per thread, opened lazily.

    Connections are opened with ``mode=ro``: nothing here can write the database or create its schema. A writer
    (``Catalogue``, another process) may commit meanwhile; WAL readers see each commit whole. In a folder that
    this process cannot write and that no writer has open (no ``-shm`` file), SQLite cannot set up WAL's shared
    memory; the catalogue is then read as an immutable file (``immutable=1``), i.e. a frozen index.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"catalogue {self.path} not found")
        self._uri = f"{self.path.as_uri()}?mode=ro"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._live: weakref.WeakSet[_Connection] = weakref.WeakSet()  # a thread's goes when the thread ends
        self._closed = False
        self.db  # noqa: B018  (open this thread's connection now: an unreadable file fails here, not mid-search)

    @property
    def db(self) -> sqlite3.Connection:  # type: ignore[override]
        """This thread's connection."""
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        return db

    def _connect(self) -> sqlite3.Connection:
        with self._lock:
            if self._closed:
                raise sqlite3.ProgrammingError(f"the catalogue reader of {self.path} is closed")
        # check_same_thread=False only so that close() can close it; it is used by its own thread alone
        options = {"uri": True, "timeout": 30, "check_same_thread": False, "factory": _Connection}
        db = sqlite3.connect(self._uri, **options)
        try:
            db.execute("PRAGMA schema_version").fetchone()  # the first read: WAL's shared memory is set up here
        except sqlite3.OperationalError as exc:
            db.close()
            if getattr(exc, "sqlite_errorname", "") != "SQLITE_READONLY_DIRECTORY":
                raise
            db = sqlite3.connect(f"{self._uri}&immutable=1", **options)
        with self._lock:
            self._live.add(db)
        return db

    def close(self) -> None:
        """Close every thread's connection; using the reader afterwards is an error."""
        with self._lock:
            self._closed = True
            live = list(self._live)
        for db in live:
            db.close()

    def __enter__(self) -> CatalogueReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row(values: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(ROW_COLUMNS, values, strict=True))


def _chunks(values: list, size: int) -> Iterable[list]:
    for start in range(0, len(values), size):
        yield values[start : start + size]
