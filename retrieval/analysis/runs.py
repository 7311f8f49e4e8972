"""Compare training runs: what differs in their configurations, their final metrics, their learning curves.

Reads what ``retrieval train`` leaves in a run folder (config.json, metrics.jsonl, report.json); no torch.
``retrieval runs compare RUN...`` prints the table and draws the curves side by side in one PNG.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrieval.analysis.plain_text import cut_long_texts, plain_text
from retrieval.utils.io import read_capped

# the final metrics a comparison shows, when the runs have them (report.json's "last" row)
FINAL_METRICS = ("recall@1", "recall@8", "map@r", "nmi")
WAIT_SHARE = "waiting for batches"  # the share of the training time spent waiting for batches (0-1)
# configuration keys that differ between any two runs without saying anything about the method
IGNORED_KEYS = {"train/out", "train/resume", "train/feature_cache", "train/workers", "train/plots", "torch",
                "device", "tracking/tensorboard", "tracking/mlflow/run_id", "tracking/mlflow/tracking_uri"}
MAX_RUN_FILE_BYTES = 64 * 2**20  # a run's JSON files are kilobytes; refuse to read anything absurd


@dataclass
class Run:
    """One run folder, read."""

    path: Path
    name: str
    config: dict[str, Any]  # flattened: "train/lr", "model/input_size", ...
    history: list[dict[str, Any]]  # metrics.jsonl rows
    last: dict[str, Any]  # the last evaluated row (report.json's "last", else the history's)
    wise: dict[str, Any] | None  # report.json's WiSE-FT block, if the run made one


def _read(path: Path) -> str:
    """A run file's text: a regular file of at most ``MAX_RUN_FILE_BYTES`` (``retrieval.utils.io.read_capped``)."""
    return read_capped(path, MAX_RUN_FILE_BYTES, "run's file").decode()


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as ``a/b`` keys; lists kept as they are."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def load_run(path: str | Path) -> Run:
    """Read a run folder of ``retrieval train`` (config.json and metrics.jsonl; report.json when it finished)."""
    folder = Path(path).expanduser()
    config_file, metrics_file = folder / "config.json", folder / "metrics.jsonl"
    if not config_file.is_file() or not metrics_file.is_file():
        raise FileNotFoundError(f"{folder} is not a run folder of `retrieval train` (it needs config.json and "
                                "metrics.jsonl): give the folder the training run wrote into")
    history = [json.loads(line) for line in _read(metrics_file).splitlines() if line.strip()]
    report = json.loads(_read(folder / "report.json")) if (folder / "report.json").is_file() else {}
    evaluated = [row for row in history if "recall@1" in row]
    last = report.get("last") or (evaluated[-1] if evaluated else {})
    return Run(folder, folder.name, flatten(json.loads(_read(config_file))), history, last, report.get("wise"))


def unique_names(runs: list[Run]) -> None:
    """Runs with the same folder name (seed0 in two places) get their parent's name in front."""
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.path.parent.name}/{run.path.name}"


def config_differences(runs: list[Run]) -> dict[str, list[Any]]:
    """The configuration keys whose values are not the same in every run, with each run's value (None: unset)."""
    keys = sorted({key for run in runs for key in run.config} - IGNORED_KEYS)
    differing = {}
    for key in keys:
        values = [run.config.get(key) for run in runs]
        if any(json.dumps(v, sort_keys=True) != json.dumps(values[0], sort_keys=True) for v in values[1:]):
            differing[key] = values
    return differing


def final_metrics(run: Run) -> dict[str, float]:
    """The run's last evaluation: the headline metrics, each --eval-extra set's Recall@1, WiSE-FT's, the training
    time and the share of it spent waiting for batches."""
    out = {key: float(run.last[key]) for key in FINAL_METRICS if isinstance(run.last.get(key), (int, float))}
    for name, metrics in (run.last.get("extra") or {}).items():
        if "recall@1" in metrics:
            out[f"{name} recall@1"] = float(metrics["recall@1"])
    if run.wise:
        out["wise recall@1"] = float(run.wise["metrics"]["recall@1"])
    epochs = [row for row in run.history if "epoch_time_s" in row]
    if epochs:
        out["train time s"] = float(sum(row["epoch_time_s"] for row in epochs))
        if all("data_wait_s" in row for row in epochs):  # runs before it was measured have none
            out[WAIT_SHARE] = sum(row["data_wait_s"] for row in epochs) / max(out["train time s"], 1e-9)
    return out


def comparison(runs: list[Run]) -> dict[str, Any]:
    """What ``retrieval runs compare --json`` prints: the differing configuration and each run's final metrics."""
    return {"runs": [str(run.path) for run in runs], "names": [run.name for run in runs],
            "config": config_differences(runs), "metrics": {run.name: final_metrics(run) for run in runs}}


def format_table(runs: list[Run]) -> str:
    """A plain-text table: one column per run; the differing configuration, then the final metrics."""
    data = comparison(runs)
    config = [(key.removeprefix("train/"), ["-" if v is None else str(v) for v in values])
              for key, values in data["config"].items()] or [("(configuration)", ["the same"] * len(runs))]
    names = sorted({name for metrics in data["metrics"].values() for name in metrics},
                   key=lambda n: (n not in FINAL_METRICS, n))
    metrics = [(name, [_number(name, data["metrics"][run.name].get(name)) for run in runs]) for name in names]
    sections = [[("run", [run.name for run in runs])], config, metrics]
    rows = [row for section in sections for row in section]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(cells[i]) for _, cells in rows) for i in range(len(runs))]

    def line(label: str, cells: list[str]) -> str:
        return "  ".join([label.ljust(label_width), *(c.rjust(w) for c, w in zip(cells, widths, strict=True))])

    rule = "-" * (label_width + sum(w + 2 for w in widths))
    return f"\n{rule}\n".join("\n".join(line(*row) for row in section) for section in sections if section)


def _number(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name == WAIT_SHARE:
        return f"{value:.0%}"
    return f"{value:.0f}" if name.endswith(" s") else f"{value:.4f}"


def curve_panels(runs: list[Run]) -> list[tuple[str, list[tuple[str, list[tuple[int, float]]]]]]:
    """The panels ``plot_curves`` draws, (title, [(run name, its (epoch, value) points)]): the training loss, the
    evaluation split's Recall@1, the validation classes' Recall@1 (every epoch where best.pt is chosen on them) and
    each --eval-extra set's, each only where a run has it."""
    extra_sets = sorted({name for run in runs for row in run.history for name in (row.get("extra") or {})})
    values = [("training loss", lambda row: row.get("loss") if row.get("epoch", 0) > 0 else None),
              ("Recall@1 (evaluation split)", lambda row: row.get("recall@1")),
              ("Recall@1, validation (held out of train)",
               lambda row: (row.get("validation") or {}).get("recall@1"))]
    values += [(f"Recall@1, {name} (out of domain)",
                lambda row, name=name: (row.get("extra") or {}).get(name, {}).get("recall@1")) for name in extra_sets]
    panels = []
    for title, value in values:
        lines = [(run.name, [(row["epoch"], value(row)) for row in run.history
                             if isinstance(value(row), (int, float)) and "epoch" in row]) for run in runs]
        lines = [(name, points) for name, points in lines if points]
        if lines or title == "training loss":
            panels.append((title, lines))
    return panels


@plain_text()
def plot_curves(runs: list[Run], path: Path) -> Path:
    """One PNG: the training loss, the evaluation Recall@1 and (when the runs have them) the validation classes'
    and each --eval-extra set's Recall@1 against the epoch, one line per run, panels side by side."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    panels = curve_panels(runs)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8), squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels, strict=True):
        for name, points in lines:
            ax.plot(*zip(*points, strict=True), "o-", label=name, markersize=3)
        ax.set(title=title, xlabel="epoch (0 = before training)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    cut_long_texts(fig)  # run and set names
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
