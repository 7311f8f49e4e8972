"""`retrieval index build --label-column`: a shop's manifest (path,category,title,price) builds "with no labels" and
names its category column as the fix, in the line and in --json; --label-column category labels the images by it,
index.json records it and `index add` reads the added manifest's labels from it; a column the manifest lacks is
refused naming its columns. A manifest moved away from its images is refused in one line before anything is
embedded (how many, the first three, where they were looked for, the fix); some missing make one warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from sample_images import noisy_png
from shop_gallery import CATEGORIES
from shop_gallery import write_category_shop as write_shop

from retrieval.cli.main import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_projection_onnx(tmp_path_factory.mktemp("model") / "model.onnx", dim=8)


def build(model, manifest, out, *extra):
    return CliRunner().invoke(main, ["index", "build", "--model", str(model), "--images", str(manifest), "--out",
                                     str(out), "--workers", "0", *extra])


def test_a_manifest_without_labels_names_its_category_column_in_the_line_and_in_json(model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    result = build(model, manifest, tmp_path / "idx")
    assert result.exit_code == 0, result.output
    hint = ("no labels: the manifest has no 'label' column; its 'category' column looks like one: use "
            "--label-column category")
    assert hint in result.stdout
    as_json = build(model, manifest, tmp_path / "idx-json", "--json")
    labels = json.loads(as_json.stdout)["labels"]
    assert labels["classes"] == 0 and labels["hint"] == hint.removeprefix("no labels: ")


def test_a_manifest_without_a_category_like_column_is_told_to_name_its_label_column(model, tmp_path):
    plain = write_shop(tmp_path / "plain", header=("path", "title", "price"))
    result = build(model, plain, tmp_path / "idx")
    assert result.exit_code == 0, result.output
    assert "looks like one" not in result.stdout and "--label-column" in result.stdout  # names the option only


def test_label_column_labels_by_that_column_and_index_add_reads_the_recorded_one(model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    result = build(model, manifest, tmp_path / "idx", "--label-column", "category")
    assert result.exit_code == 0, result.output
    assert "3 classes from the manifest's category column" in result.stdout
    assert json.loads((tmp_path / "idx" / "index.json").read_text())["label_column"] == "category"
    from retrieval.index import CatalogueReader

    with CatalogueReader(tmp_path / "idx" / "catalogue.sqlite") as catalogue:
        assert catalogue.label_counts() == {"shoes": 4, "bags": 4, "hats": 4}

    more = tmp_path / "more"
    (more / "img").mkdir(parents=True)
    (more / "img" / "new.png").write_bytes(noisy_png((1, 250, 3), 99, size=16))
    (more / "add.csv").write_text("path,category\nimg/new.png,scarves\n")
    added = CliRunner().invoke(main, ["index", "add", str(tmp_path / "idx"), "--images", str(more / "add.csv"),
                                      "--workers", "0", "--json"])
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["labels"]["largest_classes"] == {"scarves": 1}
    with CatalogueReader(tmp_path / "idx" / "catalogue.sqlite") as catalogue:
        assert catalogue.label_counts()["scarves"] == 1

    (more / "other.csv").write_text("path,kind\nimg/new.png,scarves\n")
    refused = CliRunner().invoke(main, ["index", "add", str(tmp_path / "idx"), "--images", str(more / "other.csv")])
    assert refused.exit_code == 1 and "reads its labels from the manifest column 'category'" in refused.output
    assert "path, kind" in refused.output and "Traceback" not in refused.output


def test_a_label_column_the_manifest_lacks_is_refused_naming_its_columns(model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    result = build(model, manifest, tmp_path / "idx", "--label-column", "cat")
    assert result.exit_code == 1
    assert "--label-column names 'cat', which is no column of manifest" in result.output
    assert "its columns are: path, category, title, price" in result.output
    assert not (tmp_path / "idx" / "index.json").exists()


def test_label_column_with_a_folder_of_images_is_refused(model, tmp_path):
    write_shop(tmp_path / "shop")
    result = build(model, tmp_path / "shop" / "img", tmp_path / "idx", "--label-column", "category")
    assert result.exit_code == 1 and "--label-column names a manifest's column" in result.output


def build_from_a_moved_manifest(model, tmp_path, folder: str, count: int) -> tuple[Path, str]:
    """Build from a copy of a shop's manifest in ``folder``, away from its images: (that folder, the one line)."""
    write_shop(tmp_path / "shop", count=count)
    moved = tmp_path / folder
    moved.mkdir()
    (moved / "manifest.csv").write_text((tmp_path / "shop" / "manifest.csv").read_text())
    result = build(model, moved / "manifest.csv", tmp_path / "idx")
    assert result.exit_code == 1 and "Traceback" not in result.output
    [line] = [line for line in result.output.splitlines() if line.strip()]
    return moved, line


def test_a_moved_manifest_is_refused_in_one_line_before_anything_is_embedded(model, tmp_path):
    moved, line = build_from_a_moved_manifest(model, tmp_path, "elsewhere", count=30)
    assert "30 of the 30 images listed in manifest" in line and "p00.png, p01.png, p02.png and 27 more" in line
    assert f"looked for in {moved / 'img'}" in line and "move the manifest back beside its images" in line
    assert not list((tmp_path / "idx").glob("shards/*"))


def test_a_moved_manifest_in_a_folder_named_with_a_backslash_is_named_escaped_once(model, tmp_path):
    from retrieval.utils.printable import printable_path

    moved, line = build_from_a_moved_manifest(model, tmp_path, "back\\slash", count=4)
    assert f"listed in manifest {printable_path(moved / 'manifest.csv')} are missing" in line  # back\\slash
    assert f"relative to its folder ({printable_path(moved)})" in line and "back\\\\\\\\slash" not in line


def test_some_missing_images_make_one_warning_and_the_rest_is_indexed(model, tmp_path, caplog):
    manifest = write_shop(tmp_path / "shop", count=12)
    for n in range(5):
        (tmp_path / "shop" / "img" / f"p{n:02d}.png").unlink()
    caplog.set_level(logging.WARNING, logger="retrieval")
    result = build(model, manifest, tmp_path / "idx", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["indexed"] == 7
    lines = [r.getMessage() for r in caplog.records if "are missing" in r.getMessage()]
    assert len(lines) == 1 and "5 of the 12 images" in lines[0]


def test_repair_relabels_from_the_recorded_label_column(model, tmp_path):
    manifest = write_shop(tmp_path / "shop")
    assert build(model, manifest, tmp_path / "idx", "--label-column", "category").exit_code == 0
    for rule, classes in (("none", 0), ("manifest", 3)):
        repaired = CliRunner().invoke(main, ["index", "repair", str(tmp_path / "idx"), "--label-from", rule,
                                             "--workers", "0", "--json"])
        assert repaired.exit_code == 0, repaired.output
        assert json.loads(repaired.stdout)["labels"]["classes"] == classes


def test_a_parquet_manifest_reads_its_labels_from_the_named_column_and_hints_at_it(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    from retrieval.index.sources import label_summary, list_gallery

    write_shop(tmp_path)
    table = pa.table({"path": [f"img/p{n:02d}.png" for n in range(12)],
                      "category": [CATEGORIES[n % 3] for n in range(12)], "price": [float(n) for n in range(12)]})
    pq.write_table(table, tmp_path / "shop.parquet")
    labelled = list_gallery(tmp_path / "shop.parquet", label_column="category")
    assert label_summary(labelled, "manifest")["classes"] == 3
    plain = label_summary(list_gallery(tmp_path / "shop.parquet"), "manifest")
    assert plain["classes"] == 0 and "use `label_column` category" in plain["hint"]


def test_an_index_built_with_the_default_column_records_none_and_repairs_by_any_rule(model, tmp_path):
    """The default column is not recorded (index.json as an index built before the option), and `index repair
    --label-from` relabels an index whose manifest has no 'label' column without naming one."""
    manifest = write_shop(tmp_path / "shop")
    assert build(model, manifest, tmp_path / "idx").exit_code == 0
    assert "label_column" not in json.loads((tmp_path / "idx" / "index.json").read_text())
    for rule in ("none", "manifest"):
        repaired = CliRunner().invoke(main, ["index", "repair", str(tmp_path / "idx"), "--label-from", rule])
        assert repaired.exit_code == 0, repaired.output
    labelled = write_shop(tmp_path / "labelled", header=("path", "category"))
    labelled.write_text(labelled.read_text().replace("path,category", "path,label", 1))
    as_json = build(model, labelled, tmp_path / "idx-labelled", "--json")
    assert as_json.exit_code == 0, as_json.output
    assert "label_column" not in json.loads(as_json.stdout)["labels"]
    assert "label_column" not in json.loads((tmp_path / "idx-labelled" / "index.json").read_text())
