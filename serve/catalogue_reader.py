"""Read-only catalogue lookups from any thread (``retrieval.index.Catalogue`` is bound to one thread)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COLUMNS = ("id", "path", "label", "sha256", "size", "status")


class CatalogueReader:
    """One read-only SQLite connection per thread; only ``done`` (indexed) rows are visible."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"catalogue {self.path} not found")
        self._local = threading.local()

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, timeout=30)
            self._local.db = db
        return db

    def rows(self, ids: Sequence[int]) -> dict[int, dict[str, Any]]:
        """id -> row for the indexed images among ``ids`` (unknown or non-indexed ids are absent)."""
        wanted = sorted({int(i) for i in ids})
        out: dict[int, dict[str, Any]] = {}
        for start in range(0, len(wanted), 900):  # SQLite's bound-parameter limit
            chunk = wanted[start : start + 900]
            marks = ",".join("?" * len(chunk))
            sql = f"SELECT {', '.join(COLUMNS)} FROM images WHERE status='done' AND id IN ({marks})"
            for row in self._db().execute(sql, chunk):
                out[row[0]] = dict(zip(COLUMNS, row, strict=True))
        return out

    def row(self, image_id: int) -> dict[str, Any] | None:
        return self.rows([image_id]).get(int(image_id))

    def row_by_sha256(self, sha256: str) -> dict[str, Any] | None:
        """The indexed row whose file has this sha256 (exact duplicates are catalogued as ``duplicate``)."""
        sql = f"SELECT {', '.join(COLUMNS)} FROM images WHERE status='done' AND sha256 = ? ORDER BY id LIMIT 1"
        row = self._db().execute(sql, (sha256,)).fetchone()
        return None if row is None else dict(zip(COLUMNS, row, strict=True))

    def path_range(self) -> tuple[str | None, str | None]:
        """The first and last path of the indexed rows in string order (None, None when there are none)."""
        first, last = self._db().execute("SELECT MIN(path), MAX(path) FROM images WHERE status='done'").fetchone()
        return first, last

    def labelled(self) -> list[tuple[int, str]]:
        """(id, label) of every indexed image that has a label, by id."""
        sql = "SELECT id, label FROM images WHERE status='done' AND label IS NOT NULL ORDER BY id"
        return [(int(i), str(label)) for i, label in self._db().execute(sql)]

    def sample(self, count: int) -> list[dict[str, Any]]:
        """Up to ``count`` indexed rows spread evenly over the catalogue (examples for the UI)."""
        total = self._db().execute("SELECT COUNT(*) FROM images WHERE status='done'").fetchone()[0]
        step = max(1, total // max(1, count))
        sql = (
            f"SELECT {', '.join(COLUMNS)} FROM (SELECT *, ROW_NUMBER() OVER (ORDER BY id) - 1 AS n "
            "FROM images WHERE status='done') WHERE n % ? = 0 ORDER BY id LIMIT ?"
        )
        return [dict(zip(COLUMNS, row, strict=True)) for row in self._db().execute(sql, (step, count))]
