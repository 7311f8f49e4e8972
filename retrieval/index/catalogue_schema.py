"""The SQLite catalogue's schema: its tables, the row statuses, the row columns and the meta keys, defined once.

Statuses: ``pending`` (planned, not yet embedded), ``done`` (its vector is in a shard and counts as
indexed), ``error`` (unreadable; ``error`` says why), ``duplicate`` (same sha256 as ``duplicate_of``),
``removed`` (taken out with ``retrieval index remove``). The catalogue and the shards are the source
of truth; the faiss file is derived from them and can always be rebuilt.

Paths the listing could not take (a name that is not UTF-8, a folder that cannot be read) have no image
row: they are kept in ``listing_errors``, per ``--images`` source, and reported with the image errors.

The writer (``catalogue.Catalogue``) creates the tables with ``IF NOT EXISTS``: a catalogue written before a table
was added gains it when a writer next opens it, and the readers (``catalogue_reader``) allow for its absence.
"""

from __future__ import annotations

from enum import Enum


class Status(str, Enum):
    """A catalogue row's processing status; stored in SQLite and in the shards as its value."""

    PENDING = "pending"
    DONE = "done"
    ERROR = "error"
    DUPLICATE = "duplicate"
    REMOVED = "removed"

    def __str__(self) -> str:  # the value in f-strings and messages, on every Python version
        return self.value


# meta keys of an unfinished ``retrieval index upgrade`` (``writing.upgrade``): other writers are refused
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

LAST_RECORDED_SHARD = "last_recorded_shard"
THROUGHPUT_META = "throughput"  # per engine: images decoded + embedded + written to shards, seconds, images/s
