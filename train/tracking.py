"""Experiment tracking: TensorBoard event files in every run folder, and MLflow when asked (``--mlflow``).

Both are the real packages (``torch.utils.tensorboard`` writing TensorBoard's event files; ``mlflow``'s client),
never a hand-written format. Rank 0 alone tracks (the trainer builds no tracker on the other ranks).

What is logged: every optimizer step's loss (TensorBoard only: a database write per step would slow MLflow down);
per epoch, every number of the metrics.jsonl row (loss, the loss statistics such as hard-negative shares, speed,
each metric, each --eval-extra set's metrics) and the learning rate of every optimizer group; at the end, the
report's plots (TensorBoard images, MLflow artifacts) and, to MLflow, the run's configuration as parameters.
A resumed run continues its MLflow run (its id is kept in the run folder) and drops the TensorBoard events
logged after the checkpoint it resumed from.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from retrieval.analysis.runs import flatten
from retrieval.extras import install_command
from retrieval.records.run_config import RunFolderConfig

logger = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
MLFLOW_RUN_FILE = "mlflow_run.json"  # the MLflow run id of this run folder, so --resume continues it
MLFLOW_EXPERIMENT = "retrieval"


def default_mlflow_uri(out: Path) -> str:
    """MLflow's store when --mlflow gives none and MLFLOW_TRACKING_URI is unset: one SQLite file beside the run
    folders, so that every run of a folder of runs lands in one store (``mlflow ui --backend-store-uri`` it)."""
    return f"sqlite:///{(out.resolve().parent / 'mlflow.db').as_posix()}"


def flat_numbers(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, nested dicts flattened with '/' (``extra/fashion-mnist/recall@1``)."""
    return {name: float(value) for name, value in flatten(row).items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and name != "epoch"}


def mlflow_name(name: str) -> str:
    """A metric or parameter name MLflow accepts (letters, digits, _ - . space : /): recall@1 -> recall_at_1."""
    return re.sub(r"[^\w\-. :/]", "_", name.replace("@", "_at_"))


class TensorBoardLog:
    """TensorBoard event files in RUN/tensorboard."""

    name = "TensorBoard"

    def __init__(self, out: Path, resume_step: int | None) -> None:
        """``resume_step``: the first step a resumed run takes; the events logged from it on are dropped."""
        from torch.utils.tensorboard import SummaryWriter

        self.folder = out / TENSORBOARD_DIR
        # purge_step: a resumed run drops the events logged after its checkpoint (they are logged again)
        self.writer = SummaryWriter(str(self.folder), purge_step=resume_step)

    def step(self, step: int, loss: float) -> None:
        self.writer.add_scalar("train/loss_step", loss, step)

    def epoch(self, epoch: int, step: int, numbers: dict[str, float]) -> None:
        for name, value in numbers.items():
            self.writer.add_scalar(name, value, step)
        self.writer.add_scalar("epoch", epoch, step)
        self.writer.flush()

    def images(self, plots: dict[str, Path], step: int) -> None:
        import numpy as np
        from PIL import Image

        for name, path in plots.items():
            with Image.open(path) as image:
                self.writer.add_image(f"plots/{name}", np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class MlflowLog:
    """One MLflow run per run folder, in the tracking store ``uri``."""

    name = "MLflow"

    def __init__(self, out: Path, uri: str, run_name: str, params: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise RuntimeError(f"--mlflow needs the mlflow package: {install_command('track')} (make install "
                               "does)") from exc
        self.uri = uri
        self.client = MlflowClient(uri)
        record = out / MLFLOW_RUN_FILE
        if record.is_file():  # a resumed run continues its MLflow run
            self.run_id = json.loads(record.read_text())["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else self._create_experiment()
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        record.write_text(json.dumps({"tracking_uri": uri, "run_id": self.run_id}))
        from mlflow.entities import Param

        values = [Param(mlflow_name(k), (json.dumps(v) if isinstance(v, (list, dict)) else str(v))[:6000])
                  for k, v in sorted(flatten(params).items())]
        for start in range(0, len(values), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=values[start:start + 100])

    def _create_experiment(self) -> str:
        # artifacts beside a local store (SQLite file or folder), not in the working folder
        location = None
        if self.uri.startswith("sqlite:///"):
            location = (Path(self.uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
        return self.client.create_experiment(MLFLOW_EXPERIMENT, artifact_location=location)

    def step(self, step: int, loss: float) -> None:
        pass  # per epoch only (see the module docstring)

    def epoch(self, epoch: int, step: int, numbers: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_name(name), value, now, step) for name, value in numbers.items()]
        metrics.append(Metric("epoch", float(epoch), now, step))
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def images(self, plots: dict[str, Path], step: int) -> None:
        for path in plots.values():
            self.client.log_artifact(self.run_id, str(path), "plots")

    def close(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


class Tracking:
    """The trackers of one run (TensorBoard always when ``tensorboard``; MLflow when ``mlflow_uri``); each call
    goes to all of them."""

    def __init__(self, logs: list) -> None:
        self.logs = logs

    @classmethod
    def open(cls, out: Path, run_config: RunFolderConfig, tensorboard: bool, mlflow_uri: str | None,
             resume_step: int | None) -> Tracking:
        logs: list = []
        if tensorboard:
            logs.append(TensorBoardLog(out, resume_step))
        if mlflow_uri:
            logs.append(MlflowLog(out, mlflow_uri, out.name, run_config.to_json()))
        return cls(logs)

    def where(self) -> dict[str, Any]:
        """Where this run's tracking went (for config.json and the summary)."""
        found: dict[str, Any] = {}
        for log in self.logs:
            if isinstance(log, TensorBoardLog):
                found["tensorboard"] = TENSORBOARD_DIR
            else:
                found["mlflow"] = {"tracking_uri": log.uri, "run_id": log.run_id}
        return found

    def _each(self, call: str, *args: Any) -> None:
        """``log.call(*args)`` on every log; a log that fails (a tracking server gone, a full disk) is dropped with
        a warning: tracking never stops a training run."""
        for log in list(self.logs):
            try:
                getattr(log, call)(*args)
            except Exception as exc:  # noqa: BLE001 - any failure of a tracker is reported, the run goes on
                self.logs.remove(log)
                logger.warning("%s tracking stopped (%s: %s); the run goes on, metrics.jsonl and report.json "
                               "still hold everything", log.name, call, exc)

    def step(self, step: int, loss: float) -> None:
        self._each("step", step, loss)

    def epoch(self, row: dict[str, Any], step: int, learning_rates: dict[str, float]) -> None:
        numbers = flat_numbers(row)
        numbers.update({f"lr/{name}": lr for name, lr in learning_rates.items()})
        self._each("epoch", int(row.get("epoch", 0)), step, numbers)

    def finish(self, out: Path, plots: dict[str, str], step: int) -> None:
        paths = {name: out / file for name, file in plots.items() if (out / file).is_file()}
        self._each("images", paths, step)
        self._each("close")
        self.logs = []

    def fail(self, status: str = "FAILED") -> None:
        """The run stopped (an error: FAILED, Ctrl-C: KILLED): close the files, mark the MLflow run."""
        for log in self.logs:
            try:
                log.close(status) if isinstance(log, MlflowLog) else log.close()
            except Exception as exc:  # noqa: BLE001 - the run's own error is the one to show
                logger.warning("could not close %s tracking: %s", log.name, exc)
        self.logs = []


def mlflow_uri_from(option: str | None, enabled: bool, out: Path) -> str | None:
    """The MLflow store of a run: --mlflow-uri, else (with --mlflow) MLFLOW_TRACKING_URI, else a SQLite file
    beside the run folder; None when MLflow is off."""
    if option:
        return option
    if not enabled:
        return None
    return os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(out)
