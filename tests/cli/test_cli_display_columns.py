"""Display columns on the command line: `index build --display-columns` (checked against the manifest before any
image is read) and its defaults, `index columns` to list and change them, and `retrieval search` showing each result's
title and price (text) or its ``columns`` (--json), the path where the index shows none."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from shop_gallery import write_plain_shop, write_shop

from retrieval.cli.main import main


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli-shop")
    return write_shop(root / "shop"), write_projection_onnx(root / "model.onnx", dim=16), root


def run(*args: str):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert "Traceback" not in result.output, result.output
    return result


def build(shop, out, *extra: str):
    manifest, model, _ = shop
    return run("index", "build", "--model", model, "--images", manifest, "--out", out, "--workers", "0", *extra)


def test_a_build_shows_the_title_and_price_and_search_prints_them(shop, tmp_path):
    manifest, _, _ = shop
    built = build(shop, tmp_path / "index")
    assert built.exit_code == 0, built.output
    assert "results show: title, price" in built.output
    query = manifest.parent / "red" / "red_0.png"
    result = run("search", "--index", tmp_path / "index", query, "-k", "2")
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[1]
    assert "Red kettle #0 · 10.0  (red/red_0.png)" in first, result.output
    answer = json.loads(run("search", "--index", tmp_path / "index", query, "-k", "2", "--json").output)
    assert answer[0]["results"][0]["columns"] == {"title": "Red kettle #0", "price": "10.0"}
    assert answer[0]["results"][0]["path"] == "red/red_0.png"


def test_an_unknown_display_column_is_refused_before_any_image_is_read(shop, tmp_path):
    result = build(shop, tmp_path / "index", "--display-columns", "title,colour")
    assert result.exit_code != 0
    assert ("--display-columns names 'colour', which is no manifest column of the index; the columns are: title, "
            "price, brand, sku") in result.output, result.output
    assert not (tmp_path / "index").exists()


def test_index_columns_lists_changes_and_clears_them(shop, tmp_path):
    manifest, _, _ = shop
    assert build(shop, tmp_path / "index", "--display-columns", "sku").exit_code == 0
    listed = run("index", "columns", tmp_path / "index")
    assert listed.exit_code == 0
    assert "keeps the manifest columns: brand, price, sku, title; every answer shows: sku" in listed.output
    changed = run("index", "columns", tmp_path / "index", "--display-columns", "title, brand", "--json")
    assert json.loads(changed.output)["display_columns"] == ["title", "brand"]
    query = manifest.parent / "green" / "green_1.png"
    line = run("search", "--index", tmp_path / "index", query, "-k", "1").output.splitlines()[1]
    # the title's newline, escape and bidi override are spaces: one line, nothing that moves the cursor
    assert line.endswith("Line one Line two [31m txet desrever end · brand: Acme  (green/green_1.png)"), line
    assert "\x1b" not in line and "\u202e" not in line
    refused = run("index", "columns", tmp_path / "index", "--display-columns", "nope")
    assert refused.exit_code != 0 and "the columns are: brand, price, sku, title" in refused.output
    cleared = run("index", "columns", tmp_path / "index", "--display-columns", "")
    assert "shows: none (results show their paths)" in cleared.output
    line = run("search", "--index", tmp_path / "index", query, "-k", "1").output.splitlines()[1]
    assert line.endswith("label=green  green/green_1.png"), line
    answer = json.loads(run("search", "--index", tmp_path / "index", query, "-k", "1", "--json").output)
    assert "columns" not in answer[0]["results"][0]


def test_a_folder_gallery_has_no_columns_and_shows_paths(shop, tmp_path):
    _, model, _ = shop
    folder = write_plain_shop(tmp_path / "plain")
    built = run("index", "build", "--model", model, "--images", folder, "--out", tmp_path / "index", "--workers", "0")
    assert built.exit_code == 0 and "results show: none (results show their paths)" in built.output, built.output
    refused = run("index", "build", "--model", model, "--images", folder, "--out", tmp_path / "other",
                  "--display-columns", "title")
    assert refused.exit_code != 0 and "keeps no manifest columns" in refused.output, refused.output
    line = run("search", "--index", tmp_path / "index", folder / "red" / "red_0.png", "-k", "1").output.splitlines()[1]
    assert line.endswith("label=red  red/red_0.png"), line
