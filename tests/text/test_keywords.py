"""The keyword index (SQLite FTS5) beside a folder index: built by `index build --text-columns` and `index text
--text-columns`, one row per indexed image (rowid = catalogue id), kept in step by `index add` and `index remove`;
queries made safe (every word quoted, FTS5 syntax never read as syntax, stop words dropped, bounded), plurals and
accents folded. Real SQLite, real index, real ONNX model."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest
from keyword_catalogue import TITLES, build_catalogue_index, ids_by_title, run, write_catalogue

from retrieval.index.writing.keyword_build import fts5_available
from retrieval.records.index_info import IndexInfo
from retrieval.text.keywords import (
    MAX_QUERY_TERMS,
    FolderKeywords,
    match_expression,
    query_terms,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("keywords")
    index_dir, model = build_catalogue_index(root)
    return index_dir, model, FolderKeywords(index_dir / "keywords.sqlite"), ids_by_title(index_dir)


def found(keywords: FolderKeywords, text: str, limit: int = 20) -> list[int]:
    return keywords.search(text, limit).ids.tolist()


def test_this_python_has_fts5():
    assert fts5_available()


def test_the_build_keeps_one_row_per_indexed_image_under_its_catalogue_id(built):
    index_dir, _, _, by_title = built
    info = json.loads((index_dir / "index.json").read_text())
    assert info["text_columns"] == ["title", "brand"] and info["keyword_index"] == "keywords.sqlite"
    db = sqlite3.connect(index_dir / "keywords.sqlite")
    rows = dict(db.execute("SELECT rowid, c0 FROM keywords"))
    db.close()
    assert set(rows) == set(by_title.values()) and len(rows) == len(TITLES)
    assert all(rows[i] == title.replace("\x00", " ") for title, i in by_title.items())


def test_a_plural_finds_the_singular_and_accents_fold(built):
    _, _, keywords, by_title = built
    assert found(keywords, "hammers") == [by_title["Claw hammer, steel"]]
    assert found(keywords, "cafe tables") == [by_title["Café table, oak"]]


def test_every_column_is_searched_and_the_best_bm25_comes_first(built):
    _, _, keywords, by_title = built
    hits = keywords.search("garden shears", 10)
    assert hits.ids[0] == by_title["Garden shears"] and hits.ids[1] == by_title["Garden hose 20 m"]
    assert np.all(np.diff(hits.scores) <= 0) and hits.matched.tolist() == [1.0, 0.5]
    assert set(found(keywords, "bosch")) == {i for t, i in by_title.items() if TITLES.index(t) % 2}


def test_stop_words_alone_find_nothing_and_are_dropped_from_a_query():
    assert query_terms("the hammer for a garden, with THE shears") == ["hammer", "garden", "shears"]
    assert query_terms("a the for with of") == []
    assert len(query_terms(" ".join(f"w{n}" for n in range(100)))) == MAX_QUERY_TERMS


@pytest.mark.parametrize("text", [
    "screw*",  # a prefix query would find the screwdriver
    "title:shears",  # a column filter
    "c0:garden",
    "{c0 c1}: garden",
    '"garden',  # an unbalanced quote
    'NEAR(garden shears, 0)',
    "garden AND NOT hose",
    "garden -hose",
    "^garden",
    "\x00garden\x00",
    "g" * 1000,
    "🔨🔨🔨",
    "x" * 999 + " garden",
    "'); DROP TABLE keywords; --",
])
def test_hostile_text_never_errors_and_never_matches_by_syntax(built, text):
    _, _, keywords, by_title = built
    hits = keywords.search(text, 50)
    terms = query_terms(text)
    assert '"' not in "".join(terms) and all(t.isalnum() for t in terms)
    for i in hits.ids.tolist():  # every hit holds one of the query's words (stemmed), never a syntax's pick
        title = next(t for t, n in by_title.items() if n == i).lower()
        assert any(term[:4] in title or term in {"bosch", "acme"} for term in terms), (text, title)
    if text.startswith("screw"):
        assert hits.ids.tolist() == []
    if "garden" in text and "hose" in text:  # AND NOT / -hose exclude nothing: the hose is found
        assert by_title["Garden hose 20 m"] in hits.ids.tolist()


def test_a_query_is_only_quoted_words_or_ed():
    assert match_expression(query_terms('Hammer "NEAR" title:x OR *')) == '"hammer" OR "title" OR "x"'


def test_hostile_cells_are_indexed_as_words(built):
    _, _, keywords, by_title = built
    assert found(keywords, "quoted end") == [by_title[TITLES[5]]]
    assert found(keywords, "sledge") == [by_title["🔨 Emoji sledge"]]
    assert found(keywords, "script lamp")[0] == by_title[TITLES[8]]


def test_a_filter_keeps_only_its_rows(built):
    _, _, keywords, by_title = built
    garden = [by_title["Garden shears"], by_title["Garden hose 20 m"]]
    hits = keywords.search("garden", 10, where_ids=np.asarray(sorted(garden[1:]), np.int64))
    assert hits.ids.tolist() == garden[1:]
    assert keywords.search("garden", 10, where_ids=np.zeros(0, np.int64)).ids.tolist() == []


def test_a_limit_out_of_range_is_refused(built):
    keywords = built[2]
    for limit in (0, 1001, True, 2.5):
        with pytest.raises(ValueError, match="limit"):
            keywords.search("garden", limit)


def test_add_and_remove_keep_the_keyword_index_in_step(tmp_path):
    index_dir, model = build_catalogue_index(tmp_path)
    keywords = FolderKeywords(index_dir / "keywords.sqlite")
    more = write_catalogue(tmp_path / "more", ["Pruning saw", "Watering can"], start=len(TITLES))
    assert run("index", "add", index_dir, "--images", more).exit_code == 0
    assert keywords.search("saw", 5).ids.tolist() == [ids_by_title(index_dir)["Pruning saw"]]
    hammer = ids_by_title(index_dir)["Claw hammer, steel"]
    assert run("index", "remove", index_dir, "--ids", str(hammer)).exit_code == 0
    assert keywords.search("hammer", 5).ids.tolist() == []
    db = sqlite3.connect(index_dir / "keywords.sqlite")
    assert db.execute("SELECT COUNT(*) FROM keywords").fetchone()[0] == len(TITLES) + 2 - 1
    db.close()


def test_index_text_builds_the_keywords_of_an_existing_index(tmp_path):
    index_dir, _ = build_catalogue_index(tmp_path, text_columns=None)
    assert not (index_dir / "keywords.sqlite").exists()
    result = run("index", "text", index_dir, "--text-columns", "title")
    assert result.exit_code == 0, result.output
    assert "keyword index of title" in result.output
    assert json.loads((index_dir / "index.json").read_text())["text_columns"] == ["title"]
    assert found(FolderKeywords(index_dir / "keywords.sqlite"), "mallet") == [ids_by_title(index_dir)["Rubber mallet"]]


def test_an_unknown_column_is_refused_naming_the_ones_there_are(tmp_path):
    manifest = write_catalogue(tmp_path / "shop", TITLES[:2])
    from embedders import write_projection_onnx

    model = write_projection_onnx(tmp_path / "model.onnx")
    result = run("index", "build", "--model", model, "--images", manifest, "--out", tmp_path / "index",
                 "--text-columns", "title,colour")
    assert result.exit_code != 0
    assert "--text-columns" in result.output and "colour" in result.output
    assert "label, brand, title" in result.output
    built = run("index", "build", "--model", model, "--images", manifest, "--out", tmp_path / "index")
    assert built.exit_code == 0
    result = run("index", "text", tmp_path / "index", "--text-columns", "nope")
    assert result.exit_code != 0 and "nope" in result.output and "label, brand, title" in result.output


def test_index_text_needs_a_text_model_or_text_columns(built):
    result = run("index", "text", built[0])
    assert result.exit_code != 0 and "--text-model" in result.output and "--text-columns" in result.output


def test_a_keyword_index_out_of_step_is_put_right_by_the_next_writer(tmp_path):
    """A writer killed between its catalogue and its keyword index leaves rows missing or extra: the next sync (add,
    remove, repair) compares with the catalogue and mends both; a missing file is rebuilt."""
    from retrieval.index.catalogue import Catalogue
    from retrieval.index.layout import IndexLayout
    from retrieval.index.writing.keyword_build import sync_keywords

    index_dir, _ = build_catalogue_index(tmp_path)
    by_title = ids_by_title(index_dir)
    db = sqlite3.connect(index_dir / "keywords.sqlite")
    db.execute("DELETE FROM keywords WHERE rowid = ?", (by_title["Rubber mallet"],))
    db.execute("INSERT INTO keywords(rowid, c0, c1) VALUES (999, 'ghost mallet', '')")
    db.commit()
    db.close()
    record = IndexInfo.from_json(json.loads((index_dir / "index.json").read_text()))
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        assert sync_keywords(IndexLayout(index_dir), catalogue, record)["text_columns"] == ["title", "brand"]
        assert found(FolderKeywords(index_dir / "keywords.sqlite"), "mallet") == [by_title["Rubber mallet"]]
        (index_dir / "keywords.sqlite").unlink()
        sync_keywords(IndexLayout(index_dir), catalogue, record)
    assert found(FolderKeywords(index_dir / "keywords.sqlite"), "mallet") == [by_title["Rubber mallet"]]
