"""Keywords on a Milvus collection (Milvus Lite: the real engine in this process): an index with ``text_columns``
pushed into a collection gets Milvus' BM25 full-text search of them, which finds the rows the folder's FTS5 index
finds, ranks a one-word query's hits in FTS5's order, and scores as BM25 with Milvus' IDF on FTS5's own terms (a slow
reference below); FTS5 scores as the same BM25 with its own IDF, the one difference. Hostile queries and cells are
answered, never injected; a collection pushed without text columns answers by vectors only."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest
from index_builds import write_embeddings_folder

pytest.importorskip("pymilvus")
pytest.importorskip("milvus_lite")

from pymilvus import DataType, FunctionType  # noqa: E402

from retrieval.index import Index, build_from_embeddings  # noqa: E402
from retrieval.index.embedding.engine import IngestOptions  # noqa: E402
from retrieval.index.milvus import milvus_keywords  # noqa: E402
from retrieval.index.milvus.milvus_collection import MilvusPlace, connect  # noqa: E402
from retrieval.index.milvus.milvus_index import MilvusIndex  # noqa: E402
from retrieval.index.milvus.milvus_keywords import (  # noqa: E402
    KEYWORDS,
    KEYWORDS_BM25,
    MAX_KEYWORD_BYTES,
    keyword_field,
    milvus_word,
)
from retrieval.index.milvus.milvus_push import push_index  # noqa: E402
from retrieval.index.writing.keyword_build import record_keywords  # noqa: E402
from retrieval.text.keywords import TOKENIZER, FolderKeywords, query_terms  # noqa: E402
from retrieval.text.text_search import search_text  # noqa: E402

pytestmark = pytest.mark.timeout(300)
DIM = 8
WORDS = ("hammer hammers claw garden rake rakes steel blue red mug cafe café running shoes runner socks wool "
         "teapot kettle lamp desk oak chair").split()
HOSTILE = ["Red \x00claw\x00 hammer", "bell\x07 \x1b[31mred\x1b[0m lamp", "日本 teapot", "\ue000private mug",
           "snake_case_word lamp", "🙂 emoji desk", "x" * 1000 + " hammer", "", "THE HAMMER OF THE GODS"]
QUERIES = ["hammer", "garden", "rakes", "cafe", "blue mug", "garden hammer claw", "oak desk lamp", "running shoes",
           "steel blue red", "teapot kettle", "wool socks runner", "chair chair oak"]


def titles(rows: int) -> list[str]:
    """Titles of 1 to 8 words from a small vocabulary (words repeat within a title), the hostile ones first."""
    rng = np.random.default_rng(3)
    made = [" ".join(rng.choice(WORDS, rng.integers(1, 9))) for _ in range(rows - len(HOSTILE))]
    return HOSTILE + [t.title() if n % 5 == 0 else t for n, t in enumerate(made)]


def build(root, rows: int, text_columns: str | None):
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((rows, DIM)).astype(np.float32)
    write_embeddings_folder(root / "in", [vectors],
                            [{"path": [f"p/{i}.jpg" for i in range(rows)], "title": titles(rows)}])
    build_from_embeddings(root / "in", root / "idx", index_key="Flat", options=IngestOptions(progress=False))
    if text_columns:
        record_keywords(root / "idx", text_columns)
    return root / "idx"


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """A folder index with keywords of its title column and its push into a FLAT collection."""
    root = tmp_path_factory.mktemp("milvus_keywords")
    index_dir = build(root, 160, "title")
    place = MilvusPlace.checked(str(root / "milvus.db"), "gallery")
    push_index(index_dir, place, index_type="FLAT", progress=False)
    with Index.open(index_dir) as local, MilvusIndex(place) as remote:
        yield index_dir, local, remote, FolderKeywords.of_index(local.info, index_dir)


# --- the slow, obvious reference: BM25 over FTS5's own terms ------------------------------------------------------
def fts5_terms(texts: list[str]) -> list[list[str]]:
    db = sqlite3.connect(":memory:")
    db.execute(f"CREATE VIRTUAL TABLE t USING fts5(x, tokenize='{TOKENIZER}')")
    db.execute("CREATE VIRTUAL TABLE temp.v USING fts5vocab(main, t, 'instance')")
    db.executemany("INSERT INTO t(rowid, x) VALUES (?, ?)", [(n + 1, s) for n, s in enumerate(texts)])
    terms = [[] for _ in texts]
    for doc, term in db.execute("SELECT doc, term FROM temp.v ORDER BY doc, offset"):
        terms[doc - 1].append(term)
    return terms


def documents(index_dir) -> dict[int, list[str]]:
    """id -> FTS5's terms of each row of the folder's keywords.sqlite."""
    db = sqlite3.connect(index_dir / "keywords.sqlite")
    rows = db.execute("SELECT rowid, c0 FROM keywords ORDER BY rowid").fetchall()
    return dict(zip([r[0] for r in rows], fts5_terms([r[1] for r in rows]), strict=True))


def bm25(query: str, docs: dict[int, list[str]], idf_of) -> dict[int, float]:
    """BM25 (k1 1.2, b 0.75) of each row holding a term of ``query``'s content words, with ``idf_of(N, n)``."""
    terms = [t for word in fts5_terms(query_terms(query)) for t in word]
    n_docs, avgdl = len(docs), sum(len(d) for d in docs.values()) / len(docs)
    scores: dict[int, float] = {}
    for term in terms:
        holding = {i: d.count(term) for i, d in docs.items() if term in d}
        for i, tf in holding.items():
            norm = tf * 2.2 / (tf + 1.2 * (0.25 + 0.75 * len(docs[i]) / avgdl))
            scores[i] = scores.get(i, 0.0) + idf_of(n_docs, len(holding)) * norm
    return scores


def milvus_idf(n_docs: int, n: int) -> float:
    return math.log(1 + (n_docs - n + 0.5) / (n + 0.5))


def fts5_idf(n_docs: int, n: int) -> float:
    idf = math.log((n_docs - n + 0.5) / (n + 0.5))
    return idf if idf > 0 else 1e-6


def tied(ids, scores) -> list[set[int]]:
    """The hits as groups of equal score (to 5 significant digits), best first: ties may come in any order."""
    groups: list[tuple[float, set[int]]] = []
    for i, s in zip(np.asarray(ids).tolist(), np.asarray(scores).tolist(), strict=True):
        if groups and math.isclose(groups[-1][0], s, rel_tol=1e-5):
            groups[-1][1].add(i)
        else:
            groups.append((s, {i}))
    return [g for _, g in groups]


# --- what must be equal -------------------------------------------------------------------------------------------
def test_the_collection_has_an_analysed_text_field_and_a_bm25_index(pushed):
    _, _, remote, _ = pushed
    described = remote.client.describe_collection(remote.place.collection)
    fields = {f["name"]: f for f in described["fields"]}
    assert fields[KEYWORDS]["params"]["enable_analyzer"] in (True, "true")
    assert fields[KEYWORDS_BM25]["type"] == DataType.SPARSE_FLOAT_VECTOR
    assert [f["type"] for f in described["functions"]] == [FunctionType.BM25]
    index = remote.client.describe_index(remote.place.collection, KEYWORDS_BM25)
    assert index["metric_type"] == "BM25" and index["index_type"] == "SPARSE_INVERTED_INDEX"
    assert remote.record.text_columns == ["title"]


@pytest.mark.parametrize("word", sorted({w for t in titles(160) for w in query_terms(t)})[:40])
def test_a_one_word_query_ranks_the_rows_fts5_ranks_in_its_order(pushed, word):
    _, _, remote, folder = pushed
    expected, found = folder.search(word, 1000), remote.keywords.search(word, 1000)
    assert tied(found.ids, found.scores) == tied(expected.ids, expected.scores)
    # FTS5 keeps U+E000 in the term "\ue000private", and a query's word is cut to 64 characters: no hit in either
    assert len(found.ids) > 0 or word == "private" or len(word) == 64
    # one IDF for every hit: the two scores differ by a constant factor
    ratios = found.scores / expected.scores
    assert not len(found.ids) or np.allclose(ratios, ratios[0], rtol=1e-4)


@pytest.mark.parametrize("query", QUERIES + HOSTILE[:6])
def test_every_query_finds_the_rows_fts5_finds_with_the_same_share_of_its_words(pushed, query):
    _, _, remote, folder = pushed
    expected, found = folder.search(query, 1000), remote.keywords.search(query, 1000)
    assert sorted(found.ids.tolist()) == sorted(expected.ids.tolist())
    assert dict(zip(found.ids.tolist(), found.matched.tolist(), strict=True)) == \
        dict(zip(expected.ids.tolist(), expected.matched.tolist(), strict=True))


@pytest.mark.parametrize("query", QUERIES)
def test_both_score_bm25_on_fts5s_terms_and_differ_only_in_the_idf(pushed, query):
    index_dir, _, remote, folder = pushed
    docs = documents(index_dir)
    for search, idf in ((remote.keywords.search, milvus_idf), (folder.search, fts5_idf)):
        hits = search(query, 1000)
        reference = bm25(query, docs, idf)
        assert set(hits.ids.tolist()) == set(reference)
        assert np.allclose(hits.scores, [reference[i] for i in hits.ids.tolist()], rtol=1e-4)
        assert np.all(np.diff(hits.scores) <= 1e-9)  # best first


def test_a_limit_and_a_selection_of_rows_keep_the_best_hits_among_them(pushed, monkeypatch):
    _, _, remote, folder = pushed
    everything = remote.keywords.search("hammer garden", 1000)
    assert remote.keywords.search("hammer garden", 5).ids.tolist() == everything.ids[:5].tolist()
    selected = np.sort(everything.ids[1::2])
    kept = np.isin(everything.ids, selected)
    within = tied(everything.ids[kept], everything.scores[kept])
    found = remote.keywords.search("hammer garden", 1000, selected)
    assert tied(found.ids, found.scores) == within
    monkeypatch.setattr(milvus_keywords, "MAX_ID_FILTER", 2)  # a selection too large for one expression
    found = remote.keywords.search("hammer garden", 1000, selected)
    assert tied(found.ids, found.scores) == within
    assert remote.keywords.search("hammer garden", 10, np.zeros(0, np.int64)).ids.tolist() == []
    assert sorted(folder.search("hammer garden", 1000, selected).ids.tolist()) == sorted(selected.tolist())


# --- hostile text -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("query", [
    "the of and a", "🙂🙂", "\x00\x01\x7f", "   ", '" or id > 0 or "', "TEXT_MATCH(keywords, 'hammer')",
    'keywords like "%" ', "id in [1, 2]", "hammer\x00" * 200, "h" * 1000, "Ǆ ǅ \ue000 _ __", "café CAFE cafe",
])
def test_hostile_queries_find_what_their_words_find_in_fts5_and_nothing_else(pushed, query):
    _, _, remote, folder = pushed
    expected, found = folder.search(query, 1000), remote.keywords.search(query, 1000)
    assert tied(found.ids, found.scores) == tied(expected.ids, expected.scores) or \
        sorted(found.ids.tolist()) == sorted(expected.ids.tolist())
    if not query_terms(query):
        assert len(found.ids) == 0


def test_hostile_cells_are_pushed_bounded_and_found_by_their_words(pushed):
    index_dir, _, remote, folder = pushed
    rows = remote.client.query(remote.place.collection, filter="id <= 9", output_fields=[KEYWORDS])
    stored = {int(r["id"]): r[KEYWORDS] for r in rows}
    assert all("\x00" not in text and "\x1b" not in text for text in stored.values())
    assert all(len(text.encode()) <= MAX_KEYWORD_BYTES for text in stored.values())
    term = fts5_terms(["\ue000private"])[0][0]  # FTS5 keeps U+E000 in the word (stemmed: "\ue000privat")
    assert "_" + term.encode().hex() in stored[4].split()
    for word in ("claw", "bell", "日本", "snake", "emoji", "gods", "31mred"):
        hits = remote.keywords.search(word, 10)
        assert len(hits.ids) and hits.ids.tolist() == folder.search(word, 10).ids.tolist(), word


def test_a_term_the_analyzer_would_split_is_sent_as_one_word():
    assert milvus_word("hammer") == "hammer" and milvus_word("日本") == "日本"
    assert milvus_word("\ue000private") == "_" + "\ue000private".encode().hex()
    assert milvus_word("ǅ") != milvus_word("ǆ")


def test_a_rows_keyword_text_is_cut_at_a_word_within_milvus_bound():
    terms = ["日本語"] * 20_000  # 9 bytes and a space each: far over the bound
    text = keyword_field(terms)
    assert len(text.encode()) <= MAX_KEYWORD_BYTES and set(text.split()) == {"日本語"}
    assert len(text.encode()) > MAX_KEYWORD_BYTES - 10


# --- fused text queries, and a collection without keywords -------------------------------------------------------
def test_a_text_query_on_the_collection_fuses_keywords_as_on_the_folder(pushed):
    _, local, remote, _ = pushed
    vectors = np.random.default_rng(5).standard_normal((2, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for query_vectors in (None, vectors):
        texts = ["hammer", "mug"]  # one word: its IDF cancels in the keyword relevance the fusion reads
        there = search_text(remote, texts, 10, query_vectors, remote.keywords)
        here = search_text(local, texts, 10, query_vectors, local.keywords)
        for a, b in zip(there, here, strict=True):
            assert [(r.id, r.source) for r in a] == [(r.id, r.source) for r in b]
            assert np.allclose([r.score for r in a], [r.score for r in b], atol=1e-5)
        assert any(r.source in ("keyword", "both") for r in there[0])


def test_a_collection_pushed_without_text_columns_answers_by_vectors_only(tmp_path):
    index_dir = build(tmp_path, 40, None)
    place = MilvusPlace.checked(str(tmp_path / "milvus.db"), "plain")
    push_index(index_dir, place, index_type="FLAT", progress=False)
    with MilvusIndex(place) as remote:
        assert remote.keywords is None
        fields = {f["name"] for f in remote.client.describe_collection("plain")["fields"]}
        assert KEYWORDS not in fields and KEYWORDS_BM25 not in fields
        query = np.eye(DIM, dtype=np.float32)[:1]
        found = search_text(remote, ["hammer"], 5, query, None)[0]
        assert [r.source for r in found] == ["vector"] * 5
        assert [r.id for r in found] == [r.id for r in remote.search(query, 5)[0]]


def test_keywords_added_to_a_pushed_index_move_the_name_to_a_collection_that_has_them(tmp_path):
    index_dir = build(tmp_path, 40, None)
    place = MilvusPlace.checked(str(tmp_path / "milvus.db"), "shop")
    first = push_index(index_dir, place, index_type="FLAT", progress=False)
    record_keywords(index_dir, "title")
    second = push_index(index_dir, place, progress=False)
    again = push_index(index_dir, place, progress=False)
    assert second["physical"] != first["physical"] and second["dropped"] == first["physical"]
    assert (again["physical"], again["sent"]) == (second["physical"], 0)
    client = connect(place)
    try:
        assert not client.has_collection(first["physical"])
    finally:
        client.close()
    with MilvusIndex(place) as remote, Index.open(index_dir) as local:
        folder = FolderKeywords.of_index(local.info, index_dir)
        assert remote.keywords.search("hammer", 100).ids.tolist() == folder.search("hammer", 100).ids.tolist()


def test_search_and_a_server_of_the_collection_answer_text_queries_as_those_of_the_folder(pushed):
    from click.testing import CliRunner

    from retrieval.cli.main import main
    from retrieval.serve.service import SearchService
    from retrieval.serve.service.text import TextQuery

    index_dir, _, remote, _ = pushed
    place = remote.place
    ask = ["search", "--text", "hammer", "--text", "the of", "-k", "5", "--json"]
    there = CliRunner().invoke(main, [*ask, "--milvus", place.uri, "--collection", place.collection])
    here = CliRunner().invoke(main, [*ask, "--index", str(index_dir)])
    assert there.exit_code == 0 and here.exit_code == 0, there.output + here.output
    for a, b in zip(json.loads(there.output), json.loads(here.output), strict=True):
        assert [(r["id"], r["path"], r["source"]) for r in a["results"]] == \
            [(r["id"], r["path"], r["source"]) for r in b["results"]]
        assert np.allclose([r["score"] for r in a["results"]], [r["score"] for r in b["results"]], atol=1e-5)
    assert json.loads(there.output)[1]["results"] == []  # only stop words: no keyword hit, no error
    served, local = SearchService(index_dir, milvus=place, reload_interval_s=None), \
        SearchService(index_dir, reload_interval_s=None)
    try:
        a, b = served.search(TextQuery("hammer"), k=5), local.search(TextQuery("hammer"), k=5)
        assert [(r.id, r.source) for r in a.results] == [(r.id, r.source) for r in b.results]
        assert {r.source for r in a.results} == {"keyword"}
    finally:
        served.close()
        local.close()


def test_search_refuses_a_collection_without_its_place_in_words():
    from click.testing import CliRunner

    from retrieval.cli.main import main

    result = CliRunner().invoke(main, ["search", "--milvus", "x.db", "--text", "hammer"])
    assert result.exit_code == 2 and "give --milvus URI and --collection NAME together" in result.output
    result = CliRunner().invoke(main, ["search", "--text", "hammer"])
    assert result.exit_code == 2 and "--index FOLDER, or --milvus URI --collection NAME" in result.output


def test_a_push_after_a_removal_finds_no_keyword_hit_of_the_removed_rows(tmp_path):
    from retrieval.index import remove_images

    index_dir = build(tmp_path, 60, "title")
    place = MilvusPlace.checked(str(tmp_path / "milvus.db"), "shop")
    push_index(index_dir, place, index_type="FLAT", progress=False)
    with MilvusIndex(place) as remote:
        before = remote.keywords.search("hammer", 100).ids
    gone = before[:3].tolist()
    remove_images(index_dir, ids=gone)
    again = push_index(index_dir, place, progress=False)
    assert again["deleted"] == 3 and again["sent"] == 0
    with MilvusIndex(place) as remote, Index.open(index_dir) as local:
        after = remote.keywords.search("hammer", 100).ids.tolist()
        assert set(after) == set(before.tolist()) - set(gone)
        assert sorted(after) == sorted(FolderKeywords.of_index(local.info, index_dir).search("hammer", 100).ids)
