"""Keyword search on a Milvus collection: the text of an index's ``text_columns`` in one analysed VARCHAR field
(``KEYWORDS``), turned into a BM25 sparse vector by Milvus itself (a ``Function`` of type BM25 into
``KEYWORDS_BM25``, searched through a SPARSE_INVERTED_INDEX of metric BM25), and ``MilvusKeywords``, the
``retrieval.text.keywords.KeywordSearch`` a folder's FTS5 index answers, answered by Milvus' full-text search.

Both rank alike because both see the same terms: the field holds the folder index's own FTS5 terms of each row (its
``keywords.sqlite``, tokenized by SQLite's FTS5 with the same tokenizer: diacritics removed, Porter stems) joined by
spaces, and a query's content words (``query_terms``: stop words dropped, as the folder drops them) are stemmed the
same way before Milvus sees them; Milvus' standard analyzer (lowercase) then splits exactly those terms again. Stop
words stay in the documents, as in FTS5, so that both measure a row's length alike (BM25 normalises by it). A term
the standard analyzer would split (a private-use character, a case FTS5 does not fold) is sent as one ``_``-prefixed
hex word, the same in rows and queries. BM25's k1 and b are FTS5's (1.2, 0.75). What still differs (docs/INDEX.md,
"Keywords on Milvus"): Milvus' IDF is ln(1 + (N - n + 0.5) / (n + 0.5)), FTS5's ln((N - n + 0.5) / (n + 0.5))
(floored at 1e-6), so a one-word query ranks the same rows in the same order and a query of several words may
weigh its words a little differently; Milvus Lite measures N, n and the mean length per segment of the collection.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.index.milvus.milvus_collection import ID
from retrieval.text.keywords import (
    FTS_TABLE,
    MAX_FILTERED_SCAN,
    NO_HITS,
    TOKENIZER,
    FolderKeywords,
    KeywordError,
    KeywordHits,
    check_limit,
    query_terms,
    within_sorted,
)

KEYWORDS, KEYWORDS_BM25, BM25_FUNCTION = "keywords", "keywords_bm25", "keywords_to_bm25"
MAX_KEYWORD_BYTES = 65_535  # Milvus' largest VARCHAR; a row's terms past it are left out (64 full columns at most)
BM25_K1, BM25_B = 1.2, 0.75  # FTS5's bm25() constants (Milvus Lite's default k1 is 1.5)
ANALYZER = {"tokenizer": "standard", "filter": ["lowercase"]}  # splits the terms sent at spaces, nothing more
MILVUS_MAX_TOPK = 16_384  # the most hits one Milvus search returns
MAX_ID_FILTER = 4096  # ids a search's ``id in [...]`` names; a larger selection is kept after the search
TERM_BATCH = 2000  # rows tokenized together
_PLAIN = re.compile(r"[^\W_]+")  # what every standard analyzer keeps as one lowercase word


def add_keyword_fields(schema: Any) -> None:
    """Add the keyword text field, its BM25 vector and the function that makes one from the other to ``schema``."""
    from pymilvus import DataType, Function, FunctionType

    schema.add_field(KEYWORDS, DataType.VARCHAR, max_length=MAX_KEYWORD_BYTES, enable_analyzer=True,
                     analyzer_params=ANALYZER)
    schema.add_field(KEYWORDS_BM25, DataType.SPARSE_FLOAT_VECTOR)
    schema.add_function(Function(name=BM25_FUNCTION, function_type=FunctionType.BM25,
                                 input_field_names=[KEYWORDS], output_field_names=[KEYWORDS_BM25]))


def add_keyword_index(index_params: Any) -> None:
    """The BM25 index of the keyword vectors, with FTS5's k1 and b."""
    # as one JSON "params" entry, which Milvus servers read as ever and Milvus Lite 3 reads alone (it ignores the
    # flat entries pymilvus 3 makes of a plain dict, and would score with its own k1)
    index_params.add_index(KEYWORDS_BM25, index_type="SPARSE_INVERTED_INDEX", metric_type="BM25",
                           params={"params": {"bm25_k1": BM25_K1, "bm25_b": BM25_B}})


class Fts5Terms:
    """The terms SQLite's FTS5 makes of texts with the keyword index's tokenizer (``TOKENIZER``), read from a
    scratch in-memory FTS5 table through its ``fts5vocab`` instance table. One per thread."""

    def __init__(self) -> None:
        self.db = sqlite3.connect(":memory:")
        self.db.execute(f"CREATE VIRTUAL TABLE scratch USING fts5(t, tokenize='{TOKENIZER}')")
        self.db.execute("CREATE VIRTUAL TABLE temp.scratch_terms USING fts5vocab(main, scratch, 'instance')")

    def __call__(self, texts: Sequence[str]) -> list[list[str]]:
        """Per text, its terms in order."""
        self.db.execute("DELETE FROM scratch")
        self.db.executemany("INSERT INTO scratch(rowid, t) VALUES (?, ?)",
                            [(n + 1, text.replace("\x00", " ")) for n, text in enumerate(texts)])
        terms: list[list[str]] = [[] for _ in texts]
        for doc, term in self.db.execute("SELECT doc, term FROM temp.scratch_terms ORDER BY doc, offset"):
            terms[doc - 1].append(term)
        return terms

    def close(self) -> None:
        self.db.close()


def milvus_word(term: str) -> str:
    """An FTS5 term as one word every standard analyzer keeps whole and as it is: itself, or ``_`` and its UTF-8 in
    hex (FTS5 terms hold no ``_``, so no plain term is ever spelt so)."""
    if _PLAIN.fullmatch(term) and term.lower() == term:
        return term
    return "_" + term.encode("utf-8", "surrogatepass").hex()


def keyword_field(terms: Sequence[str]) -> str:
    """A row's terms as the keyword field's text, within ``MAX_KEYWORD_BYTES`` (cut at a word)."""
    text = " ".join(milvus_word(term) for term in terms)
    if len(text.encode("utf-8")) <= MAX_KEYWORD_BYTES:
        return text
    cut = text.encode("utf-8")[:MAX_KEYWORD_BYTES + 1].decode("utf-8", "ignore")
    return cut[:cut.rfind(" ")] if " " in cut else ""


def keyword_texts(index_root: str | Path, info: dict[str, Any]) -> dict[int, str] | None:
    """id -> the keyword field's text of every row the folder index's keyword index holds (``keyword_field`` of its
    FTS5 terms); None where the index has no keyword index (KeywordError: it records one that cannot be read)."""
    keywords = FolderKeywords.of_index(info, index_root)
    if keywords is None:
        return None
    texts: dict[int, str] = {}
    terms = Fts5Terms()
    try:
        for batch in _row_batches(keywords.path, len(keywords.columns)):
            for (image_id, _), row_terms in zip(batch, terms([text for _, text in batch]), strict=True):
                texts[image_id] = keyword_field(row_terms)
    except sqlite3.Error as exc:
        raise KeywordError(f"the keyword index {keywords.path} cannot be read ({exc}); build it again (`retrieval "
                           f"index text {keywords.path.parent}` with its text_columns)") from exc
    finally:
        terms.close()
    return texts


def _row_batches(path: Path, columns: int) -> Iterator[list[tuple[int, str]]]:
    """(id, its columns' text on separate lines) of each row of a keyword index file, ``TERM_BATCH`` at a time."""
    names = ", ".join(f"c{i}" for i in range(columns))
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute(f"SELECT rowid, {names} FROM {FTS_TABLE} ORDER BY rowid")
        while batch := rows.fetchmany(TERM_BATCH):
            yield [(int(row[0]), "\n".join(str(cell or "") for cell in row[1:])) for row in batch]
    finally:
        db.close()


class MilvusKeywords:
    """``KeywordSearch`` (``retrieval.text.keywords``) answered by the BM25 full-text search of a collection pushed
    with keywords: the query's content words stemmed as FTS5 stems them, never Milvus syntax (a BM25 search takes
    plain text: there is none to inject), the hits' share of them read from their stored terms."""

    def __init__(self, client: Any, collection: str) -> None:
        self.client, self.collection = client, collection

    def search(self, text: str, limit: int, where_ids: np.ndarray | None = None) -> KeywordHits:
        """The rows whose keywords hold any of the content words of ``text``, best BM25 first (at most ``limit``;
        ``where_ids``: those rows alone); no hits for a query without a content word."""
        limit = check_limit(limit)
        words = query_terms(text)
        if not words:
            return NO_HITS
        scratch = Fts5Terms()
        try:
            stemmed = [[milvus_word(t) for t in terms] for terms in scratch(words)]
        finally:
            scratch.close()
        if not any(stemmed):
            return NO_HITS
        expression, scan, selected = "", limit, None
        if where_ids is not None:
            selected = np.unique(np.asarray(where_ids, dtype=np.int64))
            if not len(selected):
                return NO_HITS
            if len(selected) <= MAX_ID_FILTER:
                expression = f"{ID} in {selected.tolist()}"
            else:
                scan = min(MAX_FILTERED_SCAN, MILVUS_MAX_TOPK)
        found = self.client.search(self.collection, data=[" ".join(w for terms in stemmed for w in terms)],
                                   anns_field=KEYWORDS_BM25, limit=scan, filter=expression,
                                   output_fields=[KEYWORDS], search_params={"metric_type": "BM25"})
        hits = list(found[0]) if found else []
        if selected is not None and not expression:
            held = within_sorted(np.asarray([int(hit["id"]) for hit in hits], dtype=np.int64), selected)
            hits = [hit for hit, keep in zip(hits, held.tolist(), strict=True) if keep]
        hits = hits[:limit]
        ids = np.asarray([int(hit["id"]) for hit in hits], dtype=np.int64)
        # Milvus Lite reports a BM25 hit's distance negated (its smaller-is-better convention), a server as is
        scores = np.abs(np.asarray([float(hit["distance"]) for hit in hits], dtype=np.float64))
        matched = np.asarray([_share(stemmed, _entity(hit).get(KEYWORDS) or "") for hit in hits], dtype=np.float64)
        return KeywordHits(ids, scores, matched)


def _entity(hit: Any) -> dict[str, Any]:
    entity = hit.get("entity") if hasattr(hit, "get") else None
    return entity if isinstance(entity, dict) else dict(hit)


def _share(words: list[list[str]], stored: str) -> float:
    """The share of the query's words (each its stemmed terms) a row's stored terms hold."""
    held = set(stored.split())
    return sum(bool(terms) and all(term in held for term in terms) for terms in words) / len(words)
