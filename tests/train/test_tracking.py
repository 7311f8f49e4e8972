"""Experiment tracking: the TensorBoard event files and the MLflow run a training writes, read back by TensorBoard's
and MLflow's own readers."""

from __future__ import annotations

import json

import pytest
from run_files import metrics_rows
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from train_configs import digits_config

from retrieval.train import train
from retrieval.train.checkpointing import atomic_save
from retrieval.train.trainer import Trainer

mlflow = pytest.importorskip("mlflow", reason="MLflow comes with retrieval[track] (make install)")


def tensorboard_of(run) -> EventAccumulator:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    return events


def test_tensorboard_and_mlflow_hold_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    report = train(digits_config(tmp_path / "run", tmp_path / "cache", epochs=2, mlflow_uri=uri,
                                 eval_extra=["fashion-mnist"], eval_extra_limit=40, val_fraction=0), progress=False)
    run = tmp_path / "run"
    rows = metrics_rows(run)

    events = tensorboard_of(run)
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss_step", "loss", "recall@1", "map@r", "images_per_s", "lr/head",
            "extra/fashion-mnist/recall@1", "loss_positive_pairs_kept"} <= scalars
    assert [e.step for e in events.Scalars("train/loss_step")] == [1, 2, 3, 4, 5, 6]  # every optimizer step
    assert [e.value for e in events.Scalars("recall@1")] == pytest.approx([r["recall@1"] for r in rows])
    assert [e.step for e in events.Scalars("recall@1")] == [0, 3, 6]  # epoch 0 (before training), 1, 2
    assert {f"plots/{name}" for name in report["plots"]} <= set(events.Tags()["images"])

    tracking = json.loads((run / "config.json").read_text())["tracking"]
    assert tracking["tensorboard"] == "tensorboard" and tracking["mlflow"]["tracking_uri"] == uri
    client = mlflow.tracking.MlflowClient(uri)
    mlrun = client.get_run(tracking["mlflow"]["run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    assert mlrun.data.params["train/loss"] == "ms" and mlrun.data.params["model/input_size"] == "32"
    history = client.get_metric_history(mlrun.info.run_id, "recall_at_1")
    assert [(m.step, m.value) for m in history] == [(s, r["recall@1"]) for s, r in zip([0, 3, 6], rows, strict=True)]
    assert client.get_metric_history(mlrun.info.run_id, "extra/fashion-mnist/recall_at_1")
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id, "plots")}
    assert {f"plots/{file}" for file in report["plots"].values()} <= artifacts


def test_a_resumed_run_continues_its_mlflow_run_and_its_tensorboard_steps(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cache = tmp_path / "cache"
    first = Trainer(digits_config(tmp_path / "run", cache, mlflow_uri=uri, epochs=3, eval_before=False),
                    progress=False)
    first.setup()
    row = {"epoch": 1, **first.train_epoch(0)}
    first.record.history.append(row)
    first._track_epoch(row)
    atomic_save(first.checkpoint(1, row), tmp_path / "run" / "last.pt")
    first.train_epoch(1)  # steps 4-6 logged, then "killed" before its checkpoint
    first.tracking.fail()
    run_id = json.loads((tmp_path / "run" / "mlflow_run.json").read_text())["run_id"]
    train(digits_config(tmp_path / "run", cache, mlflow_uri=uri, epochs=3, eval_before=False, resume=True),
          progress=False)
    client = mlflow.tracking.MlflowClient(uri)
    assert [r.info.run_id for r in client.search_runs([client.get_experiment_by_name("retrieval").experiment_id])] \
        == [run_id]  # one MLflow run, continued
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [3, 6, 9]
    # the steps logged after the checkpoint were dropped and logged again: each step once
    assert [e.step for e in tensorboard_of(tmp_path / "run").Scalars("train/loss_step")] == list(range(1, 10))


def test_without_mlflow_only_tensorboard_and_no_tensorboard_turns_it_off(tmp_path):
    train(digits_config(tmp_path / "a", tmp_path / "cache", epochs=1, plots=False), progress=False)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["tracking"] == {"tensorboard": "tensorboard"}
    assert not (tmp_path / "mlflow.db").exists()
    train(digits_config(tmp_path / "b", tmp_path / "cache", epochs=1, plots=False, tensorboard=False), progress=False)
    assert not (tmp_path / "b" / "tensorboard").exists()


def test_a_tracker_that_fails_is_dropped_and_the_run_goes_on(tmp_path, caplog):
    from retrieval.train.tracking import MlflowLog, Tracking

    class Broken(MlflowLog):
        def __init__(self):
            self.closed = False

        def epoch(self, *args):
            raise ConnectionError("tracking server unreachable")

        def close(self, status="FINISHED"):
            self.closed = True

    broken = Broken()
    tracking = Tracking([broken])
    with caplog.at_level("WARNING", logger="retrieval.train.tracking"):
        tracking.epoch({"epoch": 1, "loss": 0.5}, 3, {"head": 1e-3})
        tracking.epoch({"epoch": 2, "loss": 0.4}, 6, {"head": 1e-3})  # no second warning: it was dropped
    assert tracking.logs == [] and len(caplog.records) == 1
    assert "MLflow tracking stopped (epoch: tracking server unreachable); the run goes on" in caplog.text
