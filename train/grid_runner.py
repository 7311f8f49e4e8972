"""The results grid runner: trains every cell of ``retrieval.analysis.grid`` with ``retrieval.train.train`` and writes
docs/results.json (the app's Results tab), the figures and the generated parts of docs/RESULTS.md.
``retrieval results run`` calls it.

Every cell is one ``retrieval train`` run (the command is printed next to the cell in docs/RESULTS.md): the
offline-pretrained EfficientNet-Lite0 stays frozen (its features are cached once per dataset) and a linear
512-d head is trained with the same batch (P x N), optimiser, learning rate and number of steps for every
method of a dataset; only the loss (and its hard-negative generation) changes. Each cell runs once per seed;
tables show mean ± standard deviation. The grid is resumable: a finished run (report.json matching its
configuration) is skipped, an interrupted one resumes from its last.pt.

Outputs: RUNS/<dataset>/<cell>/seed<S>/ (the usual run folder), the results JSON, the figures, and in the Markdown
the parts between ``<!-- results: ID -->`` markers (setup, tables, discussion, commands, figures); the Markdown's
prose around them is written by hand and kept (``retrieval.analysis.results.results_document``).
"""

from __future__ import annotations

import itertools
import json
import shutil
import time
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from retrieval.analysis.grid import COMMON, RETRIEVAL_COLUMNS, TABLE_IDS, TABLES, DatasetSpec, Method, Table
from retrieval.analysis.grid_discussion import DISCUSSIONS, curves, discuss_floor
from retrieval.analysis.results import FIGURE_FILE, RESULTS_FORMAT, plot_curves, results_document, summarize
from retrieval.reports import LAST_CHECKPOINT
from retrieval.train.config import TrainConfig
from retrieval.utils.progress import progress_bar


# --- one run -------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    table: Table
    dataset: DatasetSpec
    method: Method
    noise: str | None
    seed: int
    out: Path

    def config(self, feature_cache: str | None) -> TrainConfig:
        values = {**COMMON, **self.dataset.overrides, **self.method.overrides()}
        values.update(seed=self.seed, label_noise=self.noise, out=str(self.out), feature_cache=feature_cache,
                      eval_every=values["epochs"])
        return TrainConfig(**values)


def cell_dir(runs: Path, dataset: str, method: Method, noise: str | None) -> Path:
    return runs / dataset / (method.slug() + (f"@{noise.replace(':', '-')}" if noise else ""))


def plan(tables: list[Table], datasets: dict[str, DatasetSpec], seeds: list[int], runs: Path,
         cells: tuple[str, ...] = ("*",), skip_cells: tuple[str, ...] = ()) -> list[Run]:
    """Every (table, dataset, method, noise, seed); a cell shared by two tables (e.g. triplet) appears once.

    ``cells`` / ``skip_cells``: shell patterns on the cell folder name (e.g. ``'*phi=sinkhorn*'``) that keep / drop
    runs, to run the cheap cells of a grid first."""
    out, seen = [], set()
    for table in tables:
        methods = table.methods or tuple(m for _, block in table.blocks for m in block)
        for key, noise, method, seed in itertools.product(table.datasets, table.noise, methods, seeds):
            path = cell_dir(runs, key, method, noise) / f"seed{seed}"
            name = path.parent.name
            if not any(fnmatch(name, p) for p in cells) or any(fnmatch(name, p) for p in skip_cells):
                continue
            if path not in seen:
                seen.add(path)
                out.append(Run(table, datasets[key], method, noise, seed, path))
    return out


def finished_report(run_dir: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The run's report when it finished with exactly this configuration."""
    path = run_dir / "report.json"
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    saved = report.get("config", {}).get("train") or {}
    return report if _same_run(saved, cfg) else None


def _same_run(saved: dict[str, Any], cfg: TrainConfig) -> bool:
    """Same configuration, whether or not the run was resumed on the way."""
    defaults = TrainConfig().to_dict()  # options added since a run was saved take their default
    return {**defaults, **saved, "resume": False} == {**cfg.to_dict(), "resume": False}


def execute(run: Run, feature_cache: str | None) -> dict[str, Any]:
    """Train the run unless it already finished; an interrupted run resumes, a stale one starts again."""
    from retrieval.train import train

    cfg = run.config(feature_cache)
    report = finished_report(run.out, cfg)
    if report is not None:
        return report
    if (run.out / LAST_CHECKPOINT).is_file():
        saved_path = run.out / "config.json"
        saved = json.loads(saved_path.read_text())["train"] if saved_path.is_file() else {}
        if _same_run(saved, cfg):
            cfg.resume = True
        else:
            shutil.rmtree(run.out)  # made by an older version of the grid: its numbers would not match the table
    start = time.perf_counter()
    report = train(cfg, progress=False)
    (run.out / "seconds.json").write_text(json.dumps({"seconds": time.perf_counter() - start}))
    return report


def floor_metrics(dataset: DatasetSpec, runs: Path, feature_cache: str | None) -> dict[str, float]:
    """The pretrained backbone's own L2-normalised features, no head: what training has to beat."""
    from retrieval.metrics.evaluation import evaluate_embeddings
    from retrieval.train.trainer import Trainer

    path = runs / dataset.key / "floor" / "metrics.json"
    cfg = TrainConfig(**{**COMMON, **dataset.overrides, "out": str(path.parent), "feature_cache": feature_cache})
    if path.is_file():
        saved = json.loads(path.read_text())
        if _same_run(saved["config"], cfg):  # options added since take their default
            return saved["metrics"]
    trainer = Trainer(cfg, progress=True)
    trainer.setup()  # loads (or extracts and caches) the backbone features the grid's runs share
    features = trainer.parts.features  # CachedFeatures: the grid's runs keep the backbone frozen
    query, gallery = features.eval_features  # features of the images that loaded (rows and labels alike)
    q, ql = query.embeddings, query.labels
    metrics = evaluate_embeddings(q, ql, *((gallery.embeddings, gallery.labels) if gallery else (None, None)))
    if cfg.linear_probe:
        from retrieval.metrics import linear_probe

        train_labels = trainer.data.clean_train_labels[features.train_feature_indices]
        metrics["linear_probe"] = linear_probe(features.train_features.cpu().numpy(), train_labels, q, ql,
                                               seed=cfg.seed)
    path.write_text(json.dumps({"config": cfg.to_dict(), "metrics": metrics}, indent=1))
    return metrics


# --- the command of a cell --------------------------------------------------------------------------------------
SHOWN = {"dataset", "backbone", "loss", "epochs", "batch_size", "per_class", "lr"}  # even when they are defaults


def train_command(cfg: TrainConfig) -> str:
    """The ``retrieval train`` command line that reproduces ``cfg`` (seed shown as S, run folder as RUN)."""
    defaults = TrainConfig().to_dict()
    parts = ["retrieval train"]
    for key, value in cfg.to_dict().items():
        if key in ("out", "resume", "seed", "feature_cache") or (value == defaults[key] and key not in SHOWN):
            continue
        option = "--" + key.replace("_", "-")
        if key in ("dataset_kwargs", "loss_kwargs"):
            flag = "--dataset-param" if key == "dataset_kwargs" else "--loss-param"
            parts += [f"{flag} {k}={v}" for k, v in value.items()]
        elif isinstance(value, bool):
            parts.append(option if value else f"--no-{key.replace('_', '-')}")
        elif key == "data" and value:
            parts.append(f"{option} {_in_repository(value)}")  # run from the repository root
        elif value is not None:
            parts.append(f"{option} {value}")
    return " ".join(parts + ["--seed S", "--out RUN"])


# --- tables -----------------------------------------------------------------------------------------------------
def _noise_label(noise: str | None) -> str:
    if noise is None:
        return "clean"
    mode, _, rate = noise.partition(":")
    return f"{mode} {rate}"


def build_results(tables: list[Table], datasets: dict[str, DatasetSpec], runs_by_cell: dict[Path, list[dict]],
                  floors: dict[str, dict[str, float]], seeds: list[int], runs: Path,
                  feature_cache: str | None) -> list[dict[str, Any]]:
    """The JSON tables: one block per dataset (or per DCDL local loss), one row per method."""
    out = []
    for table in tables:
        noisy = len(table.noise) > 1
        columns = ([{"key": _noise_label(n), "label": _noise_label(n)} for n in table.noise] if noisy
                   else [{"key": k, "label": label} for k, label in RETRIEVAL_COLUMNS])
        groups = table.blocks or ((None, table.methods),)
        blocks = []
        for key in table.datasets:
            floor_row = {"label": "pretrained only (no head)", "floor": True, "cells": {}}
            for column in columns:
                metric = table.metric if noisy else column["key"]
                if metric in floors.get(key, {}):
                    floor_row["cells"][column["key"]] = summarize([floors[key][metric]])
            for group, methods in groups:
                rows = [floor_row]
                for method in methods:
                    row: dict[str, Any] = {"label": method.label, "cells": {}}
                    for noise in table.noise:
                        reports = runs_by_cell.get(cell_dir(runs, key, method, noise), [])
                        finals = [r["last"] for r in reports if r.get("last")]
                        if noisy:
                            row["cells"][_noise_label(noise)] = summarize([f[table.metric] for f in finals
                                                                           if table.metric in f])
                        else:
                            row["cells"] = {k: summarize([f[k] for f in finals if k in f]) for k, _ in
                                            RETRIEVAL_COLUMNS}
                        if table.curve:
                            row.setdefault("curves", []).extend(
                                [[h[table.curve] for h in r["history"] if table.curve in h] for r in reports])
                    probe = Run(table, datasets[key], method, table.noise[0], seeds[0], Path("RUN"))
                    command = train_command(probe.config(feature_cache))
                    row["command"] = command if not noisy else command + " --label-noise NOISE"
                    rows.append(row)
                title = datasets[key].title if group is None else f"{datasets[key].title}: {group}"
                short = datasets[key].short if group is None else group
                blocks.append({"title": title, "short": short, "dataset": key, "rows": rows})
        entry = {"id": table.id, "title": table.title, "claim": table.claim, "caveats": table.caveats,
                 "columns": columns, "blocks": blocks}
        entry["discussion"] = DISCUSSIONS[table.id](entry) + discuss_floor(entry)
        out.append(entry)
    return out


# --- the grid ---------------------------------------------------------------------------------------------------
def run_grid(tables: list[Table], datasets: dict[str, DatasetSpec], seeds: list[int], runs: Path,
             feature_cache: str | None = None, markdown: Path | None = None, json_path: Path | None = None,
             figures: Path | None = None, shard: tuple[int, int] = (0, 1),
             cells: tuple[str, ...] = ("*",), skip_cells: tuple[str, ...] = (), train: bool = True,
             keep_other_tables: bool = True, command: str = "") -> dict[str, Any]:
    """Run (or skip) every cell, then write the results JSON, the figures and the Markdown's generated parts.

    ``shard=(k, n)`` runs only every n-th run starting at k (n processes share the grid, one per core); the
    tables then hold only that shard's runs, so a final call without a shard writes the documents.
    ``train=False`` trains nothing: the documents show the finished runs, and a cell only once all its seeds
    have finished. ``keep_other_tables``: tables of an existing ``json_path`` that this call does not run are
    kept in the results as they are (re-running one table leaves the others' numbers alone).
    """
    start = time.perf_counter()
    used = {key for t in tables for key in t.datasets}
    floors = {key: floor_metrics(datasets[key], runs, feature_cache) for key in datasets if key in used}
    todo = plan(tables, datasets, seeds, runs, cells, skip_cells)[shard[0]::shard[1]]
    runs_by_cell: dict[Path, list[dict]] = {}
    seconds = 0.0
    bar = progress_bar(todo, desc="results grid", unit="run")
    failures = []
    unfinished, finished = set(), 0
    for run in bar:
        bar.set_postfix_str(f"{run.dataset.key} {run.method.label} {_noise_label(run.noise)} seed {run.seed}", False)
        if not train:
            report = finished_report(run.out, run.config(feature_cache))
            if report is None:
                unfinished.add(run.out.parent)
                continue
            runs_by_cell.setdefault(run.out.parent, []).append(report)
            seconds += _run_seconds(run.out)
            finished += 1
            continue
        try:
            report = execute(run, feature_cache)
        except Exception as exc:  # one failed run (e.g. a diverged loss) must not cost the rest of the grid
            failures.append({"run": str(run.out), "error": f"{type(exc).__name__}: {exc}"})
            tqdm.write(f"FAILED {run.out}: {type(exc).__name__}: {exc}")
            continue
        runs_by_cell.setdefault(run.out.parent, []).append(report)
        seconds += _run_seconds(run.out)
    for cell in unfinished:  # a cell is shown with all its seeds or not at all
        runs_by_cell.pop(cell, None)
    built = build_results(tables, datasets, runs_by_cell, floors, seeds, runs, feature_cache)
    kept = _kept_tables(json_path, {t.id for t in tables}) if json_path and keep_other_tables else None
    results = {
        "format": RESULTS_FORMAT,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "complete": not failures,
        "failures": failures,
        "setup": {"seeds": seeds, "common": COMMON, "datasets": {k: {"title": datasets[k].title,
                                                                       "overrides": _portable(datasets[k].overrides)}
                                                                   for k in sorted(used)},
                  "runs": len(todo) if train else finished,  # report-only: the runs that had finished
                  "train_seconds_total": round(seconds, 1),
                  "this_invocation_seconds": round(time.perf_counter() - start, 1)},
        "tables": built,
        "curves": curves(built),
    }
    if unfinished:
        results["setup"]["cells_not_finished"] = sorted(_in_repository(str(c)) for c in unfinished)
    if command:
        results["setup"]["command"] = command
    if kept:
        results["setup"]["kept"] = {"tables": [t["id"] for t in kept["tables"]], "from": kept["created"],
                                    "setup": kept["setup"]}
        order = {tid: i for i, tid in enumerate(TABLE_IDS)}
        results["tables"] = sorted(built + kept["tables"], key=lambda t: order.get(t["id"], len(order)))
        results["curves"] = sorted(results["curves"] + kept["curves"], key=lambda c: order.get(c["id"], len(order)))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    links = {}
    if figures:
        run_ids = {t.id for t in tables}
        for curve in results["curves"]:
            path = figures / FIGURE_FILE.format(id=curve["id"])
            if curve["id"] in run_ids or not path.is_file():  # a kept table's figure stays as it is
                path = plot_curves(curve, path)
            if markdown:
                links[curve["id"]] = (path.relative_to(markdown.parent) if path.is_relative_to(markdown.parent)
                                      else path).as_posix()
    if markdown:
        before = markdown.read_text(encoding="utf-8") if markdown.is_file() else None
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(results_document(before, results, links), encoding="utf-8")
    return results


def _run_seconds(run_dir: Path) -> float:
    timing = run_dir / "seconds.json"
    return json.loads(timing.read_text())["seconds"] if timing.is_file() else 0.0


def _kept_tables(json_path: Path, run_ids: set[str]) -> dict[str, Any] | None:
    """The tables (and their curves) of an existing results file that this call does not run; their title, claim
    and caveats (what the app's Results tab shows with them) are refreshed from the grid's definitions."""
    if not json_path.is_file():
        return None
    previous = json.loads(json_path.read_text())
    if previous.get("format") != RESULTS_FORMAT:
        return None
    tables = [t for t in previous.get("tables", []) if t["id"] not in run_ids]
    if not tables:
        return None
    ids = {t["id"] for t in tables}
    texts = {t.id: t for t in TABLES}
    for table in tables:  # the numbers stay; the words (title, claim, caveats) are the grid's current ones
        if table["id"] in texts:
            table.update(title=texts[table["id"]].title, claim=texts[table["id"]].claim,
                         caveats=texts[table["id"]].caveats)
    # tables the previous file had itself kept come from that file's origin, not from its re-run
    origin = previous.get("setup", {}).get("kept")
    if origin and ids <= set(origin.get("tables", [])):
        created, setup = origin.get("from", "?"), origin.get("setup", {})
    else:
        created, setup = previous.get("created", "?"), previous.get("setup", {})
    return {"tables": tables, "curves": [c for c in previous.get("curves", []) if c["id"] in ids],
            "created": created, "setup": setup}


def _in_repository(path: str) -> str:
    """A path inside the working folder (the repository's root) written relative to it: commands and JSON then
    hold no machine's root."""
    root = Path.cwd()
    return str(Path(path).relative_to(root)) if Path(path).is_relative_to(root) else path


def _portable(overrides: dict[str, Any]) -> dict[str, Any]:
    data = overrides.get("data")
    return {**overrides, "data": _in_repository(data)} if data else overrides
