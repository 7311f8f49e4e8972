"""A manifest's own columns: the one column that looks like labels is found (a category), never a title, a price, a
path or an identifier; it is decided on a bounded number of rows; a missing label column names the manifest's
columns; images a moved manifest names make one line with the count, the first three, the folder and the fix; the
rows kept are those whose image is there, each distinct path looked for once; ``SaidOnce`` says a key's line once."""

from __future__ import annotations

import itertools

import pytest

from retrieval.data.manifest_columns import (
    MAX_ROWS_LOOKED_AT,
    SaidOnce,
    label_candidate,
    missing_images_line,
    missing_label_column,
    no_labels_hint,
    present_rows,
)
from retrieval.errors import ParameterError

CATEGORIES = ["shoes", "bags", "hats", "shirts", "coats"]


def shop_rows(count: int = 60) -> list[dict[str, object]]:
    """A shop's manifest rows: a category, a free-text title, a price, a unique sku, a colour and a path."""
    return [{"path": f"img/p{n:03d}.png", "category": CATEGORIES[n % 5], "title": f"A soft {CATEGORIES[n % 5]} in "
             f"cotton, model {n}, with a long description", "price": f"{10 + n}.99", "sku": f"SKU-{n:05d}",
             "photo": f"photos/p{n % 7}.jpg"} for n in range(count)]


def test_the_category_column_is_the_candidate_and_free_text_numbers_ids_and_paths_are_not():
    rows = shop_rows()
    assert label_candidate(["path", "sku", "title", "price", "photo", "category"], rows) == "category"
    for column in ("title", "price", "sku", "photo"):
        assert label_candidate(["path", column], rows) is None, column


def test_numbers_as_numbers_are_never_labels():
    rows = [{"size": float(n % 3)} for n in range(30)]
    assert label_candidate(["size"], rows) is None


def test_a_column_with_a_value_per_row_or_one_value_or_mostly_empty_is_not_labels():
    assert label_candidate(["colour"], [{"colour": f"c{n}"} for n in range(40)]) is None  # all distinct
    assert label_candidate(["colour"], [{"colour": "red"} for _ in range(40)]) is None  # one class
    sparse = [{"colour": "red" if n < 4 else ""} | ({"colour": "blue"} if n in (5, 6) else {}) for n in range(40)]
    assert label_candidate(["colour"], sparse) is None  # empty in most rows


def test_two_label_like_columns_choose_the_one_named_like_labels_else_none():
    rows = [{"colour": ["red", "blue"][n % 2], "brand": ["acme", "zen", "kit"][n % 3],
             "category": CATEGORIES[n % 5]} for n in range(60)]
    assert label_candidate(["colour", "brand", "category"], rows) == "category"
    assert label_candidate(["colour", "brand"], rows) is None  # no name says which: nothing obvious


def test_the_candidate_reads_a_bounded_number_of_rows():
    consumed = itertools.count()

    def endless():
        for n in consumed:
            yield {"category": CATEGORIES[n % 5]}

    assert label_candidate(["category"], endless()) == "category"
    assert next(consumed) <= MAX_ROWS_LOOKED_AT + 1


def test_hostile_cells_are_cut_before_they_are_measured():
    rows = [{"category": CATEGORIES[n % 5] if n else "x" * 10_000_000} for n in range(100)]
    assert label_candidate(["category"], rows) is None  # one value far too long for a label: not a category


def test_the_hint_names_the_candidate_with_the_core_parameter_name():
    hint = no_labels_hint(["path", "category", "title"], shop_rows())
    assert hint == ("the manifest has no 'label' column; its 'category' column looks like one: use `label_column` "
                    "category")
    assert "--" not in hint
    assert "`label_column`" in no_labels_hint(["path", "title"], shop_rows())


def test_a_missing_label_column_names_the_manifest_columns():
    error = missing_label_column("cat", ["path", "category", "title"], "/shop/manifest.csv")
    assert isinstance(error, ParameterError) and error.param == "label_column"
    assert "'cat'" in error.problem and "/shop/manifest.csv" in error.problem
    assert "path, category, title" in error.problem


@pytest.mark.parametrize("count", [1, 3, 319])
def test_missing_images_make_one_line_with_the_count_the_first_three_the_folder_and_the_fix(tmp_path, count):
    manifest = tmp_path / "moved" / "manifest.csv"
    missing = [str(tmp_path / "moved" / "img" / f"p{n:03d}.png") for n in range(count)]
    line = missing_images_line(missing, 321, manifest)
    assert "\n" not in line
    assert line.startswith(f"{count} of the 321 images listed in manifest {manifest} are missing: ")
    assert ", ".join(f"p{n:03d}.png" for n in range(min(count, 3))) in line
    assert "p003.png" not in line and (f"and {count - 3} more" in line) == (count > 3)
    assert f"looked for in {tmp_path / 'moved' / 'img'}" in line
    assert "move the manifest back beside its images" in line and "relative to the manifest's folder" in line


def test_a_hostile_file_name_is_escaped_in_the_line(tmp_path):
    line = missing_images_line([str(tmp_path / "a\nb.png")], 1, tmp_path / "m.csv")
    assert "\n" not in line and "a\\nb.png" in line


def test_present_rows_keeps_each_row_whose_image_is_there_and_counts_every_row_naming_a_missing_one(tmp_path):
    for name in ("a.png", "c.png"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "folder.png").mkdir()  # a folder is no image file
    names = ["a.png", "b.png", "c.png", "b.png", "folder.png", "a.png", "d.png"]
    paths = [str(tmp_path / n) for n in names] + ["https://example.com/e.png"]  # a URL is never looked for
    present = present_rows(paths, tmp_path / "manifest.csv")
    reference = [n for n, path in enumerate(paths) if "://" in path or (tmp_path / names[n]).is_file()]
    assert present.kept == reference == [0, 2, 5, 7]
    assert present.missing == {str(tmp_path / n) for n in ("b.png", "folder.png", "d.png")}
    missing_rows = [p for n, p in enumerate(paths) if n not in reference]
    assert present.line == missing_images_line(missing_rows, 8, tmp_path / "manifest.csv")
    assert present.line.startswith("4 of the 8 images listed in manifest")  # rows, the repeated one twice


def test_present_rows_of_a_manifest_whose_images_are_all_there_has_no_line(tmp_path):
    (tmp_path / "a.png").write_bytes(b"x")
    present = present_rows([str(tmp_path / "a.png")] * 3)
    assert present.kept == [0, 1, 2] and not present.missing and present.line == ""
    assert present_rows([]).kept == [] and present_rows([]).line == ""


def test_present_rows_looks_for_each_distinct_path_once(tmp_path, monkeypatch):
    import os

    looked: list[str] = []
    real = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: looked.append(p) or real(p))
    paths = [str(tmp_path / f"p{n % 5}.png") for n in range(1000)]
    present = present_rows(paths)
    assert sorted(looked) == sorted(set(paths)) and present.kept == [] and "1000 of the 1000" in present.line


def test_said_once_says_each_key_once_and_forgets_the_oldest_beyond_its_bound(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(SaidOnce, "MAX_KEYS", 3)
    said = SaidOnce(lines.append)
    assert said("a", "line a") and not said("a", "line a again")
    for key in ("b", "c", "d"):  # "a" is the oldest: forgotten at the fourth key
        said(key, f"line {key}")
    assert not said("d", "again") and said("a", "line a, said again")
    assert lines == ["line a", "line b", "line c", "line d", "line a, said again"]
