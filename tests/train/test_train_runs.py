"""Run folders: a run without --out gets a new folder, a run that fails before training leaves
none behind, and report.json says how the classes were split and which metric chose best.pt."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from retrieval.cli.main import main

DIGITS = ["train", "--dataset", "digits", "--dataset-param", "protocol=disjoint", "--dataset-param",
          "limit_per_class=20", "--backbone", "efficientnet_lite0", "--image-size", "32", "--freeze-backbone",
          "--embedding-dim", "16", "--batch-size", "16", "--per-class", "4", "--batches-per-epoch", "2", "--epochs",
          "1", "--workers", "0", "--device", "cpu", "--no-plots", "--no-tensorboard", "--val-fraction", "0"]


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RETRIEVAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_runs_without_out_get_a_new_folder_each(in_tmp):
    first = CliRunner().invoke(main, [*DIGITS, "--json"])
    assert first.exit_code == 0, first.output
    second = CliRunner().invoke(main, DIGITS)
    assert second.exit_code == 0, second.output  # the second run does not meet the first one's last.pt
    runs = sorted((in_tmp / "runs").iterdir())
    assert len(runs) == 2 and all((run / "report.json").is_file() for run in runs)
    # without --json: one line for people, then the next command
    folder = runs[1].relative_to(in_tmp)
    assert second.stdout.splitlines()[-2].startswith(f"trained {folder}: recall@1 ")
    # the model to export: the run's, or the pretrained export where the run did not beat it
    kept = json.loads((runs[1] / "report.json").read_text())["keep_pretrained"]
    assert second.stdout.splitlines()[-1] == (
        "next: retrieval export --pretrained efficientnet_lite0 --resize crop --image-size 32 --out model.onnx   "
        f"(the pretrained export; the trained model is in {folder}/best.pt)" if kept else
        f"next: retrieval export --checkpoint {folder}/best.pt --out {folder}/model.onnx")
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


def test_the_loss_is_logged_and_drawn_per_step(tmp_path):
    from retrieval.reports import read_steps
    from retrieval.serve.report_files import load_report
    from retrieval.serve.report_plots import curves_plot
    from retrieval.train import TrainConfig, train
    from retrieval.train.checkpointing import atomic_save
    from retrieval.train.trainer import Trainer

    def config(**overrides):
        return TrainConfig(dataset="digits", dataset_kwargs={"protocol": "disjoint", "limit_per_class": 20},
                           backbone="efficientnet_lite0", image_size=32, freeze_backbone=True, embedding_dim=16,
                           batch_size=16, per_class=4, batches_per_epoch=4, epochs=2, workers=0, device="cpu",
                           out=str(tmp_path / "run"), feature_cache=str(tmp_path / "cache"), tensorboard=False,
                           **overrides)

    partial = Trainer(config(), progress=False)  # epoch 1 saved, epoch 2 half-done when "killed"
    partial.setup()
    row = {"epoch": 1, **partial.train_epoch(0)}
    partial.record.history.append(row)
    atomic_save(partial.checkpoint(1, row), tmp_path / "run" / "last.pt")
    partial.train_epoch(1)
    report = train(config(resume=True), progress=False)
    steps = read_steps(tmp_path / "run")
    assert [r["step"] for r in steps] == list(range(1, 9))  # the re-done steps once each
    assert [r["epoch"] for r in steps] == [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0]
    assert sum(r["loss"] for r in steps[4:]) / 4 == pytest.approx(report["last"]["loss"], rel=1e-6)
    assert curves_plot(load_report(tmp_path / "run" / "report.json")) is not None
