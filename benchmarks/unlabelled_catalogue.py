"""Fine-tuning without labels on real cut-out photos, and whether the run's own label-free check tells a useful
adaptation from its start.

    .venv/bin/python benchmarks/unlabelled_catalogue.py --work runs/unlabelled-catalogue [--seeds 0 1 2] \\
        [--datasets catalogue fashion-mnist digits] [--settings default mutual ...] [--check on off] \\
        [--finished-only] [--save cpu-2core]

Data: the catalogue of benchmarks/catalogue.py (600 Fashion-MNIST photos cut out on white at varied shapes, 10
classes, letterboxed at 224 px as the pretrained pad export reads them), all of it adapted on (``--data``, read
without its folders' names) and searched (``--eval-data``, the same folder with them); and Fashion-MNIST / digits as
benchmarks/unlabelled.py has them (64 px, ``--eval-split train``). Transductive: the images adapted on are measured
with their hidden labels, which training never reads. Each run: the frozen EfficientNet-Lite0 (features cached in
WORK/cache), the command line's defaults otherwise (``--pseudo-labels clusters``, a 512-d head started at the
principal axes, multi-similarity loss, 10 epochs, lr 1e-3, batches of 16 x 4) but what ``SETTINGS`` changes.

``--check on`` (the default of ``retrieval train``): a share of the images is held out of training and the run's
label-free check (train/label_free_check.py) decides whether to deliver the trained model or keep the pretrained
export; ``--check off`` trains on every image and always delivers best.pt (the runs before the check existed).

Rows: the pretrained export (pooled features, no head) once per data set; per setting and check, mean ± half the
spread over the seeds of the start (epoch 0), best.pt as trained, and the delivered model (the start where the check
kept the pretrained export), each as MAP@R / Recall@1 change against the pretrained export; and, per run, whether the
check's verdict was right: kept a model that lost (MAP@R below the pretrained export's, or Recall@1 more than 0.01
below) or refused one that gained (MAP@R up by 0.01 or more with Recall@1 within 0.01).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from catalogue import IMAGE_SIZE, catalogue_folder  # beside this file: a script's folder comes first on sys.path
from results_io import SAVE_HELP, record_tables
from unlabelled import DATASETS, pretrained_once, signed_spread

TOLERANCE = 0.01  # the Recall@1 a delivered model may lose against the pretrained export
USEFUL_GAIN = 0.01  # a MAP@R gain a check ought to deliver (with Recall@1 within TOLERANCE)
CATALOGUE = dict(dataset="folder", image_size=IMAGE_SIZE, resize="pad")  # measured on --eval-data: the folder
DATA = {"catalogue": CATALOGUE, **{name: DATASETS[name] for name in ("fashion-mnist", "digits")}}
BASE = dict(labels="none", eval_split="train", backbone="efficientnet_lite0", pretrained=True, freeze_backbone=True,
            device="cpu", workers=0, plots=False, tensorboard=False)
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "mutual": {"pseudo_labels": "mutual"},
    "30 epochs": {"epochs": 30},
    "lr 1e-4": {"lr": 1e-4},
    "lr 3e-3": {"lr": 3e-3},
    # 8 classes a batch: Fashion-MNIST's and digits' few clusters fill it (16 would train on single images alone)
    "batch 32": {"batch_size": 32},
}


def config(dataset: str, setting: str, seed: int, check: str, work: Path, folder: Path | None) -> dict[str, Any]:
    """The TrainConfig fields of one run."""
    cfg = {**BASE, **DATA[dataset], **SETTINGS[setting], "seed": seed, "label_free_check": check == "on",
           "feature_cache": str(work / "cache" / dataset),
           "out": str(work / dataset / setting.replace(" ", "-") / f"check-{check}" / f"seed{seed}")}
    if dataset == "catalogue":  # the images without their folders' names, measured with them
        cfg["data"] = cfg["eval_data"] = str(folder)
    return cfg


def pretrained_reference(cfg: dict[str, Any], path: Path) -> dict[str, float]:
    """The pretrained export (pooled features, no head) on the run's measured images, kept in ``path``."""
    if "eval_data" not in cfg:
        return pretrained_once(cfg, path)
    if not path.is_file():
        import torch

        from retrieval.data import build_transforms
        from retrieval.data.unlabelled import load_labelled_sample
        from retrieval.metrics.evaluation import EvalSets, embed_eval_rows, eval_arrays, evaluate_embeddings
        from retrieval.models import create_pretrained_embedder

        model = create_pretrained_embedder(cfg["backbone"], cfg["image_size"], cfg["resize"])
        sets = EvalSets(load_labelled_sample(cfg["eval_data"], build_transforms(model.preprocessing, train=False)))
        query, gallery = embed_eval_rows(model, sets, torch.device("cpu"), workers=0, progress=False)
        metrics = evaluate_embeddings(*eval_arrays(query, gallery), with_clustering=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"recall@1": metrics["recall@1"], "map@r": metrics["map@r"],
                                    "images": len(query.labels)}))
    return json.loads(path.read_text())


def trained(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's report and per-epoch rows, trained once (a finished run is read back)."""
    from retrieval.train import TrainConfig, train

    out = Path(cfg["out"])
    if not (out / "report.json").is_file():
        started = time.perf_counter()
        train(TrainConfig(**cfg), progress=False)
        (out / "wall.json").write_text(json.dumps({"wall_s": time.perf_counter() - started}))
        print(json.dumps({"trained": str(out), "wall_s": round(time.perf_counter() - started)}), file=sys.stderr,
              flush=True)
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"report": report, "history": [r for r in rows if "recall@1" in r],
            "wall_s": json.loads((out / "wall.json").read_text())["wall_s"] if (out / "wall.json").is_file() else None}


def delivered(run: dict[str, Any]) -> dict[str, Any]:
    """The model the run delivers: the start (epoch 0) where it keeps the pretrained export, else best.pt."""
    report = run["report"]
    if report.get("keep_pretrained"):
        return next(r for r in run["history"] if r["epoch"] == 0)
    return report["best"]


def trained_row(run: dict[str, Any]) -> dict[str, Any]:
    """best.pt as trained: the check's record of it where the check delivered the start instead."""
    return (run["report"].get("label_free_check") or {}).get("trained") or run["report"]["best"]


def verdict(run: dict[str, Any], reference: dict[str, float]) -> str:
    """Whether the check was right, read with the hidden labels against ``reference`` (the pretrained export, or the
    start): 'kept a loser', 'refused a gain' or 'right'."""
    trained_model = trained_row(run)
    gain = trained_model["map@r"] - reference["map@r"]
    drop = reference["recall@1"] - trained_model["recall@1"]
    loses = gain < 0 or drop > TOLERANCE
    useful = gain >= USEFUL_GAIN and drop <= TOLERANCE
    kept = not run["report"].get("keep_pretrained", False)
    if kept and loses:
        return "kept a loser"
    if not kept and useful:
        return "refused a gain"
    return "right"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--datasets", nargs="+", default=["catalogue"], choices=list(DATA))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--check", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--work", help="the runs' folder (default: a new temporary one); finished runs are reused")
    parser.add_argument("--finished-only", action="store_true",
                        help="train nothing: a setting whose runs are not all finished in --work is left out")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(["unlabelled-catalogue", "unlabelled-catalogue-check"], args.save)
    work = Path(args.work or tempfile.mkdtemp(prefix="unlabelled-catalogue-"))
    folder = catalogue_folder(work, 60) if "catalogue" in args.datasets else None
    table, checks = [], []
    for dataset in args.datasets:
        first = config(dataset, "default", args.seeds[0], "off", work, folder)
        reference = pretrained_reference(first, work / dataset / "pretrained.json")
        table.append([dataset, "pretrained export (pooled features, no head)", "-", str(reference["images"]),
                      f"{reference['map@r']:.3f}", "-", f"{reference['recall@1']:.3f}", "-", "-", "-"])
        for setting in args.settings:
            for check in args.check:
                configs = [config(dataset, setting, seed, check, work, folder) for seed in args.seeds]
                if args.finished_only and not all((Path(c["out"]) / "report.json").is_file() for c in configs):
                    continue
                runs = [trained(c) for c in configs]
                starts = [next(r for r in run["history"] if r["epoch"] == 0) for run in runs]
                for name, rows in (("start (epoch 0)", starts), ("best.pt as trained", [trained_row(r)
                                                                                        for r in runs]),
                                   ("delivered", [delivered(r) for r in runs])):
                    if check == "off" and name == "delivered":
                        continue  # without the check best.pt is what is delivered
                    map_r, r1 = [r["map@r"] for r in rows], [r["recall@1"] for r in rows]
                    kept = ", ".join("keep" if r["report"].get("keep_pretrained") else "train" for r in runs) \
                        if name == "delivered" else "-"
                    wall = statistics.mean(r["wall_s"] for r in runs if r["wall_s"]) if any(
                        r["wall_s"] for r in runs) else None
                    table.append([dataset, f"{setting}, check {check}: {name}", kept, str(reference["images"]),
                                  f"{statistics.mean(map_r):.3f}",
                                  signed_spread([v - reference["map@r"] for v in map_r]),
                                  f"{statistics.mean(r1):.3f}", signed_spread([v - reference["recall@1"] for v in r1]),
                                  ", ".join(str(r.get("epoch", "?")) for r in rows),
                                  f"{wall / 60:.1f} min" if wall else "-"])
                if check == "on":
                    for seed, run, start in zip(args.seeds, runs, starts, strict=True):
                        found = run["report"].get("label_free_check") or {}
                        best = trained_row(run)
                        checks.append([dataset, setting, str(seed), f"{best['map@r'] - reference['map@r']:+.3f}",
                                       f"{best['recall@1'] - reference['recall@1']:+.3f}",
                                       f"{best['map@r'] - start['map@r']:+.3f}",
                                       f"{best['recall@1'] - start['recall@1']:+.3f}", _interval(found),
                                       "keep" if run["report"].get("keep_pretrained") else "train",
                                       verdict(run, reference), verdict(run, start)])
    print(f"\nTransductive, labels hidden from training; seeds {', '.join(map(str, args.seeds))}; change = against "
          "the pretrained export on the same images, mean ± half the spread.\n")
    print("| data set | model | delivered (per seed) | images | MAP@R | MAP@R change | Recall@1 | Recall@1 change | "
          "epoch | wall per run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    if checks:
        print("\nThe check against the hidden labels, per run: best.pt as trained against the pretrained export and "
              "against the start (epoch 0, what the check delivers instead); the check's proxy MAP@R gain on its "
              "held-out images with its 95% interval; a loser: MAP@R down or Recall@1 more than 0.01 down; a gain: "
              "MAP@R up 0.01 or more, Recall@1 within 0.01.\n")
        print("| data set | setting | seed | MAP@R change | Recall@1 change | MAP@R change from start | "
              "Recall@1 change from start | check: proxy MAP@R gain [95%] | decision | right, against the export? | "
              "right, against the start? |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in checks:
            print("| " + " | ".join(row) + " |")
        for column, against in ((-2, "the pretrained export"), (-1, "the start")):
            wrong = {kind: sum(row[column] == kind for row in checks) for kind in ("kept a loser", "refused a gain")}
            print(f"\nAgainst {against}, {len(checks)} runs: kept a loser {wrong['kept a loser']}, refused a gain "
                  f"{wrong['refused a gain']}")


def _interval(found: dict[str, Any]) -> str:
    if "gain" not in found:
        return found.get("reason", "-")
    low, high = found["interval"]
    return f"{found['gain']:+.3f} [{low:+.3f}, {high:+.3f}]"


if __name__ == "__main__":
    main()
