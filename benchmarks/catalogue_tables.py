"""The results tables of benchmarks/catalogue.py's runs files: the pretrained exports (pad against crop) and the runs
(BEFORE, best.pt, the last epoch, the gain over the pretrained pad export and whether keep_pretrained was right).

    .venv/bin/python benchmarks/catalogue_tables.py --table pretrained --name catalogue-pretrained \\
        --runs benchmarks/results/catalogue/runs-fashion-today-cpu-2core.json ...
    .venv/bin/python benchmarks/catalogue_tables.py --table runs --name catalogue-recipe --runs FILE ...
    .venv/bin/python benchmarks/catalogue_tables.py --table upgrade --name catalogue-upgrade --runs FILE

Numbers are the mean ± half the spread (max - min) / 2 over the seeds of a file; "by seed" cells list each seed's.
A run is right about keeping the pretrained export when its ``keep_pretrained`` is true exactly where its delivered
model (best.pt; wise.pt where the run made one) does not beat the pretrained pad export by ``MIN_GAIN`` Recall@1 on
the test split; a run that keeps it although the gain reaches ``MIN_GAIN`` (the paired bootstrap's interval reaches
0) is counted as "kept within noise", not as wrong.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
from results_io import write_result  # beside this file

MIN_GAIN = 0.02  # the Recall@1 gain worth re-indexing a catalogue for (train/pretrained_export.py's MIN_GAIN)
NAMES = {"fashion": "A: 600 Fashion-MNIST cut-outs, 10 classes", "shop": "B: shop, 634 photos, 22 categories"}
PAD = "pretrained pad export"


def spread(values: list[float]) -> str:
    """Mean ± half the spread, 3 decimals."""
    return f"{np.mean(values):.3f} ± {np.ptp(values) / 2:.3f}"


def by_seed(values: list[float], signed: bool = False) -> str:
    return " ".join(f"{value:+.3f}" if signed else f"{value:.3f}" for value in values)


def delivered(run: dict) -> float:
    """The delivered model's test Recall@1: wise.pt's where the run made one, else best.pt's."""
    wise = run.get("wise") or {}
    return float((wise.get("metrics") or {}).get("recall@1", run["recall@1"]))


def judged(run: dict, pretrained: float) -> str:
    """Whether the run's keep_pretrained was right against the measured gain ("-" where the run has none)."""
    if "keep_pretrained" not in run:
        return "-"
    beats = delivered(run) - pretrained >= MIN_GAIN
    if run["keep_pretrained"] != beats:
        return "right"
    return "kept within noise" if run["keep_pretrained"] else "wrong"


def pretrained_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for result in results:
        runs = result["runs"]
        for name in (key for key in runs if key.startswith("pretrained ")):
            recall = [run["recall@1"] for run in runs[name]]
            versus = "-"
            if name != PAD and PAD in runs:
                versus = by_seed([run["recall@1"] - c for run, c in zip(runs[PAD], recall, strict=True)],
                                 signed=True)
            rows.append([NAMES.get(result.get("catalogue", "fashion")), name.removeprefix("pretrained ").removesuffix(
                " export"), str(runs[name][0]["images"]), spread(recall), spread([run["map@r"] for run in runs[name]]),
                by_seed(recall), versus])
    return rows


def run_rows(results: list[dict]) -> list[list[str]]:
    rows = []
    for result in results:
        runs = result["runs"]
        pretrained = [run["recall@1"] for run in runs[PAD]]
        for name, seeds in runs.items():
            if name.startswith("pretrained "):
                continue
            gains = [delivered(run) - p for run, p in zip(seeds, pretrained, strict=True)]
            keep = [run.get("keep_pretrained") for run in seeds]
            verdicts = [judged(run, p) for run, p in zip(seeds, pretrained, strict=True)]
            rows.append([
                NAMES.get(result.get("catalogue", "fashion")), name, spread(pretrained),
                spread([run["before_recall@1"] for run in seeds]),
                f"{spread([run['recall@1'] for run in seeds])} ({', '.join(str(run['epoch']) for run in seeds)})",
                spread([run["last_recall@1"] for run in seeds]), spread([run["map@r"] for run in seeds]),
                by_seed(gains, signed=True), f"{sum(g >= MIN_GAIN for g in gains)}/{len(gains)}",
                " ".join("-" if k is None else ("yes" if k else "no") for k in keep),
                "-" if verdicts[0] == "-" else f"{verdicts.count('right')}/{len(verdicts)} right"
                + "".join(f", {verdicts.count(v)} {v}" for v in ("kept within noise", "wrong") if v in verdicts)])
    return rows


def printed_object(text: str, key: str) -> dict:
    """The object printed under ``key`` in ``--json`` output (whose start may have been cut off), else {}."""
    at = text.find(f'"{key}": {{')
    return json.JSONDecoder().raw_decode(text[at + len(key) + 4:])[0] if at >= 0 else {}


def upgrade_rows(results: list[dict]) -> list[list[str]]:
    """benchmarks/catalogue_upgrade.py's document: what upgrade measured and did, and what search scored."""
    rows = []
    for result in results:
        said = result["steps"]["upgrade"]["stdout"]
        labels, verdict = printed_object(said, "on_labels"), printed_object(said, "compatibility")
        done = "refused" if result["steps"]["upgrade"]["rc"] else "accepted"
        if "upgrade --force" in result["steps"]:
            done += ", then forced" + ("" if not result["steps"]["upgrade --force"]["rc"] else " (failed)")
        rows.append([str(result["seed"]), done, verdict.get("verdict") or "-"])
        for model in ("old", "new", "cross_model"):
            rows[-1].append(f"{labels[model]['recall@1']:.3f} / {labels[model]['map@r']:.3f}" if model in labels
                            else "-")
        rows[-1] += [f"{result[key]['recall@1']:.3f} / {result[key]['map@r']:.3f}"
                     for key in ("search before", "search after")]
        rows[-1].append("-" if "keep_pretrained" not in result else ("yes" if result["keep_pretrained"] else "no"))
    return rows


COLUMNS = {
    "pretrained": ["catalogue", "pretrained export (224 px)", "test images", "Recall@1", "MAP@R", "Recall@1 by seed",
                   "pad - crop Recall@1 by seed"],
    "runs": ["catalogue", "run", "pretrained pad Recall@1", "BEFORE Recall@1", "best.pt Recall@1 (epoch by seed)",
             "last epoch Recall@1", "best.pt MAP@R", "gain over pretrained pad by seed", "gain >= 0.02",
             "keep_pretrained by seed", "keep_pretrained"],
    "upgrade": ["seed", "index upgrade", "training's BCT verdict", "on the index's labels: old R@1 / MAP@R",
                "new", "new queries, old vectors", "search before (test queries) R@1 / MAP@R", "search after",
                "run's keep_pretrained"],
}
TABLES = {"pretrained": pretrained_rows, "runs": run_rows, "upgrade": upgrade_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", required=True, choices=list(COLUMNS))
    parser.add_argument("--name", required=True, help="the results file's benchmark name")
    parser.add_argument("--runs", nargs="+", required=True, type=Path, help="benchmarks/catalogue.py --out files")
    parser.add_argument("--notes", help="what the table's runs were (their commands)")
    args = parser.parse_args()
    results = [json.loads(path.read_text(encoding="utf-8")) for path in args.runs]
    rows = TABLES[args.table](results)
    command = shlex.join([".venv/bin/python", "benchmarks/catalogue_tables.py", *sys.argv[1:]])
    path = write_result(args.name, "cpu-2core", command, COLUMNS[args.table], rows, notes=args.notes,
                        date=results[0].get("date"))
    print(f"| {' | '.join(COLUMNS[args.table])} |")
    print("|" + "---|" * len(COLUMNS[args.table]))
    for row in rows:
        print(f"| {' | '.join(row)} |")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
