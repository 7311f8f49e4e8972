"""Reading a run report (``retrieval train`` or ``retrieval evaluate``) for the Evaluation tab."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

REPORT_FORMAT = "retrieval-report/1"
MAX_RESULTS_BYTES = 16 * 2**20
METRIC_ORDER = ("map@r", "r_precision", "nmi", "f1", "linear_probe")


@dataclass
class RunReport:
    path: Path
    data: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.data.get("kind"))

    @property
    def folder(self) -> Path:
        return self.path.parent

    def metric_columns(self) -> dict[str, dict[str, float]]:
        """Column name -> metrics: before/best/last for a training run, the metrics of an evaluation."""
        if self.kind == "train":
            best = self.data.get("best") or {}
            columns = {
                "pretrained only": self.data.get("baseline"),
                f"best (epoch {best.get('epoch', '?')})": best,
                "last": self.data.get("last"),
            }
        else:
            columns = {"metrics": self.data.get("metrics")}
        return {name: values for name, values in columns.items() if values}

    def metrics_table(self) -> tuple[list[str], list[list[Any]]]:
        columns = self.metric_columns()
        keys: list[str] = []
        for values in columns.values():
            keys += [k for k in values if k not in keys and isinstance(values[k], (int, float))]
        recalls = sorted((k for k in keys if k.startswith("recall@")), key=lambda k: int(k.split("@")[1]))
        ordered = recalls + [k for k in METRIC_ORDER if k in keys]
        rows = [
            [key] + [round(float(v[key]), 4) if key in v else None for v in columns.values()]
            for key in ordered
        ]
        return ["metric", *columns], rows

    def plot_file(self, name: str) -> Path | None:
        """A picture the report lists under ``plots``; only files inside the report's own folder."""
        relative = (self.data.get("plots") or {}).get(name)
        if not relative:
            return None
        path = (self.folder / relative).resolve()
        if not path.is_relative_to(self.folder.resolve()) or not path.is_file():
            return None
        return path

    def history(self) -> list[dict[str, Any]]:
        """Per-epoch rows of metrics.jsonl next to the report (or checkpoint), else the report's history."""
        folders = [self.folder]
        if self.data.get("checkpoint"):  # as given on the command line: absolute, or relative to where it ran
            checkpoint = Path(str(self.data["checkpoint"]))
            folders += [checkpoint.parent, (self.folder / checkpoint).parent]
        for folder in folders:
            log = folder / "metrics.jsonl"
            if log.is_file():
                return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        return list(self.data.get("history") or [])


def load_report(path: str | Path) -> RunReport:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"report {path} not found; `retrieval train` writes RUN_DIR/report.json and "
            "`retrieval evaluate` writes eval_report.json next to the checkpoint"
        )
    data = _read_json(path, "report")
    if (
        not isinstance(data, dict)
        or data.get("format") != REPORT_FORMAT
        or data.get("kind") not in ("train", "evaluate")
    ):
        raise ValueError(
            f"{path} is not a report of `retrieval train` or `retrieval evaluate` "
            f"(format {REPORT_FORMAT}, kind train|evaluate)"
        )
    return RunReport(path, data)


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a JSON {what} ({exc})") from exc


def _render(draw: Callable[[Path], Path | None]) -> Image.Image | None:
    with tempfile.TemporaryDirectory(prefix="retrieval-plot-") as folder:
        path = draw(Path(folder) / "plot.png")
        if path is None:
            return None
        with Image.open(path) as image:
            return image.convert("RGB")


def _open(path: Path | None) -> Image.Image | None:
    if path is None:
        return None
    with Image.open(path) as image:
        return image.convert("RGB")


def recall_plot(report: RunReport) -> Image.Image | None:
    """The report's Recall@K plot, or one drawn from its metrics (an evaluation report has none)."""
    if (path := report.plot_file("recall")) is not None:
        return _open(path)
    from train.report import plot_recall_at_k

    curves = {
        name: {k: v for k, v in values.items() if k.startswith("recall@")}
        for name, values in report.metric_columns().items()
    }
    return _render(lambda out: plot_recall_at_k(curves, out))


def curves_plot(report: RunReport) -> Image.Image | None:
    """Training curves drawn from metrics.jsonl."""
    history = report.history()
    if not history:
        return None
    from train.report import plot_training_curves

    return _render(lambda out: plot_training_curves(history, out))


def triplet_plot(report: RunReport) -> Image.Image | None:
    return _open(report.plot_file("triplet_test") or report.plot_file("triplet_train"))


def summary_markdown(report: RunReport) -> str:
    config = report.data.get("config") or {}
    train = config.get("train", config) if isinstance(config, dict) else {}
    if report.kind == "evaluate":
        train = {**(report.data.get("model") or {}), "dataset": report.data.get("dataset")}
    facts = [f"**{report.kind}** report `{report.path}`"]
    for key in ("dataset", "backbone", "loss", "epochs", "embedding_dim"):
        value = train.get(key) if isinstance(train, dict) else None
        value = value if value is not None else report.data.get(key)
        if value is not None:
            facts.append(f"{key}: `{value}`")
    if report.kind == "evaluate":
        facts.append(f"split: `{report.data.get('split')}`, queries: {report.data.get('num_queries')}")
    return " · ".join(facts)


# --- the results grid (benchmarks/quality.py) ----------------------------------------------------------------
def load_results(path: str | Path) -> dict[str, Any]:
    """The results document of the grid; a clear error when it is missing or of another kind."""
    from retrieval.analysis.results import RESULTS_FORMAT

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no results grid at {path}")
    if path.stat().st_size > MAX_RESULTS_BYTES:
        raise ValueError(f"{path} is larger than {MAX_RESULTS_BYTES // 2**20} MiB: not a results file")
    data = _read_json(path, "results file")
    if not isinstance(data, dict) or data.get("format") != RESULTS_FORMAT:
        raise ValueError(f"{path} is not a results file (expected format {RESULTS_FORMAT!r})")
    return data


def results_curve_image(results: dict[str, Any], table_id: str) -> Image.Image | None:
    """The per-epoch curve figure of one table (e.g. SCT Figure 6), drawn from the JSON; None when it has none."""
    from retrieval.analysis.results import plot_curves

    curve = next((c for c in results.get("curves", []) if c.get("id") == table_id), None)
    return None if curve is None else _render(lambda path: plot_curves(curve, path))
