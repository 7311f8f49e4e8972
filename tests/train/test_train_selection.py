"""Choosing best.pt honestly: on a validation split carved from the train split (whole classes, or a share of each
class's images where the classes are few or shared with the test), with the test split evaluated before and after
training only; without one, best.pt is the last epoch, said in the report, the summary and the app. The test split
never chooses."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from run_files import read_jsonl
from train_configs import digits_config

from retrieval.analysis.runs import Run
from retrieval.analysis.runs import curve_panels as run_curve_panels
from retrieval.cli.main import main
from retrieval.data import ImageDataset
from retrieval.records.run_config import RunFolderConfig
from retrieval.serve.report_plots import curve_panels
from retrieval.train import train
from retrieval.train.config import DEFAULT_VAL_FRACTION, DEFAULT_VAL_MIN_CLASSES
from retrieval.train.data import carve_validation
from retrieval.train.evaluating import Evaluator
from retrieval.train.state import TIMING_KEYS
from retrieval.train.trainer import Trainer


@pytest.fixture(scope="module")
def feature_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("features"))


def classes(names: list[str], each: int = 2) -> ImageDataset:
    """``each`` tiny images of each named class, each its own array (told apart by identity)."""
    images = [np.zeros((4, 4), np.uint8) for _ in range(each * len(names))]
    return ImageDataset(images, np.repeat(np.arange(len(names)), each), names)


def test_whole_classes_are_held_out_where_there_are_enough_and_none_is_in_the_test_split():
    many = [f"c{i}" for i in range(DEFAULT_VAL_MIN_CLASSES)]
    carved = carve_validation(None, classes(many, 6), classes(["t1", "t2"]), seed=0)
    assert carved.by == "classes" and carved.none_because is None
    held = {carved.validation.class_names[label] for label in carved.validation.labels}
    assert len(held) == max(2, round(DEFAULT_VAL_FRACTION * len(many)))
    assert not held & {carved.train.class_names[label] for label in carved.train.labels}


@pytest.mark.parametrize("case", ["few classes", "classes shared with the test split", "asked, shared"])
def test_images_of_every_train_class_are_held_out_where_classes_are_few_or_shared_with_the_test(case):
    names = [f"c{i}" for i in range(DEFAULT_VAL_MIN_CLASSES if case != "few classes" else 5)]
    train_set = classes(names, 10)
    test = classes(["t1", "t2"]) if case == "few classes" else classes(names[:3])
    carved = carve_validation(0.2 if case == "asked, shared" else None, train_set, test, seed=0)
    assert carved.by == "images" and carved.none_because is None
    # every class trains and gives 2 images at least to validation (each needs another of its class to find)
    assert np.bincount(carved.validation.labels).min() >= 2
    assert set(carved.train.class_names) == set(names) == set(carved.validation.class_names)
    assert len(carved.train) + len(carved.validation) == len(train_set)
    assert not {id(s) for s in carved.train.samples} & {id(s) for s in carved.validation.samples}
    again = carve_validation(0.2 if case == "asked, shared" else None, train_set, test, seed=0)
    assert [id(s) for s in again.validation.samples] == [id(s) for s in carved.validation.samples]


def test_a_class_gives_validation_images_only_where_a_batch_can_still_take_its_per_class_images():
    train_set = classes(["a", "b", "c", "d"], 7)
    carved = carve_validation(None, train_set, classes(["a"]), seed=0, per_class=4)
    assert carved.by == "images" and np.bincount(carved.train.labels).min() >= 4
    small = carve_validation(None, classes(["a", "b", "c"], 5), classes(["a"]), seed=0, per_class=4)
    assert small.validation is None and "6 or more (2 to validate, 4 left for a batch)" in small.none_because


def test_without_images_to_spare_or_when_turned_off_there_is_no_validation_and_it_says_why():
    tiny = carve_validation(None, classes(["a", "b", "c"], 3), classes(["a"]), seed=0)
    assert tiny.validation is None and "too few images per class" in tiny.none_because
    off = carve_validation(0.0, classes(["a", "b"], 10), classes(["t"]), seed=0)
    assert off.validation is None and off.none_because == "--val-fraction 0 turned it off"


def test_best_pt_is_chosen_on_validation_and_the_test_split_is_evaluated_before_and_after_only(
        tmp_path, feature_cache, monkeypatch):
    # validation and test disagree: validation's best is epoch 2; the test's own numbers would pick epoch 1
    validation = iter([0.5, 0.2, 0.9, 0.3])  # epochs 0 (before), 1, 2, 3
    monkeypatch.setattr(Evaluator, "validate", lambda self: {"recall@1": (v := next(validation)), "map@r": v})
    tests = iter([0.4, 0.95, 0.1, 0.2])  # what the test split would say at each epoch, were it asked
    real_evaluate = Evaluator.evaluate
    calls = []

    def evaluate(self, probe=False):
        calls.append(probe)
        return {**real_evaluate(self, probe), "recall@1": next(tests)}

    monkeypatch.setattr(Evaluator, "evaluate", evaluate)
    run = tmp_path / "run"
    report = train(digits_config(run, feature_cache, val_fraction=0.2), progress=False)

    assert calls == [True, True]  # the test split: before training and after the last epoch, nothing between
    rows = read_jsonl(run / "metrics.jsonl")
    assert [r["epoch"] for r in rows if "recall@1" in r] == [0, 3]
    assert [r["validation"]["recall@1"] for r in rows] == [0.5, 0.2, 0.9, 0.3]
    # the app's training curves and `runs compare` draw the validation series of every epoch
    evaluation = {title: series for title, _, series in curve_panels(rows)}["evaluation (epoch 0 = before training)"]
    epochs, values = evaluation["validation: recall@1"]
    assert epochs == [0, 1, 2, 3] and values == pytest.approx([50.0, 20.0, 90.0, 30.0])
    assert evaluation["recall@1"][0] == [0, 3]
    compared = dict(run_curve_panels([Run(run, "run", RunFolderConfig(), rows, {}, None)]))
    assert compared["Recall@1, validation (held out of train)"] == [("run", [(0, 0.5), (1, 0.2), (2, 0.9),
                                                                                  (3, 0.3)])]
    best = torch.load(run / "best.pt", weights_only=False)
    assert best["epoch"] == 2 and best["metrics"]["validation"]["recall@1"] == 0.9
    assert report["selected_on"] == "validation" and report["selection_note"] is None
    assert report["last"]["epoch"] == 3 and report["last"]["recall@1"] == 0.95
    assert json.loads((run / "report.json").read_text())["selected_on"] == "validation"
    # digits' standard protocol: the test split holds the train classes, so validation is images of each of them
    split = report["class_split"]
    assert split["validation"]["classes"] == split["train"]["classes"] == 10
    assert split["validation"]["held_out"] == report["validation_by"] == "images"
    assert split["validation"]["images"] == 60 and split["train"]["images"] == 240

    # the report's best: epoch 2's row with best.pt's own test metrics, taken once after training
    monkeypatch.undo()
    trainer = Trainer(digits_config(run, feature_cache, val_fraction=0.2, resume=True), progress=False)
    trainer.setup()
    trainer.parts.model.load_state_dict(best["state_dict"])
    expected = trainer.evaluation.evaluate()
    assert report["best"]["epoch"] == 2 and report["best"]["validation"]["recall@1"] == 0.9
    for key in ("recall@1", "recall@8", "map@r", "r_precision", "nmi"):
        assert report["best"][key] == expected[key], key


class Killed(Exception):
    """Stands for a kill between two epochs."""


def test_a_run_choosing_on_validation_resumes_to_the_same_rows_and_best_pt(tmp_path, feature_cache, monkeypatch):
    config = dict(val_fraction=0.2, epochs=3, tensorboard=False, plots=False)
    straight = train(digits_config(tmp_path / "straight", feature_cache, **config), progress=False)

    real_epoch = Trainer.train_epoch

    def stop_before_the_third(self, epoch, progress=None):
        if epoch == 2:
            raise Killed
        return real_epoch(self, epoch, progress)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "train_epoch", stop_before_the_third)
        with pytest.raises(Killed):
            train(digits_config(tmp_path / "resumed", feature_cache, **config), progress=False)
    resumed = train(digits_config(tmp_path / "resumed", feature_cache, resume=True, **config), progress=False)

    def untimed(rows):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]

    assert untimed(read_jsonl(tmp_path / "resumed" / "metrics.jsonl")) == \
        untimed(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    assert {k: v for k, v in resumed["best"].items() if k not in TIMING_KEYS} == \
        {k: v for k, v in straight["best"].items() if k not in TIMING_KEYS}
    assert resumed["selected_on"] == straight["selected_on"] == "validation"
    best_resumed, best_straight = (torch.load(tmp_path / who / "best.pt", weights_only=False)
                                   for who in ("resumed", "straight"))
    assert best_resumed["epoch"] == best_straight["epoch"]
    for key, value in best_straight["state_dict"].items():
        assert torch.equal(best_resumed["state_dict"][key], value), key


def test_frozen_features_of_the_train_split_less_its_validation_classes_are_cached_apart(tmp_path, feature_cache):
    whole = train(digits_config(tmp_path / "whole", feature_cache, val_fraction=0, epochs=1), progress=False)
    held = train(digits_config(tmp_path / "held", feature_cache, val_fraction=0.2, epochs=1), progress=False)
    assert whole["config"]["train_size"] == 300 and held["config"]["train_size"] == 240


@pytest.mark.parametrize("fraction", [0.0, 0.2], ids=["off", "validation"])
def test_the_summary_says_which_split_chose_best_pt(tmp_path, feature_cache, fraction):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, [
        "train", "--dataset", "digits", "--dataset-param", "protocol=standard", "--dataset-param",
        "limit_per_class=30", "--backbone", "efficientnet_lite0", "--image-size", "32", "--freeze-backbone",
        "--embedding-dim", "16", "--batch-size", "20", "--batches-per-epoch", "3", "--epochs", "2", "--workers", "0",
        "--device", "cpu", "--no-plots", "--no-tensorboard", "--feature-cache", feature_cache,
        "--val-fraction", str(fraction), "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    rows = read_jsonl(out / "metrics.jsonl")
    if fraction:
        assert report["selected_on"] == "validation"
        assert ("best.pt was chosen on the validation split (a held-out share of each train class's images)"
                in result.stdout)
        assert "warning: no validation split" not in result.output
        return
    # off: best.pt is the last epoch, never chosen on the test split, and said twice
    assert report["selected_on"] == "last" and "--val-fraction 0 turned it off" in report["selection_note"]
    assert [r["epoch"] for r in rows if "recall@1" in r] == [0, 1, 2] and not any("validation" in r for r in rows)
    assert result.stderr.count("warning: no validation split (--val-fraction 0 turned it off): best.pt is the last "
                               "epoch") == 2
    assert torch.load(out / "best.pt", weights_only=False)["epoch"] == 2


def test_without_a_validation_split_best_pt_is_the_last_epoch_whatever_the_test_split_says(
        tmp_path, feature_cache, monkeypatch):
    tests = iter([0.4, 0.95, 0.1, 0.2])  # epoch 1 is the test split's best: it must not be chosen
    real_evaluate = Evaluator.evaluate
    monkeypatch.setattr(Evaluator, "evaluate", lambda self, probe=False: {**real_evaluate(self, probe),
                                                                          "recall@1": next(tests)})
    run = tmp_path / "run"
    report = train(digits_config(run, feature_cache, val_fraction=0), progress=False)
    assert torch.load(run / "best.pt", weights_only=False)["epoch"] == 3
    assert report["best"]["epoch"] == 3 and report["best"]["recall@1"] == 0.2
    assert report["selected_on"] == "last" and "best.pt is the last epoch" in report["selection_note"]


def test_wise_ft_auto_without_validation_data_is_refused_before_training(tmp_path, feature_cache):
    # 3 images a class leave none to hold out, and no --eval-extra: nothing to choose alpha on
    with pytest.raises(ValueError, match=r"--wise-alpha auto chooses on validation data and this run has none "
                                         r"\(too few images per class to hold some out"):
        train(digits_config(tmp_path / "run", feature_cache, freeze_backbone=False, wise_alpha="auto",
                            val_fraction=None, dataset_kwargs={"protocol": "standard", "limit_per_class": 3}),
              progress=False)
    assert not (tmp_path / "run").exists()


def test_the_app_says_which_split_chose_best_pt(tmp_path):
    from retrieval.serve.report_files import RunReport
    from retrieval.serve.report_summary import summary_markdown

    def shown(**fields) -> str:
        data = {"format": "retrieval-report/1", "kind": "train", "config": {"train": {}}, **fields}
        return summary_markdown(RunReport(tmp_path / "report.json", data))

    assert "**best.pt chosen on:** the validation split (held-out train classes)" in shown(selected_on="validation")
    assert "(a held-out share of each train class's images)" in shown(selected_on="validation", validation_by="images")
    assert "**best.pt is the last epoch:** no validation split, for a reason" in shown(
        selected_on="last", selection_note="no validation split, for a reason")
    assert "**best.pt chosen on the test split:** no validation split, for a reason" in shown(
        selected_on="test", selection_note="no validation split, for a reason")
    assert "chosen on" not in shown()  # a report from before the choice was recorded says nothing


def test_best_pt_chosen_before_the_last_epoch_carries_its_own_compatibility(tmp_path, feature_cache, monkeypatch):
    """--compatible-with, best.pt chosen on validation at epoch 1 of 2: the test split (and with it the
    compatibility blocks) was not evaluated then, so best.pt is measured after training and carries the measurement
    that `retrieval export` copies into the model for `index upgrade`."""
    from retrieval.export import export_checkpoint
    from retrieval.onnx_runtime import OnnxEmbedder

    train(digits_config(tmp_path / "old", feature_cache, epochs=1, plots=False, tensorboard=False), progress=False)
    validation = iter([0.1, 0.9, 0.2])  # epochs 0, 1, 2: epoch 1 wins
    monkeypatch.setattr(Evaluator, "validate", lambda self: {"recall@1": (v := next(validation)), "map@r": v})
    report = train(digits_config(tmp_path / "new", feature_cache, epochs=2, val_fraction=0.2, plots=False,
                                 tensorboard=False, compatible_with=str(tmp_path / "old" / "last.pt")),
                   progress=False)
    best = torch.load(tmp_path / "new" / "best.pt", weights_only=False)
    assert best["epoch"] == 1 and "compatibility" in best["metrics"]
    assert report["best"]["compatibility"]["verdict"] == best["metrics"]["compatibility"]["verdict"]
    export_checkpoint(tmp_path / "new" / "best.pt", tmp_path / "new.onnx", verify=False, log=lambda _: None)
    assert "compatibility" in OnnxEmbedder(tmp_path / "new.onnx").metadata
