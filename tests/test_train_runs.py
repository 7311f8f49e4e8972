"""Run folders (issue 28, point 6): a run without --out gets a new folder, a run that fails before training leaves
none behind, and report.json says how the classes were split and which metric chose best.pt."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retrieval.cli.main import main

DIGITS = ["train", "--dataset", "digits", "--dataset-param", "protocol=disjoint", "--dataset-param",
          "limit_per_class=20", "--backbone", "efficientnet_lite0", "--image-size", "32", "--freeze-backbone",
          "--embedding-dim", "16", "--batch-size", "16", "--per-class", "4", "--batches-per-epoch", "2", "--epochs",
          "1", "--workers", "0", "--device", "cpu", "--no-plots", "--no-tensorboard"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RETRIEVAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_runs_without_out_get_a_new_folder_each(in_tmp):
    first = CliRunner().invoke(main, DIGITS)
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(main, DIGITS)
    assert second.exit_code == 0, second.output  # the second run does not meet the first one's last.pt
    runs = sorted((in_tmp / "runs").iterdir())
    assert len(runs) == 2 and all((run / "report.json").is_file() for run in runs)
    assert json.loads(first.output[first.output.index("{\n  \"run\""):])["run"] == str(runs[0].relative_to(in_tmp))

    report = json.loads((runs[0] / "report.json").read_text())
    assert report["best_metric"] == "recall@1"
    split = report["class_split"]
    assert split["train"]["classes"] == 5 and split["test"]["classes"] == 5  # digits disjoint: 0-4 / 5-9
    assert split["train"]["class_names"] == ["0", "1", "2", "3", "4"] and split["shared_train_test_classes"] == 0
    assert split["train"]["images"] == 100 and "validation" not in split


def test_a_run_that_fails_before_training_leaves_no_folder(in_tmp):
    result = CliRunner().invoke(main, ["train", "--dataset", "folder", "--data", str(in_tmp / "missing"),
                                       "--out", "runs/typo", "--workers", "0", "--device", "cpu"])
    assert result.exit_code != 0
    assert not (in_tmp / "runs" / "typo").exists()
    (in_tmp / "kept").mkdir()
    (in_tmp / "kept" / "notes.txt").write_text("mine")
    CliRunner().invoke(main, ["train", "--dataset", "folder", "--data", str(in_tmp / "missing"), "--out", "kept",
                              "--workers", "0", "--device", "cpu"])
    assert (in_tmp / "kept" / "notes.txt").read_text() == "mine"  # a folder it did not make is left alone


def test_out_is_needed_under_torchrun_and_with_resume(in_tmp, monkeypatch):
    result = CliRunner().invoke(main, [*DIGITS, "--resume"])
    assert result.exit_code != 0 and "--resume continues a run: give its folder with --out" in result.output
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = CliRunner().invoke(main, DIGITS)
    assert result.exit_code != 0 and "under torchrun, give --out" in result.output
