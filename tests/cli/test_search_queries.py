"""`retrieval search`'s queries: a missing file is an answered error, a folder is its images, and both are bounded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from retrieval.cli.main import main


def search(artifacts, *args: str):
    """`retrieval search --index INDEX -k 2 ARGS` through CliRunner."""
    return CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "-k", "2", *args])


def test_a_missing_query_is_named_with_its_reason_and_the_others_are_answered(artifacts, tmp_path):
    first, second = (str(path) for path in artifacts.query_paths[:2])
    missing = tmp_path / "missing.png"
    result = search(artifacts, first, str(missing), second)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == str(Path(first).resolve()) and lines[1].startswith("    1  ")
    assert lines[3] == str(missing.resolve()) and lines[4] == "  cannot search with it: no such file; check the path"
    assert lines[5] == str(Path(second).resolve()) and lines[6].startswith("    1  ")
    assert "1 of 3 queries could not be read" in result.output and str(missing.resolve()) in lines[-1]
    assert "Traceback" not in result.output

    as_json = search(artifacts, "--json", first, str(missing), second)
    assert as_json.exit_code == 1
    payload = json.loads(as_json.stdout)
    assert [answer["query"] for answer in payload] == [str(Path(first).resolve()), str(missing.resolve()),
                                                       str(Path(second).resolve())]
    assert len(payload[0]["results"]) == 2 and len(payload[2]["results"]) == 2
    assert payload[1] == {"query": str(missing.resolve()), "error": "no such file; check the path"}


def test_a_folder_query_searches_with_each_image_in_it_sorted_and_bounded(artifacts, tmp_path):
    folder = tmp_path / "queries"
    (folder / "deeper").mkdir(parents=True)
    shutil.copy(artifacts.query_paths[0], folder / "deeper" / "a.png")
    shutil.copy(artifacts.query_paths[1], folder / "b.PNG")
    shutil.copy(artifacts.query_paths[2], folder / "a.png")
    (folder / "notes.txt").write_text("not an image")
    result = search(artifacts, "--json", str(folder))
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    names = [str((folder / name).resolve()) for name in ("a.png", "b.PNG", "deeper/a.png")]
    assert [answer["query"] for answer in payload] == sorted(names)
    assert all(len(answer["results"]) == 2 for answer in payload)

    refused = search(artifacts, "--max-queries", "2", str(folder))
    assert refused.exit_code == 2 and "more than 2 query images" in refused.output
    assert "pass fewer images" in refused.output and "--max-queries" in refused.output

    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "sub" / "notes.txt").write_text("not an image")
    told = search(artifacts, str(artifacts.query_paths[0]), str(empty))
    assert told.exit_code == 1, told.output
    assert "a folder with no image in it" in told.output and ".png" in told.output
    assert "1 of 2 queries could not be read" in told.output
