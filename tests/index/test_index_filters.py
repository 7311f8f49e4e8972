"""Filters: the `where` language against a slow reference, manifest columns kept in the
catalogue, exact top-k of the matching rows on a Flat index, at least the unfiltered recall on IVF, and the CLI."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from PIL import Image

from retrieval.index import Index, build_index, remove_images
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.filters import FilterError, FilterTable, parse_filter
from retrieval.records.index_info import IndexInfo

QUICK = IngestOptions(workers=0)
COLOURS = ("red", "green", "blue", "it's")  # a quote inside a value


# --- the language against a reference ---------------------------------------------------------------------------
def random_expression(rng: random.Random, depth: int = 0):
    """(text, evaluate(row) -> True/False/None) of a random expression over label (text), price and id (numbers)."""
    kind = rng.choice(["cmp", "cmp", "in", "not", "and", "or"] if depth < 3 else ["cmp", "in"])
    if kind == "cmp":
        column = rng.choice(["label", "price", "id"])
        op = rng.choice(["=", "!=", "<", "<=", ">", ">="])
        value = rng.choice(["cat", "dog", "cow", "ant"]) if column == "label" else float(rng.randint(0, 12))
        literal = f'"{value}"' if column == "label" else f"{value:g}"

        def evaluate(row, column=column, op=op, value=value):
            v = row.get(column)
            if v is None:
                return None
            return {"=": v == value, "!=": v != value, "<": v < value, "<=": v <= value, ">": v > value,
                    ">=": v >= value}[op]

        return f"{column} {op} {literal}", evaluate
    if kind == "in":
        values = rng.sample(["cat", "dog", "cow", "bee"], rng.randint(1, 3))
        negated = rng.random() < 0.5
        text = f"label {'not in' if negated else 'in'} ({', '.join(repr(v) for v in values)})"

        def evaluate(row, values=values, negated=negated):
            v = row.get("label")
            return None if v is None else (v not in values if negated else v in values)

        return text, evaluate
    if kind == "not":
        text, inner = random_expression(rng, depth + 1)
        return f"not ({text})", lambda row: None if inner(row) is None else not inner(row)
    (lt, left), (rt, right) = random_expression(rng, depth + 1), random_expression(rng, depth + 1)

    def both(row):
        a, b = left(row), right(row)
        if a is False or b is False:
            return False
        return None if a is None or b is None else True

    def either(row):
        a, b = left(row), right(row)
        if a is True or b is True:
            return True
        return None if a is None or b is None else False

    return f"({lt}) {kind.upper() if rng.random() < 0.3 else kind} ({rt})", both if kind == "and" else either


def test_random_expressions_match_a_three_valued_reference():
    rng = random.Random(0)
    labels = [rng.choice(["cat", "dog", "cow", None]) for _ in range(60)]
    prices = [rng.choice([None, *range(12)]) for _ in range(60)]
    ids = list(range(1, 61))
    extra = {i: json.dumps({"price": p}) for i, p in zip(ids, prices, strict=True) if p is not None}
    table = FilterTable(ids, [f"{i}.png" for i in ids], labels, extra)
    rows = [{"id": float(i), "label": lab, "price": None if p is None else float(p)}
            for i, lab, p in zip(ids, labels, prices, strict=True)]
    for _ in range(300):
        text, evaluate = random_expression(rng)
        expected = [row["id"] for row in rows if evaluate(row) is True]
        assert table.matching(parse_filter(text)).tolist() == expected, text


@pytest.mark.parametrize(("text", "message"), [
    ("", "empty"),
    ('label = "cat" and', "expected a column name"),
    ('label == "cat"', "expected a quoted string or a number at position 8"),
    ('label = "cat"; DROP TABLE images', "unexpected character ';' at position 14"),
    ('(label = "cat"', "expected ')'"),
    ('label in ()', "expected a quoted string or a number"),
    ('label not "cat"', "expected 'in' after 'not'"),
    ("price = 1e999", "out of range"),
    ("(" * 40 + 'label = "a"' + ")" * 40, "nested deeper than 32"),
    ("label = 'x' or " * 300 + "label = 'y'", "characters; at most"),
    ("price in (" + ",".join(["1"] * 1001) + ")", "more than 1000 values"),
])
def test_malformed_expressions_name_the_problem(text, message):
    with pytest.raises(FilterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_filter(text)


@pytest.mark.parametrize(("text", "message"), [
    ('label == "cat"', "compare with one '=', not '=='"),
    ('price == 3', "compare with one '=', not '=='"),
    ('label = "cat" && price < 2', "'&&' at position 15 is not part of the language; write 'and' instead"),
    ('label = "cat" || price < 2', "'||' at position 15 is not part of the language; write 'or' instead"),
    ('!(label = "cat")', "'!' at position 1 is not part of the language; write 'not' instead"),
    ('! label = "cat"', "write 'not' instead"),
])
def test_another_languages_operator_is_refused_with_the_one_to_write(text, message):
    with pytest.raises(FilterError, match=message.replace("(", r"\(").replace("|", r"\|")):
        parse_filter(text)


def test_sqls_not_equal_is_not_equal():
    """``<>`` is SQL's spelling of ``!=``: accepted, with the same meaning."""
    table = FilterTable([1, 2, 3], ["a.png", "b.png", "c.png"], ["cat", "dog", None], {})
    assert table.matching(parse_filter('label <> "cat"')).tolist() == [2]
    assert parse_filter('label <> "cat"').root == parse_filter('label != "cat"').root


def test_strings_and_numbers_are_not_mixed_and_unknown_columns_are_named():
    table = FilterTable([1, 2], ["a.png", "b.png"], ["cat", None], {1: '{"price": 3}'})
    with pytest.raises(FilterError, match="column 'label' holds text; compare it with a quoted string"):
        table.matching(parse_filter("label = 3"))
    with pytest.raises(FilterError, match="column 'price' holds numbers"):
        table.matching(parse_filter("price = '3'"))
    with pytest.raises(FilterError, match="no column 'colour' in this index; the columns are: id, path, label, price"):
        table.matching(parse_filter("colour = 'red'"))
    assert table.matching(parse_filter("path = 'a.png'")).tolist() == [1]


# --- an index over a manifest with its own columns --------------------------------------------------------------
@pytest.fixture(scope="module")
def manifest_index(tmp_path_factory):
    """48 images; a manifest with label, split, colour (text, with a quote) and price (numbers) columns."""
    root = tmp_path_factory.mktemp("filters")
    rng = np.random.default_rng(0)
    lines = ["path,label,split,colour,price"]
    for i in range(48):
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(root / f"img_{i:02d}.png")
        colour = COLOURS[i % 4].replace('"', '""')
        price = "" if i % 7 == 0 else str(i % 12 + 0.5)
        lines.append(f'img_{i:02d}.png,class{i % 6},{"test" if i % 3 else "train"},"{colour}",{price}')
    (root / "manifest.csv").write_text("\n".join(lines) + "\n")
    build_index(root / "manifest.csv", root / "flat", embedder=FakeEmbedder(), options=QUICK, index_key="Flat")
    return root


def exact_top(index: Index, query: np.ndarray, matching: np.ndarray, k: int) -> list[int]:
    """The slow, obvious filtered top-k: every matching row's vector from faiss, scored, sorted."""
    vectors = np.stack([index.faiss_index.reconstruct(int(i)) for i in matching])
    order = np.argsort(-(vectors @ query), kind="stable")
    return [int(matching[j]) for j in order[:k]]


def test_manifest_columns_are_kept_and_typed(manifest_index):
    with Index.open(manifest_index / "flat") as index:
        table = index.filter_table
        assert table.names() == ["id", "path", "label", "split", "colour", "price"]
        assert not table.column("price").is_text and table.column("colour").is_text
        assert len(index.matching_ids("colour = \"it's\"")) == 12  # the quoted quote came through
        assert len(index.matching_ids('path = "img_03.png"')) == 1  # as results show it: relative to the gallery
        assert len(index.matching_ids("price > 11")) == sum(1 for i in range(48) if i % 7 and i % 12 + 0.5 > 11)
        assert len(index.matching_ids("price < 100")) == sum(1 for i in range(48) if i % 7)  # empty: missing


@pytest.mark.parametrize("where", [
    'split = "test"', 'colour in ("red", "blue") and price < 6', 'not (label = "class1") or price >= 10',
    'label = "class3" and split = "train"',
])
def test_flat_filtered_search_is_the_exact_top_k_of_the_matching_rows(manifest_index, where):
    embedder = FakeEmbedder()
    queries = embedder.embed([manifest_index / f"img_{i:02d}.png" for i in (1, 8, 30)])
    with Index.open(manifest_index / "flat", embedder=embedder) as index:
        matching = index.matching_ids(where)
        assert 0 < len(matching) < len(index)
        for query in queries:
            found = index.search(query[None], 5, where=where)[0]
            assert [r.id for r in found] == exact_top(index, query, matching, 5)
            assert all(r.id in set(matching.tolist()) for r in found)


def test_a_filter_matching_nothing_gives_no_results_and_exclusions_still_apply(manifest_index):
    embedder = FakeEmbedder()
    query = embedder.embed([manifest_index / "img_04.png"])
    with Index.open(manifest_index / "flat", embedder=embedder) as index:
        assert index.search(query, 5, where='label = "no such class"') == [[]]
        own = index.search(query, 1)[0][0].id
        found = index.search(query, 3, exclude_ids=(own,), where=f"id = {own} or label = 'class4'")[0]
        assert own not in [r.id for r in found] and len(found) == 3  # class4 has 8 images


def test_removed_images_are_not_matched(manifest_index, tmp_path):
    import shutil

    shutil.copytree(manifest_index / "flat", tmp_path / "flat")
    with Index.open(tmp_path / "flat") as index:
        target = int(index.matching_ids("label = 'class0'")[0])
    remove_images(tmp_path / "flat", ids=[target])
    with Index.open(tmp_path / "flat") as index:
        assert target not in index.matching_ids("label = 'class0'").tolist()


@pytest.mark.parametrize("key", ["IVF128,Flat", "IVF128,SQ8,RFlat", "HNSW32"])  # a refine wrapper; a graph
def test_filtered_recall_is_at_least_the_unfiltered_recall(key, monkeypatch):
    """On IVF and HNSW the filter goes through faiss' IDSelector with nprobe / efSearch widened by the selection's
    share: recall against the exact filtered top-k is at least the unfiltered search's recall against the exact
    top-k."""
    import faiss

    from retrieval.index.faiss_backend import faiss_params, faiss_search
    from retrieval.index.search import Index as SearchIndex

    monkeypatch.setattr(faiss_search, "EXACT_SELECTION_MAX", 0)  # the selector's path, also for small selections
    rng = np.random.default_rng(0)
    n, d, k = 20_000, 32, 10
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64) * 3 + 7  # catalogue ids are not faiss' positions
    index = faiss.index_factory(d, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add_with_ids(vectors, ids)
    faiss_params.set_search_params(index, {"efSearch": 16} if key.startswith("HNSW") else
                                {"nprobe": 4} | ({"k_factor": 4} if "RFlat" in key else {}))
    searcher = SearchIndex.__new__(SearchIndex)  # only the faiss part is needed
    searcher.faiss_index, searcher.info = index, IndexInfo.from_json({"embedding_dim": d})
    queries = rng.standard_normal((50, d)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    scores = queries @ vectors.T
    unfiltered_ids = ids[np.argsort(-scores, axis=1)[:, :k]]
    unfiltered = np.mean([len(set(f) & set(e)) / k for f, e in zip(index.search(queries, k)[1], unfiltered_ids,
                                                                    strict=True)])
    for share in (0.1, 0.01):
        rows = np.sort(rng.choice(n, int(n * share), replace=False))
        selected = ids[rows]
        _, found = searcher.search_selected(queries, k, selected)
        exact = [selected[np.argsort(-s[rows])[:k]] for s in scores]
        recall = np.mean([len(set(f) & set(e)) / k for f, e in zip(found, exact, strict=True)])
        assert set(found.ravel()) - {-1} <= set(selected.tolist())
        assert recall >= unfiltered, (share, recall, unfiltered)


def test_the_command_line_filters_and_names_bad_expressions(manifest_index, monkeypatch):
    from retrieval.cli.main import main

    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    query = str(manifest_index / "img_05.png")
    search = ["search", "--index", str(manifest_index / "flat"), "--model", "m.onnx", query]
    result = CliRunner().invoke(main, [*search, "-k", "4",
                                       "--where", "split = 'train' and price >= 2", "--json"])
    assert result.exit_code == 0, result.output
    answer = json.loads(result.output)[0]
    with Index.open(manifest_index / "flat") as index:
        allowed = set(index.matching_ids("split = 'train' and price >= 2").tolist())
    assert answer["results"] and all(r["id"] in allowed for r in answer["results"])
    shown = CliRunner().invoke(main, [*search, "--where",
                                      "label = 'class2'"])
    assert shown.exit_code == 0 and "--where matches 8 of 48 indexed images" in shown.output
    bad = CliRunner().invoke(main, [*search, "--where", "label =="])
    assert bad.exit_code == 2 and "expected a quoted string or a number" in bad.output
    unknown = CliRunner().invoke(main, [*search, "--where",
                                        "size > 3"])
    assert unknown.exit_code == 2 and "no column 'size' in this index" in unknown.output
    assert "Traceback" not in unknown.output and "FilterError" not in unknown.output


def test_post_filtering_keeps_only_selected_ids_in_score_order():
    """The fallback for an index faiss cannot filter: over-fetch, keep the selected ids, best first."""
    import faiss

    from retrieval.index.faiss_backend import faiss_search

    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((2000, 16)).astype(np.float32)
    index = faiss.index_factory(16, "IDMap2,Flat", faiss.METRIC_INNER_PRODUCT)
    index.add_with_ids(vectors, np.arange(2000, dtype=np.int64) * 2)
    selected = np.arange(0, 4000, 20, dtype=np.int64)  # 10 %
    query = rng.standard_normal((1, 16)).astype(np.float32)
    scores, ids = faiss_search.post_filtered_search(index, query, 7, selected)
    expected = selected[np.argsort(-(vectors[selected // 2] @ query[0]))[:7]]
    assert ids[0].tolist() == expected.tolist() and np.all(np.diff(scores[0]) <= 0)
    none = faiss_search.post_filtered_search(index, query, 3, np.array([1], dtype=np.int64))  # odd: not in the index
    assert none[1].tolist() == [[-1, -1, -1]]


def test_a_parquet_manifest_keeps_scalar_columns_only(tmp_path):
    """Strings and numbers become filter columns; a column of image bytes or records is neither read nor kept,
    and the kept columns are chosen once from the schema (not row by row)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from retrieval.index.sources import MAX_EXTRA_COLUMNS, list_gallery

    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(tmp_path / f"{i}.png")
    table = pa.table({
        "path": [f"{i}.png" for i in range(3)], "label": ["a", "b", "a"], "price": [1.5, 2.0, None],
        "count": [1, 2, 3], "image": [{"bytes": b"\x89PNG" * 100, "path": "x"}] * 3, "blob": [b"\x00" * 50] * 3,
        "bad name": ["x"] * 3,
    })
    pq.write_table(table, tmp_path / "m.parquet")
    gallery = list_gallery(tmp_path / "m.parquet")
    assert [item.extra for item in gallery.items] == [{"price": 1.5, "count": 1}, {"price": 2.0, "count": 2},
                                                      {"count": 3}]
    wide = pa.table({"path": ["0.png"], **{f"c{i}": [i] for i in range(MAX_EXTRA_COLUMNS + 10)}})
    pq.write_table(wide, tmp_path / "wide.parquet")
    assert len(list_gallery(tmp_path / "wide.parquet").items[0].extra) == MAX_EXTRA_COLUMNS


@pytest.mark.parametrize("key", ["HNSW32", "Flat"])
def test_a_small_selection_is_scored_exactly_from_the_stored_vectors(key):
    """Below EXACT_SELECTION_MAX rows an index that stores its vectors answers exactly: on HNSW, where a share of
    0.05 % would need more than the capped efSearch, the results equal the brute-force top-k."""
    import faiss

    from retrieval.index.faiss_backend import faiss_search
    from retrieval.index.search import Index as SearchIndex

    rng = np.random.default_rng(2)
    n, d, k = 20_000, 32, 10
    vectors = rng.standard_normal((n, d)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ids = np.arange(n, dtype=np.int64) * 5 + 11
    index = faiss.index_factory(d, f"IDMap2,{key}", faiss.METRIC_INNER_PRODUCT)
    index.add_with_ids(vectors, ids)
    searcher = SearchIndex.__new__(SearchIndex)
    searcher.faiss_index, searcher.info = index, IndexInfo.from_json({"embedding_dim": d})
    rows = np.sort(rng.choice(n, 10, replace=False))  # 0.05 %: exactly k rows
    queries = rng.standard_normal((20, d)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    scores, found = searcher.search_selected(queries, k, ids[rows])
    for query, got, got_scores in zip(queries, found, scores, strict=True):
        order = np.argsort(-(vectors[rows] @ query))
        assert got.tolist() == ids[rows][order].tolist()
        assert np.allclose(got_scores, (vectors[rows] @ query)[order], atol=1e-6)
    assert len(ids[rows]) <= faiss_search.EXACT_SELECTION_MAX
