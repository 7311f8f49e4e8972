"""Does a label-free criterion predict what fine-tuning without labels did to Recall@1 and MAP@R? The guard's check.

    .venv/bin/python benchmarks/unlabelled_guard.py --work runs/unlabelled [--save cpu-2core]

Reads the finished runs of benchmarks/unlabelled.py in ``--work`` (that script's ``--work`` folder: the
pseudo-label runs, ``clusters`` and ``mutual``, of every data set, setting and seed, and the cached backbone features
in ``WORK/cache``); trains nothing and embeds no image. For each run, last.pt against the pretrained backbone (its
pooled features): the Recall@1 and MAP@R change on the run's evaluation split (leave-one-out), and label-free
criteria computed on the run's sampled train images (the sample training measures ``neighbours_kept@10`` on),
comparing the pretrained features' neighbours with last.pt's:

* kept@10: the share of each image's 10 nearest neighbours kept (the guard's ``neighbours_kept@10``, checked against
  the value the run logged); kept@1: the nearest neighbour kept;
* mutual top-1 pairs kept @1 / @5: the pairs that are each other's nearest neighbour in the pretrained features, still
  each within the other's 1 / 5 nearest under last.pt;
* margin-weighted kept@1: kept@1 weighted by the pretrained similarity margin of the nearest over the second nearest;
  kept@1, confident half: kept@1 over the images whose margin is at least the median;
* model's nearest in pretrained top-10: the share of images whose nearest neighbour under last.pt is among their 10
  nearest in the pretrained features.

Tables: per criterion the Spearman correlation over the runs with the Recall@1 change (95% bootstrap interval over
runs) and with the MAP@R change, and the ROC AUC for telling the runs that lost more than ``TOLERANCE`` Recall@1; the
split-half reliability of the two changes (each run's evaluation queries split in random halves, the runs ranked on
each half; seeded); per criterion the lowest floor at which every run stays within ``TOLERANCE`` Recall@1 (a run
below the floor falls back to its start, epoch 0, as best.pt does) and how many trained models it still delivers;
and the checks against what the runs logged. ``--save`` writes them to benchmarks/results/unlabelled-guard*.json
(docs/BENCHMARKS.md shows them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
from results_io import SAVE_HELP, record_tables  # beside this file: a script's folder comes first on sys.path

METHODS = ("clusters", "mutual")  # benchmarks/unlabelled.py's pseudo-label runs
KEPT = "neighbours_kept@10"
TOLERANCE = 0.01  # the Recall@1 a run may lose against the pretrained backbone
CRITERIA = {
    "kept@10": "kept@10 (today's guard)",
    "kept@1": "kept@1",
    "mutual@1": "mutual top-1 pairs kept @1",
    "mutual@5": "mutual top-1 pairs kept @5",
    "margin@1": "margin-weighted kept@1",
    "confident@1": "kept@1, confident half",
    "nn_in_top10": "model's nearest in pretrained top-10",
}


def find_runs(work: Path) -> list[Path]:
    """The pseudo-label runs in ``work`` (WORK/DATASET/SETTING/METHOD/seedN) that finished."""
    return sorted(run for run in work.glob("*/*/*/seed*")
                  if run.parts[-2] in METHODS and (run / "last.pt").is_file() and (run / "report.json").is_file())


def cached(cfg: Any, model: Any, split: str, work: Path, unlabelled: bool = False):
    """The backbone features of ``split`` the run cached in WORK/cache (``Embedded``: embeddings, labels, indices)."""
    import torch

    from retrieval.train.feature_cache import cached_features, dataset_key

    key = dataset_key(cfg, model, split, unlabelled=unlabelled)
    return cached_features(model.backbone, None, key, work / "cache", torch.device("cpu"), 64, 0, False,
                           f"features {split}", progress=False)


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (float32)."""
    x = np.asarray(x, dtype=np.float64)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def criteria(pre: np.ndarray, model: np.ndarray) -> dict[str, float]:
    """The label-free criteria of one run: ``pre`` the pretrained features of the sampled train images, ``model``
    last.pt's embeddings of them (unit rows, the same images)."""
    from retrieval.compatibility import neighbour_overlap, top_k

    rows = np.arange(len(pre))
    pre2, pre10 = top_k(pre, 2), top_k(pre, 10)
    model5 = top_k(model, 5)
    kept1 = neighbour_overlap(pre, model, 1)
    # the pretrained margin: similarity of the nearest neighbour minus that of the second
    margin = np.clip(np.einsum("ij,ij->i", pre, pre[pre2[:, 0]]) - np.einsum("ij,ij->i", pre, pre[pre2[:, 1]]), 0,
                     None)
    nearest = pre2[:, 0]
    mutual = (nearest[nearest] == rows) & (rows < nearest)  # each pair once
    i, j = rows[mutual], nearest[mutual]

    def pairs_kept(k: int) -> float:
        return float(np.mean((model5[i, :k] == j[:, None]).any(1) & (model5[j, :k] == i[:, None]).any(1)))

    return {"kept@10": float(neighbour_overlap(pre, model, 10).mean()), "kept@1": float(kept1.mean()),
            "mutual@1": pairs_kept(1), "mutual@5": pairs_kept(5),
            "margin@1": float((margin * kept1).sum() / margin.sum()),
            "confident@1": float(kept1[margin >= np.median(margin)].mean()),
            "nn_in_top10": float((pre10 == model5[:, :1]).any(1).mean())}


def history(run: Path) -> list[dict[str, Any]]:
    """The run's evaluation rows, one an epoch (epoch 0: the start)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if "recall@1" in row]


def measure(run: Path, work: Path) -> dict[str, Any]:
    """One run: its Recall@1 / MAP@R change against the pretrained backbone (last.pt and the start), per-query
    changes, the criteria, and what to check them against."""
    import torch

    from retrieval.metrics import per_query_metrics
    from retrieval.metrics.evaluation import leave_one_out_metrics, seeded_subset
    from retrieval.models import load_embedder
    from retrieval.train import TrainConfig
    from retrieval.train.data import UNLABELLED_EVAL_IMAGES

    cfg = TrainConfig(**json.loads((run / "config.json").read_text())["train"])
    model = load_embedder(run / "last.pt")
    head = model.head.eval()
    train = cached(cfg, model, "train", work, unlabelled=True)
    evaluated = cached(cfg, model, cfg.eval_split, work)
    # the train images training measured neighbours_kept@10 on: the seeded sample of the train split
    n = len(train.indices) + len(train.bad)  # the train split's images, read or not
    limit = cfg.eval_limit or UNLABELLED_EVAL_IMAGES
    sample = np.asarray(seeded_subset(range(n), limit, cfg.seed).indices if n > limit else np.arange(n))
    row = np.full(n, -1)
    row[train.indices] = np.arange(len(train.indices))
    features = train.embeddings[row[sample][row[sample] >= 0]]
    with torch.no_grad():
        sample_embedded = head(torch.from_numpy(features)).numpy()
        eval_embedded = head(torch.from_numpy(evaluated.embeddings)).numpy()
    pretrained = json.loads((run.parent.parent / "pretrained.json").read_text())
    last = leave_one_out_metrics(eval_embedded, evaluated.labels)
    pre = leave_one_out_metrics(unit(evaluated.embeddings), evaluated.labels)
    per_query = {name: per_query_metrics(x, evaluated.labels, ks=(1,), metrics=("recall", "map@r"))
                 for name, x in (("last", eval_embedded), ("pre", unit(evaluated.embeddings)))}
    logged = history(run)
    start = next(r for r in logged if r["epoch"] == 0)
    return {"run": "/".join(run.parts[-4:]), "setting": run.parts[-3],
            "d_r1": last["recall@1"] - pretrained["recall@1"], "d_map": last["map@r"] - pretrained["map@r"],
            "start_d_r1": start["recall@1"] - pretrained["recall@1"],
            "start_d_map": start["map@r"] - pretrained["map@r"],
            "q_r1": per_query["last"]["recall@1"] - per_query["pre"]["recall@1"],
            "q_map": per_query["last"]["map@r"] - per_query["pre"]["map@r"],
            **criteria(unit(features), unit(sample_embedded)),
            "check_kept": logged[-1][KEPT], "check_r1": logged[-1]["recall@1"] - last["recall@1"],
            "check_pre_r1": pre["recall@1"] - pretrained["recall@1"],
            "check_pre_map": pre["map@r"] - pretrained["map@r"]}


def bootstrap_spearman(x: np.ndarray, y: np.ndarray, rng: np.random.Generator, draws: int) -> tuple[float, float]:
    """The 95% percentile interval of Spearman's rho over ``draws`` resamplings of the runs."""
    from scipy.stats import spearmanr

    values = []
    for _ in range(draws):
        pick = rng.integers(0, len(x), len(x))
        values.append(spearmanr(x[pick], y[pick])[0])
    low, high = np.nanpercentile(values, [2.5, 97.5])
    return float(low), float(high)


def print_criteria(runs: list[dict[str, Any]], rng: np.random.Generator, draws: int) -> None:
    """Per criterion: Spearman with the Recall@1 change (bootstrap interval) and the MAP@R change, and the AUC."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    d_r1, d_map = np.array([r["d_r1"] for r in runs]), np.array([r["d_map"] for r in runs])
    lost = d_r1 < -TOLERANCE
    print(f"\n{len(runs)} pseudo-label runs (last.pt against the pretrained backbone): Recall@1 change "
          f"{d_r1.min():+.3f} to {d_r1.max():+.3f}, {int(lost.sum())} lost more than {TOLERANCE}; MAP@R change "
          f"{d_map.min():+.3f} to {d_map.max():+.3f}. Spearman over the runs, 95% bootstrap interval over runs "
          f"({draws} draws); AUC: the criterion telling the runs that kept Recall@1 within {TOLERANCE} from those "
          "that lost more (0.5: chance).\n")
    print("| criterion | Spearman with Recall@1 change [95% interval] | Spearman with MAP@R change | "
          f"AUC, lost > {TOLERANCE} Recall@1 |")
    print("|---|---|---|---|")
    for name, label in CRITERIA.items():
        x = np.array([r[name] for r in runs])
        low, high = bootstrap_spearman(x, d_r1, rng, draws)
        auc = roc_auc_score(~lost, x) if 0 < lost.sum() < len(runs) else float("nan")
        print(f"| {label} | {spearmanr(x, d_r1)[0]:+.2f} [{low:+.2f}, {high:+.2f}] | {spearmanr(x, d_map)[0]:+.2f} | "
              f"{auc:.2f} |")


def split_half(changes: list[np.ndarray], rng: np.random.Generator, splits: int) -> float:
    """The mean over ``splits`` random halvings of each run's queries of Spearman's rho between the runs' mean
    change on one half and on the other."""
    from scipy.stats import spearmanr

    values = []
    for _ in range(splits):
        first, second = [], []
        for change in changes:
            half = rng.permutation(len(change)) < len(change) // 2
            first.append(np.nanmean(change[half]))
            second.append(np.nanmean(change[~half]))
        values.append(spearmanr(first, second)[0])
    return float(np.mean(values))


def print_reliability(runs: list[dict[str, Any]], rng: np.random.Generator, splits: int) -> None:
    """Split-half reliability of the Recall@1 and MAP@R changes, with their spread over runs and per-run noise."""
    print(f"\nHow reliably the evaluation ranks the runs by each change: each run's queries split in two random halves "
          f"({splits} splits, seeded), the runs' mean change on one half against the other (Spearman), and the "
          "whole split's reliability from it (Spearman-Brown, 2r / (1 + r)); the spread of the change over runs and "
          "its standard error from the queries within a run (paired, mean over runs).\n")
    print("| change | runs | standard deviation over runs | standard error within a run | split-half Spearman | "
          "reliability (Spearman-Brown) |")
    print("|---|---|---|---|---|---|")
    for label, per_query, total in (("Recall@1", "q_r1", "d_r1"), ("MAP@R", "q_map", "d_map")):
        changes = [r[per_query] for r in runs]
        half = split_half(changes, rng, splits)
        error = np.mean([np.nanstd(c, ddof=1) / np.sqrt(np.isfinite(c).sum()) for c in changes])
        print(f"| {label} | {len(runs)} | {np.std([r[total] for r in runs], ddof=1):.4f} | {error:.4f} | "
              f"{half:+.2f} | {2 * half / (1 + half):+.2f} |")


def print_floors(runs: list[dict[str, Any]]) -> None:
    """Per criterion: the lowest floor that keeps every run within TOLERANCE Recall@1 (last.pt where it meets the
    floor, else the start) and how many trained models it delivers."""
    print(f"\nA floor on each criterion, as the guard puts one on kept@10: last.pt where it meets the floor, else the "
          f"run's start (epoch 0, what best.pt holds then). The lowest floor (of the runs' values) at which every run "
          f"stays within {TOLERANCE} Recall@1 of the pretrained backbone, the trained models (last.pt) it still "
          f"delivers, and the changes of what it picks; the start's worst Recall@1 change is "
          f"{min(r['start_d_r1'] for r in runs):+.3f}.\n")
    print("| criterion | lowest floor | trained models delivered | mean Recall@1 change | worst Recall@1 change | "
          "mean MAP@R change |")
    print("|---|---|---|---|---|---|")

    def line(label: str, floor: str, chosen: list[bool]) -> None:
        r1 = [r["d_r1"] if c else r["start_d_r1"] for r, c in zip(runs, chosen, strict=True)]
        mp = [r["d_map"] if c else r["start_d_map"] for r, c in zip(runs, chosen, strict=True)]
        print(f"| {label} | {floor} | {sum(chosen)}/{len(runs)} | {np.mean(r1):+.4f} | {min(r1):+.4f} | "
              f"{np.mean(mp):+.4f} |")

    line("none (last.pt always)", "-", [True] * len(runs))
    for name, label in CRITERIA.items():
        for floor in sorted({r[name] for r in runs}):
            chosen = [r[name] >= floor for r in runs]
            if all((r["d_r1"] if c else r["start_d_r1"]) >= -TOLERANCE for r, c in zip(runs, chosen, strict=True)):
                line(label, f"{floor:.4f}", chosen)
                break
        else:
            line(label, "none (the start only)", [False] * len(runs))


def print_checks(runs: list[dict[str, Any]]) -> None:
    """What this script recomputes against what the runs logged."""
    print("\nChecks, over the runs: the figures recomputed here from the cached features against what the runs "
          "logged (metrics.jsonl, last epoch; pretrained.json).\n")
    print("| check | runs | largest difference |")
    print("|---|---|---|")
    checks = (("kept@10 here - logged neighbours_kept@10", [r["kept@10"] - r["check_kept"] for r in runs]),
              ("last.pt Recall@1: logged - recomputed", [r["check_r1"] for r in runs]),
              ("pretrained Recall@1: recomputed - pretrained.json", [r["check_pre_r1"] for r in runs]),
              ("pretrained MAP@R: recomputed - pretrained.json", [r["check_pre_map"] for r in runs]))
    for label, differences in checks:
        print(f"| {label} | {len(runs)} | {max(differences, key=abs):.2g} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="runs/unlabelled",
                        help="benchmarks/unlabelled.py's --work folder (default runs/unlabelled)")
    parser.add_argument("--seed", type=int, default=0, help="of the bootstrap and the split halves (default 0)")
    parser.add_argument("--bootstrap", type=int, default=2000, help="bootstrap draws (default 2000)")
    parser.add_argument("--splits", type=int, default=200, help="random query halvings (default 200)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    paths = find_runs(work)
    if not paths:
        parser.error(f"--work {work}: no finished clusters / mutual runs (WORK/DATASET/SETTING/METHOD/seedN)")
    record_tables(["unlabelled-guard", "unlabelled-guard-reliability", "unlabelled-guard-floors",
                   "unlabelled-guard-checks"], args.save)
    runs = [measure(run, work) for run in paths]
    rng = np.random.default_rng(args.seed)
    print_criteria(runs, rng, args.bootstrap)
    print_reliability(runs, rng, args.splits)
    print_floors(runs)
    print_checks(runs)


if __name__ == "__main__":
    main()
