"""The run report format (``report.json``): written by ``retrieval train`` and ``retrieval evaluate``, read by the app.

One place for the format: ``train_report`` and ``evaluate_report`` build the two kinds, ``save_report`` writes
either, and the reader (``serve.report_files.load_report``) checks ``REPORT_FORMAT`` and ``REPORT_KINDS`` from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from retrieval.records.model_config import ModelConfig
from retrieval.records.run_config import RunFolderConfig
from retrieval.utils.io import atomic_write, read_capped

REPORT_FORMAT = "retrieval-report/1"
REPORT_KINDS = ("train", "evaluate")
# a training run folder's checkpoints (their contents: ``retrieval.models.checkpoint``)
LAST_CHECKPOINT = "last.pt"  # the newest, which --resume continues
BEST_CHECKPOINT = "best.pt"  # the one of the best recall@1
WISE_CHECKPOINT = "wise.pt"  # --wise-alpha: the WiSE-FT mix of the start and the fine-tuned weights
# the model's figures measured outside training (the demo's two readings and its photos), beside report.json:
# {"labels": {key: words}, "pretrained": {key: value}, "delivered": {key: value}, "checkpoint", "config_hash"}
READINGS_FILE = "readings.json"
# one row per optimizer step: {"step", "epoch" (fractional: 1.5 = half-way through the second epoch), "loss"}
STEPS_LOG = "steps.jsonl"
MAX_STEPS_LOG_BYTES = 64 * 2**20  # about a million steps; a longer log is drawn per epoch instead
STEP_POINTS = 2000  # the most points a per-step curve draws (a longer log is thinned evenly)


# what a run's validation split holds out of train (report.json's validation_by), for people: the run's first line,
# its summary and the app say it in these words
VALIDATION_HOLDS = {"classes": "held-out train classes", "images": "a held-out share of each train class's images"}


def read_steps(folder: str | Path, points: int = STEP_POINTS) -> list[dict[str, float]]:
    """The per-step rows of a run folder's steps.jsonl, thinned to at most ``points``; [] when there is none
    (or it is too large or unreadable: the curves fall back to one point per epoch)."""
    path = Path(folder) / STEPS_LOG
    if not path.is_file():
        return []
    try:
        rows = [json.loads(line) for line in read_capped(path, MAX_STEPS_LOG_BYTES, "steps log").splitlines()
                if line.strip()]
    except (OSError, ValueError):
        return []
    stride = max(1, -(-len(rows) // points))
    return rows[::stride]


def delivered_checkpoint(report: dict[str, Any]) -> Any:
    """The checkpoint a training run delivers (exported, indexed, served), as its report.json names it: the WiSE-FT
    mix where the run made one, else best.pt."""
    checkpoints = report.get("checkpoints")
    return (checkpoints.get("wise") if isinstance(checkpoints, dict) else None) or BEST_CHECKPOINT


def train_report(config: RunFolderConfig, history: list[dict[str, Any]], baseline: dict[str, float] | None,
                 best: dict[str, Any] | None, last: dict[str, Any] | None, plots: dict[str, str],
                 bad_images: list[dict[str, Any]] | None = None, reference: dict[str, Any] | None = None,
                 wise: dict[str, Any] | None = None, class_split: dict[str, Any] | None = None,
                 best_metric: str = "recall@1", selection: dict[str, Any] | None = None,
                 label_free: dict[str, Any] | None = None) -> dict[str, Any]:
    """A training run's report: the run's config, the epoch-0 baseline, the best and last evaluated epochs (and the
    metric that chose ``best``), the history (= metrics.jsonl), plot file names relative to the report, the skipped
    images, the checkpoints and the classes of each split (``class_split``).

    Each metrics dict may hold ``extra``: set name -> metrics of an --eval-extra (out-of-domain) set; ``reference``
    holds those of the pretrained backbone at its own resolution, ``wise`` the WiSE-FT mix (its curve over alpha,
    the alpha taken and its metrics). ``selection``: what ``best`` was chosen on (``selected_on``: "validation",
    with what it holds out of train in ``validation_by``; "kept" without labels; "last", the last epoch, with why in
    ``selection_note``; "test" only in reports of older versions);
    ``label_free``: a run without labels' figures (``retrieval.train.label_free_report``)."""
    selection = selection or {}
    return {
        "format": REPORT_FORMAT,
        "kind": "train",
        "config": config.to_json(),
        "baseline": baseline,
        "best": best,
        "best_metric": best_metric,
        "selected_on": selection.get("selected_on"),
        "selection_note": selection.get("selection_note"),
        "validation_by": selection.get("validation_by"),
        "last": last,
        "metrics": last or baseline,
        "history": history,
        "plots": plots,
        "bad_images": bad_images or [],
        "reference": reference,
        "wise": wise,
        "class_split": class_split,
        **({"label_free": label_free} if label_free is not None else {}),
        "checkpoints": {"best": BEST_CHECKPOINT, "last": LAST_CHECKPOINT,
                        **({"wise": WISE_CHECKPOINT} if wise else {})},
    }


def evaluate_report(checkpoint: str | Path, dataset: str, data: str | None, split: str,
                    dataset_kwargs: dict[str, Any], num_queries: int, model: ModelConfig,
                    metrics: dict[str, float], plots: dict[str, str] | None = None) -> dict[str, Any]:
    """An evaluation's report: which checkpoint, on which data and split, its metrics and its pictures (file names
    relative to the report)."""
    return {
        "format": REPORT_FORMAT,
        "kind": "evaluate",
        "checkpoint": str(checkpoint),
        "dataset": dataset,
        "data": data,
        "split": split,
        "dataset_kwargs": dataset_kwargs,
        "num_queries": int(num_queries),
        "model": model.to_json(),
        "metrics": metrics,
        "plots": dict(plots or {}),
    }


def save_report(report: dict[str, Any], path: str | Path) -> None:
    """Write a report as indented JSON, whole or not at all (numpy scalars become floats)."""
    atomic_write(path, json.dumps(report, indent=2, default=float))
