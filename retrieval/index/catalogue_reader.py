"""Reading the SQLite catalogue: every read query (``CatalogueQueries``), and ``CatalogueReader``, the search path's
read-only connections, one per thread, which never write.

``CatalogueQueries`` is shared with the writer's ``catalogue.Catalogue``, which reads through its own connection;
search, stats and serve take their catalogue names from here and ``catalogue_schema``.
"""

from __future__ import annotations

import sqlite3
import threading
import weakref
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from retrieval.index.catalogue_schema import LAST_RECORDED_SHARD, ROW_COLUMNS, Status

_STATUS = ROW_COLUMNS.index("status")
_COLUMNS = ", ".join(ROW_COLUMNS)
_SELECT_ROWS = f"SELECT {_COLUMNS} FROM images"


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

    def metadata_of(self, ids: Sequence[int]) -> dict[int, str]:
        """id -> metadata JSON (a manifest's columns) of those of ``ids`` that have some (900 ids a statement)."""
        out: dict[int, str] = {}
        try:
            for chunk in _chunks(sorted({int(i) for i in ids}), 900):
                marks = ",".join("?" * len(chunk))
                out.update(self.db.execute(f"SELECT id, data FROM metadata WHERE id IN ({marks})", chunk))
        except sqlite3.OperationalError:  # a catalogue written before metadata was kept
            return {}
        return out

    def metadata_columns(self, limit: int = 1000) -> list[str]:
        """The names of the manifest columns the rows' metadata holds, sorted (at most ``limit``)."""
        sql = ("SELECT DISTINCT j.key FROM metadata m, json_each(CASE WHEN json_valid(m.data) THEN m.data "
               "ELSE '{}' END) j WHERE j.type != 'null' ORDER BY j.key LIMIT ?")
        try:
            return [str(name) for (name,) in self.db.execute(sql, (int(limit),))]
        except sqlite3.OperationalError:  # a catalogue written before metadata was kept
            return []

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

    def labelled_with(self, labels: Collection[str]) -> list[tuple[int, str]]:
        """(id, label) of the indexed images whose label is one of ``labels``, by id (a few labels' rows, not all)."""
        wanted, found = sorted(set(labels)), []
        for start in range(0, len(wanted), 500):  # SQLite's bound on parameters
            chunk = wanted[start:start + 500]
            sql = f"SELECT id, label FROM images WHERE status=? AND label IN ({', '.join('?' * len(chunk))})"
            found += [(int(i), str(label)) for i, label in self.db.execute(sql, (Status.DONE, *chunk))]
        return sorted(found)

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
