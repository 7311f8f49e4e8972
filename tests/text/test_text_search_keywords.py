"""`retrieval search --text` over an index with a keyword index: by keywords alone where the index has no text
model, fused with the text model's ranks where it has one (each hit's source in the table and in --json), filters
kept, keyword hits outside them dropped. Real index, real ONNX models (a small text tower)."""

from __future__ import annotations

import json

import pytest
from keyword_catalogue import build_catalogue_index, ids_by_title, run
from text_towers import small_text_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def catalogue(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_keywords")
    index_dir, _ = build_catalogue_index(root)
    return index_dir, ids_by_title(index_dir)


def answers(index_dir, *args) -> list[dict]:
    result = run("search", "--index", index_dir, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # stderr may hold notes


def test_without_a_text_model_the_titled_item_is_found_by_keyword(catalogue):
    index_dir, by_title = catalogue
    found = answers(index_dir, "--text", "rubber mallets", "-k", "3")[0]["results"]
    assert [r["id"] for r in found] == [by_title["Rubber mallet"]]
    assert found[0]["source"] == "keyword" and found[0]["columns"]["title"] == "Rubber mallet"
    table = run("search", "--index", index_dir, "--text", "rubber mallets")
    assert table.exit_code == 0 and "keyword" in table.output and "Rubber mallet" in table.output
    assert answers(index_dir, "--text", "the for with")[0]["results"] == []  # stop words alone: nothing


def test_with_a_text_model_keyword_hits_are_fused_with_the_vector_ranks(catalogue, tmp_path):
    index_dir, by_title = catalogue
    model_hash = json.loads((index_dir / "index.json").read_text())["model_hash"]
    tower = small_text_model(tmp_path / "text.onnx", model_hash, 24)
    found = answers(index_dir, "--text", "garden shears", "--text-model", tower, "-k", "5")[0]["results"]
    assert len(found) == 5 and found[0]["id"] == by_title["Garden shears"]
    assert found[0]["source"] in ("keyword", "both")
    assert {r["source"] for r in found[1:]} <= {"vector", "keyword", "both"} and "vector" in {
        r["source"] for r in found}
    assert all(-1 <= r["score"] <= 1 for r in found)
    vector_only = answers(index_dir, "--text", "zzzz qqqq", "--text-model", tower, "-k", "5")[0]["results"]
    assert {r["source"] for r in vector_only} == {"vector"}  # words that match nothing: the vector order alone


def test_a_filter_drops_keyword_hits_outside_it(catalogue):
    index_dir, by_title = catalogue
    found = answers(index_dir, "--text", "garden", "--where", 'brand = "Bosch"')[0]["results"]  # the hose's brand
    assert [r["id"] for r in found] == [by_title["Garden hose 20 m"]]  # the shears (Acme) left out
