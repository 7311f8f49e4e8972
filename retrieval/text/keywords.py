"""Keyword search over the catalogue's own text: an SQLite FTS5 index (``keywords.sqlite`` beside a folder index) of
the manifest columns index.json names (``text_columns``), one row per indexed image (rowid = its catalogue id), one
FTS5 column per text column. This module is the read side (no writer, no torch); ``retrieval.index.writing.
keyword_build`` builds and updates the file.

The protocol every keyword backend implements (the folder's FTS5 here; a Milvus collection's BM25 full-text search
elsewhere), so that ``retrieval.text.text_search`` fuses either with the vector ranks::

    class KeywordSearch(Protocol):
        def search(self, text: str, limit: int, where_ids: np.ndarray | None = None) -> KeywordHits: ...

``text`` is the user's query as typed (checked by ``tokens.check_query_text``); the backend never passes it to its
query language: ``query_terms`` gives the content words (stop words dropped, at most ``MAX_QUERY_TERMS``), each
searched as a plain word, OR-ed. ``limit`` (at most ``MAX_KEYWORD_HITS``) bounds the hits; ``where_ids`` (sorted
int64 catalogue ids, or None: any) keeps only those rows. ``KeywordHits``: the ids best first, their scores (higher
is better: FTS5's bm25 negated, Milvus' BM25 as is) and ``matched``, per hit the share of the query's terms its
text holds (what the fusion's gate reads). A query with no content word has no hits.

The tokenizer is FTS5's ``unicode61`` with diacritics removed (``café`` finds ``cafe``) under the Porter stemmer
(``hammers`` finds ``hammer``): the same at build and at query time, as FTS5 applies it to both.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from retrieval.records.index_info import IndexInfo

KEYWORD_INDEX_FILE = "keywords.sqlite"  # beside index.json in the index folder
TEXT_COLUMNS = "text_columns"  # index.json: the manifest columns the keyword index holds (a list)
KEYWORD_INDEX = "keyword_index"  # index.json: the keyword index's file name, relative to the index folder
TOKENIZER = "porter unicode61 remove_diacritics 2"
FTS_TABLE = "keywords"  # the FTS5 table; its columns are c0, c1, ... (a manifest's names are never SQL here)
INFO_TABLE = "keyword_info"  # key -> value: the columns (JSON list) and the tokenizer it was built with
MAX_QUERY_TERMS = 16  # content words of one query searched; the rest are ignored
MAX_TERM_CHARS = 64  # a longer "word" is no word a title holds: cut
MAX_KEYWORD_HITS = 1000  # one query's hits at most
MAX_FILTERED_SCAN = 20_000  # with ``where_ids``: ranked hits looked through for ``limit`` inside the filter

# words that carry no product meaning in a query ("a hammer for the garden"); FTS5 keywords are plain words here
STOP_WORDS = frozenset("""
a about an and are as at be but by for from has have i in into is it its me my near no not of on or our so
than that the their them then there these this those to too us very was we were what when where which who
why will with without you your
""".split())

_WORD = re.compile(r"[^\W_]+")  # unicode61's token characters: letters and digits (underscore separates)


class KeywordError(ValueError):
    """The keyword index cannot be read or does not fit the index (names the file and the fix)."""


class KeywordHits(NamedTuple):
    """One query's keyword hits, best first: catalogue ids (int64), scores (float64, higher is better) and the share
    of the query's terms each hit's text holds (float64 in (0, 1])."""

    ids: np.ndarray
    scores: np.ndarray
    matched: np.ndarray


NO_HITS = KeywordHits(np.zeros(0, np.int64), np.zeros(0, np.float64), np.zeros(0, np.float64))


class KeywordSearch(Protocol):
    """What a keyword backend answers (the module's docstring has the contract)."""

    def search(self, text: str, limit: int, where_ids: np.ndarray | None = None) -> KeywordHits: ...


def query_terms(text: str) -> list[str]:
    """The content words of ``text``, lowercased, in order, each once: stop words, punctuation, symbols and emoji
    dropped, each cut to ``MAX_TERM_CHARS``, at most ``MAX_QUERY_TERMS`` (the rest ignored)."""
    terms: list[str] = []
    for match in _WORD.finditer(text.replace("\x00", " ")):
        word = match.group().lower()[:MAX_TERM_CHARS]
        if word not in STOP_WORDS and word not in terms:
            terms.append(word)
            if len(terms) == MAX_QUERY_TERMS:
                break
    return terms


def quoted(term: str) -> str:
    """``term`` as an FTS5 string: a word, never an operator, a column filter or a prefix query."""
    return '"' + term.replace('"', '""') + '"'


def match_expression(terms: list[str]) -> str:
    """The FTS5 query that matches a row holding any of ``terms`` (each quoted: plain words)."""
    return " OR ".join(quoted(term) for term in terms)


def check_limit(limit: object) -> int:
    """``limit`` as an int in [1, MAX_KEYWORD_HITS], or ValueError."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_KEYWORD_HITS:
        raise ValueError(f"a keyword search's limit must be an integer between 1 and {MAX_KEYWORD_HITS}, got "
                         f"{repr(limit)[:40]}")
    return limit


def has_keywords(info: IndexInfo) -> bool:
    """Whether index.json (``info``) records a keyword index (its columns a list of names, its file a name)."""
    columns, file = info.catalogue.text_columns, info.catalogue.keyword_index
    return isinstance(columns, list) and bool(columns) and all(isinstance(c, str) for c in columns) \
        and isinstance(file, str) and bool(file)


class FolderKeywords:
    """``KeywordSearch`` over a folder index's ``keywords.sqlite`` (FTS5), read-only: each search opens its own
    connection (any thread; a rebuilt file is read as it is now)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise KeywordError(f"the keyword index {self.path} is missing; build it again (`retrieval index text "
                               f"{self.path.parent}` with its text_columns)")
        self._uri = f"{self.path.resolve().as_uri()}?mode=ro"
        db = self._connect()
        try:
            self.columns = read_columns(db, self.path)
        finally:
            db.close()

    @classmethod
    def of_index(cls, info: IndexInfo, index_root: str | Path) -> FolderKeywords | None:
        """The keyword index that index.json (``info``) records for the folder ``index_root``; None where none."""
        if not has_keywords(info):
            return None
        name = Path(str(info.catalogue.keyword_index)).name  # a file in the folder, whatever index.json says
        return cls(Path(index_root) / name)

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self._uri, uri=True, timeout=30)
        except sqlite3.Error as exc:
            raise KeywordError(f"the keyword index {self.path} cannot be opened ({exc})") from exc
        return db

    def search(self, text: str, limit: int, where_ids: np.ndarray | None = None) -> KeywordHits:
        """The rows that hold the content words of ``text`` (``query_terms``), best bm25 first (module docstring)."""
        limit = check_limit(limit)
        terms = query_terms(text)
        if not terms:
            return NO_HITS
        selected = None if where_ids is None else np.asarray(where_ids, dtype=np.int64)
        if selected is not None and not len(selected):
            return NO_HITS
        scan = limit if selected is None else MAX_FILTERED_SCAN
        sql = f"SELECT rowid, bm25({FTS_TABLE}) FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH ? ORDER BY rank LIMIT ?"
        db = self._connect()
        try:
            rows = db.execute(sql, (match_expression(terms), scan)).fetchall()
            ids = np.asarray([r[0] for r in rows], dtype=np.int64)
            scores = -np.asarray([r[1] for r in rows], dtype=np.float64)  # bm25(): lower is better
            if selected is not None:
                keep = within_sorted(ids, selected)
                ids, scores = ids[keep], scores[keep]
            ids, scores = ids[:limit], scores[:limit]
            matched = _matched_share(db, terms, ids)
        except sqlite3.Error as exc:
            raise KeywordError(f"the keyword index {self.path} cannot be searched ({exc}); build it again "
                               f"(`retrieval index text {self.path.parent}` with its text_columns)") from exc
        finally:
            db.close()
        return KeywordHits(ids, scores, matched)


def read_columns(db: sqlite3.Connection, path: Path) -> list[str]:
    """The text columns a keyword index file holds, in FTS5 column order (KeywordError: not a keyword index)."""
    import json

    try:
        row = db.execute(f"SELECT value FROM {INFO_TABLE} WHERE key = 'columns'").fetchone()
        columns = json.loads(row[0]) if row else None
    except (sqlite3.Error, ValueError) as exc:
        raise KeywordError(f"{path} is not a keyword index ({exc}); build it again (`retrieval index text "
                           f"{path.parent}` with its text_columns)") from exc
    if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        raise KeywordError(f"{path} records no text columns; build it again (`retrieval index text {path.parent}` "
                           "with its text_columns)")
    return columns


def within_sorted(ids: np.ndarray, selected: np.ndarray) -> np.ndarray:
    """Per id, whether it is in the sorted ``selected``."""
    if not len(selected):
        return np.zeros(ids.shape, dtype=bool)
    positions = np.minimum(np.searchsorted(selected, ids), len(selected) - 1)
    return selected[positions] == ids


def _matched_share(db: sqlite3.Connection, terms: list[str], ids: np.ndarray) -> np.ndarray:
    """Per hit (``ids``), the share of ``terms`` its text holds: one FTS5 query per term, on those rows alone."""
    if not len(ids):
        return np.zeros(0, np.float64)
    counts = dict.fromkeys(ids.tolist(), 0)
    chunk = 500  # SQLite's bound on parameters
    for term in terms:
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk].tolist()
            marks = ",".join("?" * len(part))
            sql = f"SELECT rowid FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH ? AND rowid IN ({marks})"
            for (rowid,) in db.execute(sql, (quoted(term), *part)):
                counts[rowid] += 1
    return np.asarray([counts[i] / len(terms) for i in ids.tolist()], dtype=np.float64)
