"""`retrieval train` and `retrieval evaluate` on a shop's manifest (path,category,title,price): --label-column category
trains on those classes and evaluate reads the checkpoint's column again; a manifest without labels is refused with
the column that looks like them (in the command's words: --label-column); a named column it lacks names its columns;
a manifest moved away from its images is refused in one line, and some missing images make one warning."""

from __future__ import annotations

import json
import logging

import pytest
from click.testing import CliRunner
from shop_gallery import write_category_shop

from retrieval.cli.main import main
from retrieval.data import load_dataset
from retrieval.errors import ParameterError
from retrieval.train.config import TrainConfig

CATEGORIES = ("shoes", "bags", "hats", "coats")


def write_shop(folder, per_class=10):
    """The shop's manifest (``write_category_shop``) with ``per_class`` images of each of the four categories."""
    return write_category_shop(folder, per_class * len(CATEGORIES), categories=CATEGORIES)


def test_the_csv_data_set_reads_its_labels_from_the_named_column(tmp_path):
    manifest = write_shop(tmp_path)
    data = load_dataset("csv", manifest, split="train", protocol="standard", label_column="category")
    assert sorted(set(data.class_names)) == sorted(CATEGORIES)
    assert len(data) + len(load_dataset("csv", manifest, split="test", protocol="standard",
                                        label_column="category")) == 40


def test_a_manifest_without_labels_is_refused_naming_the_column_that_looks_like_them(tmp_path):
    manifest = write_shop(tmp_path)
    with pytest.raises(ValueError, match="its 'category' column looks like one: use `label_column` category"):
        load_dataset("csv", manifest, split="train", protocol="standard")
    with pytest.raises(ParameterError, match="its columns are: path, category, title") as caught:
        load_dataset("csv", manifest, split="train", protocol="standard", label_column="kind")
    assert caught.value.param == "label_column"


def test_a_moved_manifest_is_refused_in_one_line_and_some_missing_images_warn_once(tmp_path, caplog):
    manifest = write_shop(tmp_path / "shop")
    moved = tmp_path / "moved" / "manifest.csv"
    moved.parent.mkdir()
    moved.write_text(manifest.read_text())
    with pytest.raises(FileNotFoundError) as caught:
        load_dataset("csv", moved, split="train", protocol="standard", label_column="category")
    said = str(caught.value)
    assert "\n" not in said and "40 of the 40 images listed in manifest" in said and "and 37 more" in said
    assert f"looked for in {moved.parent / 'img'}" in said and "move the manifest back beside its images" in said

    for n in range(3):
        (tmp_path / "shop" / "img" / f"p{len(CATEGORIES) * n:02d}.png").unlink()  # three shoes
    caplog.set_level(logging.WARNING, logger="retrieval")
    train = load_dataset("csv", manifest, split="train", protocol="standard", label_column="category")
    test = load_dataset("csv", manifest, split="test", protocol="standard", label_column="category")
    assert len(train) + len(test) == 37
    lines = [r.getMessage() for r in caplog.records if "are missing" in r.getMessage()]
    assert len(lines) == 1 and "3 of the 40 images" in lines[0]


def test_the_label_column_is_the_loader_keyword_and_applies_to_csv_only(tmp_path):
    config = TrainConfig(dataset="csv", data=str(tmp_path), label_column="category",
                         dataset_kwargs={"protocol": "standard"})
    assert config.dataset_kwargs == {"protocol": "standard", "label_column": "category"}
    given = TrainConfig(dataset="csv", label_column="category", dataset_kwargs={"label_column": "kind"})
    assert given.dataset_kwargs["label_column"] == "category"  # the option beats the generic --dataset-param
    with pytest.raises(ParameterError, match="^label_column names a manifest's column: it applies to the csv data"):
        load_dataset("digits", split="train", label_column="category")


def train_args(manifest, run, *extra):
    return ["train", "--dataset", "csv", "--data", str(manifest), "--dataset-param", "protocol=standard",
            "--no-pretrained", "--freeze-backbone", "--image-size", "32", "--embedding-dim", "8", "--epochs", "1",
            "--batch-size", "8", "--per-class", "2", "--device", "cpu", "--workers", "0", "--no-plots",
            "--no-tensorboard", "--val-fraction", "0", "--feature-cache", str(run.parent / "cache"), "--out",
            str(run), *extra]


def test_train_without_labels_says_use_label_column_and_a_moved_manifest_in_one_line(tmp_path):
    manifest = write_shop(tmp_path / "shop", per_class=3)
    result = CliRunner().invoke(main, train_args(manifest, tmp_path / "run"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "its 'category' column looks like one: use --label-column category" in result.output

    moved = tmp_path / "moved" / "manifest.csv"
    moved.parent.mkdir()
    moved.write_text(manifest.read_text())
    result = CliRunner().invoke(main, train_args(moved, tmp_path / "run2", "--label-column", "category"))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "12 of the 12 images listed in manifest" in result.output and "move the manifest back" in result.output


def test_train_with_label_column_then_evaluate_reads_the_checkpoint_column(tmp_path):
    manifest = write_shop(tmp_path / "shop")
    run = tmp_path / "run"
    trained = CliRunner().invoke(main, train_args(manifest, run, "--label-column", "category", "--dataset-param",
                                                  "test_size=0.5", "--json"))
    assert trained.exit_code == 0, trained.output
    report = json.loads((run / "report.json").read_text())
    assert report["config"]["train"]["label_column"] == "category"
    evaluated = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(run / "last.pt"), "--no-pictures",
                                          "--device", "cpu", "--workers", "0", "--json"])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads(evaluated.stdout)["recall@1"] >= 0
    refused = CliRunner().invoke(main, ["evaluate", "--checkpoint", str(run / "last.pt"), "--no-pictures",
                                        "--device", "cpu", "--label-column", "kind"])
    assert refused.exit_code == 1 and "--label-column names 'kind'" in refused.output


def test_evaluating_on_another_data_set_leaves_the_trained_data_sets_options_behind():
    from retrieval.metrics.evaluation import checkpoint_dataset
    from retrieval.records.run_config import RunConfig

    trained = RunConfig.from_json({"dataset": "csv", "data": "shop.csv",
                                   "dataset_kwargs": {"label_column": "category"}})
    assert checkpoint_dataset(trained, None, None) == ("csv", "shop.csv", {"label_column": "category"})
    assert checkpoint_dataset(trained, "folder", "photos", {"protocol": "standard"}) == (
        "folder", "photos", {"protocol": "standard"})
