"""Fine-tuning without labels (`retrieval train --labels none`) against the pretrained backbone and labelled training.

    .venv/bin/python benchmarks/unlabelled.py --seeds 0 1 2 --work runs/unlabelled \\
        --emoji-data artifacts/demo/data/emoji [--datasets digits fashion-mnist emoji] [--epochs 6] \\
        [--instance] [--save cpu-2core]
    .venv/bin/python benchmarks/unlabelled.py --fast-default --seeds 0 1 2 --work runs/unlabelled-default

Three labelled data sets, their train split's labels hidden from training (each image its own class; the pseudo-labels
group them): digits (sklearn, classes 0-4 train, 5-9 test), Fashion-MNIST (disjoint protocol, ``limit_per_class``
images of each class) and the demo's emoji read by Unicode subgroup (``DEMO_RECIPE``'s data, 128 px letterboxed). Two
settings, the same training:

* transductive: the images adapted on are the images searched (``--eval-split train``, measured with the train
  split's labels, which training never reads);
* inductive: adapted on the train split, measured on the test split (classes never seen).

Rows, each measured leave-one-out on the same evaluation images (Recall@1, MAP@R; and ``neighbours_kept@10``, the
share of each sampled train image's 10 nearest neighbours kept from the pretrained backbone's pooled features):

* the pretrained EfficientNet-Lite0 as it is (its pooled features, no head, at the recipe's size and resize);
* ``--pseudo-labels clusters`` and ``mutual``: a 512-d head on the frozen backbone (features cached under
  ``WORK/cache``), multi-similarity loss, ``--epochs`` epochs, evaluated every epoch; best.pt (the guard's choice,
  ``--kept-floor`` 0.5) and the last epoch (no guard);
* the same recipe with the labels given (``--labels given``), best.pt chosen as labelled training chooses it (on a
  validation split where one is carved, else on the evaluation split itself: optimistic, marked in the table);
* ``--instance``: instance discrimination (NT-Xent on each image's two augmented views, the whole backbone
  fine-tuned) on a small digits subset, a few epochs.
* ``--fast-default`` (alone: the runs above are left out): the default of ``retrieval train --labels none`` on a CPU
  against the whole backbone, on the instance rows' digits subset (a catalogue of a few hundred images): every option
  at the command line's default (``--pseudo-labels clusters``, multi-similarity loss, batches of 16 images x 4 views,
  crop-flip, ``--epochs`` 10, lr 1e-3, backbone lr 1e-4) but the subset and its size, 64 px; "whole":
  ``--no-freeze-backbone``, the whole backbone fine-tuned; "default": ``--freeze-backbone`` left unset, which the
  trainer settles on a CPU (a head on the backbone's cached features). Trained once per seed and measured on the train
  images (transductive, every epoch) and, from best.pt, on the test split's unseen digits (inductive); the wall time
  of each run is kept beside it.

Then, from every unlabelled run's per-epoch rows, the Recall@1 change against the pretrained row of the epoch the
guard would choose at each kept floor (``FLOORS``): the measurement the default ``--kept-floor`` is chosen by.

Mean ± standard deviation over the seeds. Finished runs in ``--work`` are read back, not trained again. ``--save``
writes the printed tables to benchmarks/results/unlabelled-*.json (docs/BENCHMARKS.md shows them).
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

from results_io import SAVE_HELP, record_tables  # beside this file: a script's folder comes first on sys.path

KEPT = "neighbours_kept@10"
FLOORS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
TOLERANCE = 0.01  # the Recall@1 a guarded run may lose against the pretrained backbone
DATASETS: dict[str, dict[str, Any]] = {
    "digits": dict(dataset="digits", dataset_kwargs={"protocol": "disjoint"}, image_size=64),
    "fashion-mnist": dict(dataset="fashion-mnist", dataset_kwargs={"protocol": "disjoint", "limit_per_class": 100},
                          image_size=64),
    "emoji": dict(dataset="emoji", dataset_kwargs={"reading": "subgroup"}, image_size=128, resize="pad"),
}
# labelled batches need batch_size / per_class classes, and these train splits have 5: 60 = 5 x 12 (the results grid's
# recipe for Fashion-MNIST disjoint)
FEW_CLASSES = {"digits": dict(batch_size=60, per_class=12), "fashion-mnist": dict(batch_size=60, per_class=12)}
SETTINGS = {"transductive": "train", "inductive": "test"}  # setting -> the split measured
HEAD = dict(backbone="efficientnet_lite0", pretrained=True, freeze_backbone=True, embedding_dim=512, loss="ms",
            batch_size=64, per_class=4, batches_per_epoch=20, lr=1e-3, optimizer="adamw", augment="none", eval_every=1,
            eval_before=True, plots=False, workers=0)
METHODS: dict[str, dict[str, Any]] = {
    "clusters": dict(labels="none", pseudo_labels="clusters"),
    "mutual": dict(labels="none", pseudo_labels="mutual"),
    "labelled": dict(labels="given"),
}
# labelled training on the images it is then measured on would read the very labels it is scored with: inductive only
SETTING_METHODS = {"transductive": ("clusters", "mutual"), "inductive": tuple(METHODS)}
# instance discrimination: the whole backbone, two augmented views of each image, on a small digits subset
INSTANCE = dict(dataset="digits", dataset_kwargs={"protocol": "disjoint", "limit_per_class": 40}, image_size=64,
                backbone="efficientnet_lite0", pretrained=True, freeze_backbone=False, embedding_dim=512,
                loss="ntxent", batch_size=32, per_class=2, lr=1e-3, backbone_lr=1e-4, optimizer="adamw",
                augment="light", labels="none", pseudo_labels="instance", eval_every=1, eval_before=True,
                plots=False, workers=0)


# the default label-free run on a catalogue of a few hundred images: the command line's defaults but the data, the
# size, the run folder and the feature cache; FAST_DEFAULT's backbone choices side by side
DEFAULT_RUN = dict(dataset="digits", dataset_kwargs={"protocol": "disjoint", "limit_per_class": 40}, image_size=64,
                   labels="none", eval_split="train", device="cpu", plots=False, tensorboard=False)
FAST_DEFAULT = {"whole": dict(freeze_backbone=False), "default": {}}  # {}: --freeze-backbone left unset
ASSUMED_DEFAULTS = dict(backbone="efficientnet_lite0", pretrained=True, pseudo_labels="clusters", loss="ms",
                        batch_size=64, per_class=4, augment="crop-flip", epochs=10, lr=1e-3, eval_every=1)


def recipe(dataset: str, setting: str, method: str, seed: int, epochs: int, work: Path,
           emoji_data: str | None) -> dict[str, Any]:
    """The TrainConfig values of one run."""
    base = {**HEAD, **DATASETS[dataset], **METHODS[method], "eval_split": SETTINGS[setting], "epochs": epochs,
            "seed": seed, "feature_cache": str(work / "cache"), "out": str(work / dataset / setting / method /
                                                                        f"seed{seed}")}
    if dataset == "emoji":
        base["data"] = emoji_data
    if method == "labelled" and dataset in FEW_CLASSES:  # 5 train classes: a batch holds all of them
        base |= FEW_CLASSES[dataset]
    return base


def trained(config: dict[str, Any]) -> dict[str, Any]:
    """The run's report and its per-epoch rows, trained once (a finished run is read back)."""
    from retrieval.train import TrainConfig, train

    out = Path(config["out"])
    if not (out / "report.json").is_file():
        start = time.perf_counter()
        train(TrainConfig(**config), progress=False)
        print(json.dumps({"trained": str(out), "wall_s": round(time.perf_counter() - start)}), file=sys.stderr,
              flush=True)
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"report": report, "history": [r for r in rows if "recall@1" in r]}


def pretrained_metrics(config: dict[str, Any]) -> dict[str, float]:
    """The pretrained backbone's pooled features on the run's evaluation split, measured as training measures it."""
    import torch

    from retrieval.data import build_transforms
    from retrieval.metrics.evaluation import embed_eval_rows, eval_arrays, evaluate_embeddings, load_eval_sets
    from retrieval.models import create_pretrained_embedder

    model = create_pretrained_embedder(config["backbone"], config["image_size"], config.get("resize", "crop"))
    sets = load_eval_sets(config["dataset"], config.get("data"), config["eval_split"],
                          build_transforms(model.preprocessing, train=False), None, config["seed"],
                          **config["dataset_kwargs"])
    query, gallery = embed_eval_rows(model, sets, torch.device("cpu"), workers=0, progress=False)
    metrics = evaluate_embeddings(*eval_arrays(query, gallery), with_clustering=False)
    return {"recall@1": metrics["recall@1"], "map@r": metrics["map@r"], KEPT: 1.0, "images": len(query.labels)}


def pretrained_once(config: dict[str, Any], path: Path) -> dict[str, float]:
    """``pretrained_metrics``, kept in ``path`` (the pretrained backbone has no seed)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pretrained_metrics(config)))
    return json.loads(path.read_text())


def guard_choice(history: list[dict[str, Any]], floor: float) -> dict[str, Any]:
    """The epoch best.pt holds under the guard at ``floor``: the latest trained epoch whose images keep ``floor`` of
    their pretrained neighbours, else the start (epoch 0)."""
    kept = [r for r in history if r["epoch"] > 0 and r.get(KEPT, -1.0) >= floor]
    return kept[-1] if kept else next(r for r in history if r["epoch"] == 0)


def cell(values: list[float]) -> str:
    """Mean ± standard deviation (the value alone for one)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def signed(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):+.3f}{spread}"


def row_of(report: dict[str, Any], which: str) -> dict[str, Any]:
    return report[which] or {}


def default_run(choice: str, seed: int, work: Path) -> dict[str, Any]:
    """One run of ``--fast-default``: trained once (wall time kept in wall.json), its transductive report and per-epoch
    rows, and best.pt measured on the test split (inductive.json)."""
    from retrieval.train import TrainConfig

    out = work / "fast-default" / choice / f"seed{seed}"
    # a cache of its own: each run computes the features it needs, as a first run on a catalogue does
    config = {**DEFAULT_RUN, **FAST_DEFAULT[choice], "seed": seed, "out": str(out),
              "feature_cache": str(work / "cache" / choice / f"seed{seed}")}
    defaults = TrainConfig(dataset="digits")
    changed = {k: v for k, v in ASSUMED_DEFAULTS.items() if getattr(defaults, k) != v}
    assert not changed, f"the command line's defaults moved ({changed}): say so in the docstring"
    if not (out / "report.json").is_file():
        start = time.perf_counter()
        trained(config)
        (out / "wall.json").write_text(json.dumps({"wall_s": time.perf_counter() - start}))
    run = trained(config)
    run["wall_s"] = json.loads((out / "wall.json").read_text())["wall_s"]
    run["frozen"] = run["report"]["config"]["train"]["freeze_backbone"]
    if not (out / "inductive.json").is_file():
        (out / "inductive.json").write_text(json.dumps(checkpoint_metrics(out / "best.pt", config, "test")))
    run["inductive"] = json.loads((out / "inductive.json").read_text())
    return run


def checkpoint_metrics(checkpoint: Path, config: dict[str, Any], split: str) -> dict[str, float]:
    """A checkpoint's Recall@1 and MAP@R on ``split`` of the run's data set, measured as training measures."""
    import torch

    from retrieval.data import build_transforms
    from retrieval.metrics.evaluation import embed_eval_rows, eval_arrays, evaluate_embeddings, load_eval_sets
    from retrieval.models import load_embedder

    model = load_embedder(checkpoint).eval()
    sets = load_eval_sets(config["dataset"], config.get("data"), split,
                          build_transforms(model.preprocessing, train=False), None, config["seed"],
                          **config["dataset_kwargs"])
    query, gallery = embed_eval_rows(model, sets, torch.device("cpu"), workers=0, progress=False)
    metrics = evaluate_embeddings(*eval_arrays(query, gallery), with_clustering=False)
    return {"recall@1": metrics["recall@1"], "map@r": metrics["map@r"], "images": len(query.labels)}


def half_spread(values: list[float], digits: int = 3) -> str:
    """Mean ± half the spread (max - min) over the seeds."""
    return f"{statistics.mean(values):.{digits}f} ± {(max(values) - min(values)) / 2:.{digits}f}"


def signed_spread(values: list[float]) -> str:
    """A change: mean ± half the spread over the seeds, signed."""
    return f"{statistics.mean(values):+.3f} ± {(max(values) - min(values)) / 2:.3f}"


def print_fast_default(args: argparse.Namespace, work: Path) -> None:
    """The default label-free run on a CPU against the whole backbone: MAP@R and Recall@1 and their change from the
    pretrained backbone, the neighbours kept, the epochs whose clusters were too few to fill a batch (they train on
    each image's own views), and the wall time of a run."""
    runs = {choice: [default_run(choice, seed, work) for seed in args.seeds] for choice in FAST_DEFAULT}
    references = {}
    for setting, split in SETTINGS.items():
        config = {**ASSUMED_DEFAULTS, **DEFAULT_RUN, "eval_split": split, "seed": args.seeds[0], "resize": "crop"}
        references[setting] = pretrained_once(config, work / "fast-default" / f"pretrained-{setting}.json")
    print(f"\nThe default of --labels none on this CPU against the whole backbone: digits, "
          f"{DEFAULT_RUN['dataset_kwargs']['limit_per_class']} images a class, {DEFAULT_RUN['image_size']} px, "
          f"every other option the command line's; best.pt (the guard, kept floor 0.5); mean ± half the spread over "
          f"seeds {', '.join(map(str, args.seeds))}.\n")
    print("| setting | model | backbone | MAP@R | MAP@R change | Recall@1 | Recall@1 change | neighbours_kept@10 | "
          "epochs on own views | wall per run |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    names = {"whole": "--no-freeze-backbone", "default": "the default (left unset)"}
    for setting in SETTINGS:
        reference = references[setting]
        print(f"| {setting} | pretrained backbone | - | {reference['map@r']:.3f} | - | {reference['recall@1']:.3f} | "
              "- | 1 | - | - |")
        picked = {choice: [run["report"]["best"] if setting == "transductive" else run["inductive"]
                           for run in runs[choice]] for choice in FAST_DEFAULT}
        if setting == "transductive":  # epoch 0: the principal-axes head, before any step (the guard's fallback)
            picked = {"start": [next(r for r in run["history"] if r["epoch"] == 0) for run in runs["default"]],
                      **picked}
        for choice, rows in picked.items():
            group = runs.get(choice, runs["default"])
            frozen = {run["frozen"] for run in group}
            backbone = "-" if choice == "start" else "frozen (cached features)" if frozen == {True} else \
                "fine-tuned" if frozen == {False} else "mixed"
            kept = half_spread([r[KEPT] for r in rows]) if all(KEPT in r for r in rows) else \
                half_spread([run["report"]["best"][KEPT] for run in group])
            fallbacks = "-" if choice == "start" else ", ".join(
                str(sum(bool(r.get("pseudo_labels", {}).get("kept_previous")) for r in run["history"]))
                for run in group)
            wall = "-" if choice == "start" else half_spread([run["wall_s"] / 60 for run in group], 1) + " min"
            name = names.get(choice, "start (principal-axes head, epoch 0)")
            print(f"| {setting} | {name} | {backbone} | {half_spread([r['map@r'] for r in rows])} | "
                  f"{signed_spread([r['map@r'] - reference['map@r'] for r in rows])} | "
                  f"{half_spread([r['recall@1'] for r in rows])} | "
                  f"{signed_spread([r['recall@1'] - reference['recall@1'] for r in rows])} | {kept} | {fallbacks} | "
                  f"{wall} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--epochs", type=int, default=6, help="epochs of each head run (default 6)")
    parser.add_argument("--emoji-data", help="the rendered emoji folder (`make demo` writes artifacts/demo/data/emoji)")
    parser.add_argument("--instance", action="store_true", help="also instance discrimination on a digits subset")
    parser.add_argument("--instance-epochs", type=int, default=3)
    parser.add_argument("--fast-default", action="store_true",
                        help="only the default of --labels none on a CPU against the whole backbone")
    parser.add_argument("--work", help="the runs' folder (default: a new temporary one); finished runs are reused")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="unlabelled-"))
    if args.fast_default:
        record_tables("unlabelled-default", args.save)
        print_fast_default(args, work)
        return
    if "emoji" in args.datasets and not args.emoji_data:
        parser.error("--emoji-data: the rendered emoji folder (or leave emoji out of --datasets)")
    record_tables(["unlabelled", "unlabelled-floors", "unlabelled-groups", "unlabelled-instance"], args.save)

    table, floors, groups = [], {}, []
    for dataset in args.datasets:
        for setting in args.settings:
            config = recipe(dataset, setting, "clusters", args.seeds[0], args.epochs, work, args.emoji_data)
            reference = pretrained_once(config, work / dataset / setting / "pretrained.json")
            print(json.dumps({"dataset": dataset, "setting": setting, "pretrained": reference}), flush=True)
            runs = {method: [trained(recipe(dataset, setting, method, seed, args.epochs, work, args.emoji_data))
                             for seed in args.seeds] for method in SETTING_METHODS[setting]}
            table += result_rows(dataset, setting, reference, runs)
            for method in ("clusters", "mutual"):
                if setting == "transductive":
                    groups.append([dataset, method, *agreement(recipe(dataset, setting, method, args.seeds[0],
                                                                      args.epochs, work, args.emoji_data), runs)])
                floors[(dataset, setting, method)] = [
                    {floor: guard_choice(run["history"], floor)["recall@1"] - reference["recall@1"]
                     for floor in (*FLOORS, 1.01)} for run in runs[method]]
    print(f"\nLabels hidden from training; head runs: {args.epochs} epochs, seeds {', '.join(map(str, args.seeds))}; "
          "mean ± standard deviation over seeds.\n")
    print("| data set | setting | model | images | MAP@R | Recall@1 | neighbours_kept@10 | epoch |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print_floors(floors)
    if groups:
        print("\nThe pseudo-labels against the hidden classes of the train images (transductive runs): grouped "
              "as the first epoch groups them (the pretrained features) and as a further epoch would (last.pt); "
              "pair precision = the share of same-group pairs that are one class, pair recall = the share of "
              "same-class pairs grouped together; mean over seeds for last.pt.\n")
        print("| data set | method | start: groups | start: largest group | start: pair precision | "
              "start: pair recall | start: ARI | last: groups | last: pair precision | last: pair recall | "
              "last: ARI |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for row in groups:
            print("| " + " | ".join(row) + " |")
    if args.instance:
        print_instance(args, work)


def result_rows(dataset: str, setting: str, reference: dict[str, float],
                runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """The table's rows of one data set and setting."""
    images = str(reference["images"])
    rows = [[dataset, setting, "pretrained backbone (pooled features, no head)", images,
             f"{reference['map@r']:.3f}", f"{reference['recall@1']:.3f}", "1", "-"]]

    def add(name: str, picked: list[dict[str, Any]]) -> None:
        epochs = ", ".join(str(r.get("epoch", "?")) for r in picked)
        rows.append([dataset, setting, name, images, cell([r["map@r"] for r in picked]),
                     cell([r["recall@1"] for r in picked]),
                     cell([r[KEPT] for r in picked]) if all(KEPT in r for r in picked) else "-", epochs])

    for method in ("clusters", "mutual"):
        group = runs[method]
        add(f"{method}: start (PCA head, epoch 0)", [next(r for r in run["history"] if r["epoch"] == 0)
                                                      for run in group])
        add(f"{method}: guarded (best.pt, kept floor 0.5)", [row_of(run["report"], "best") for run in group])
        add(f"{method}: last epoch (no guard)", [row_of(run["report"], "last") for run in group])
    if "labelled" not in runs:
        return rows
    labelled = runs["labelled"]
    chosen_on = {run["report"].get("selected_on") for run in labelled}
    note = "chosen on validation classes" if chosen_on == {"validation"} else (
        "chosen on the evaluation split itself" if chosen_on == {"test"} else f"chosen on {', '.join(chosen_on)}")
    add(f"labels given (best.pt, {note})", [row_of(run["report"], "best") for run in labelled])
    return rows


def agreement(config: dict[str, Any], runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """How the method's groups agree with the train split's hidden classes: from the pretrained features (what the
    first epoch groups, up to the start head's rotation) and from each seed's last.pt head on the same features."""
    import numpy as np
    import torch

    from retrieval.models import load_embedder
    from retrieval.train import TrainConfig
    from retrieval.train.feature_cache import dataset_key
    from retrieval.train.pseudo_labelling import GROUPERS

    out = Path(config["out"])
    model = load_embedder(out / "last.pt")
    key = dataset_key(TrainConfig(**config), model, "train")  # the labelled train split (the transductive eval)
    digest = __import__("hashlib").sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    with np.load(Path(config["feature_cache"]) / f"{digest}.npz") as data:
        features, labels = data["features"], data["labels"]
    group = GROUPERS[config["pseudo_labels"]]
    start = pair_figures(group(features), labels)
    last = []
    for run in runs[config["pseudo_labels"]]:
        head = load_embedder(Path(run["report"]["config"]["train"]["out"]) / "last.pt").head.eval()
        with torch.no_grad():
            last.append(pair_figures(group(head(torch.from_numpy(features)).numpy()), labels))
    return [str(start["groups"]), f"{start['largest']:.2f}", f"{start['precision']:.2f}", f"{start['recall']:.2f}",
            f"{start['ari']:.2f}", f"{np.mean([r['groups'] for r in last]):.0f}",
            *(f"{np.mean([r[k] for r in last]):.2f}" for k in ("precision", "recall", "ari"))]


def pair_figures(groups, labels) -> dict[str, float]:
    """Groups of two or more against the classes: their count, the largest's share of the images, the pair
    precision and recall, and the adjusted Rand index."""
    import numpy as np
    from sklearn.metrics import adjusted_rand_score

    sizes = np.bincount(groups)
    table = np.zeros((len(sizes), int(labels.max()) + 1), dtype=np.int64)
    np.add.at(table, (groups, labels), 1)
    same_both = float((table * (table - 1)).sum() / 2)
    same_group = float((sizes * (sizes - 1)).sum() / 2)
    class_sizes = table.sum(axis=0)
    same_class = float((class_sizes * (class_sizes - 1)).sum() / 2)
    return {"groups": int((sizes >= 2).sum()), "largest": float(sizes.max() / len(groups)),
            "precision": same_both / same_group if same_group else float("nan"),
            "recall": same_both / same_class if same_class else float("nan"),
            "ari": float(adjusted_rand_score(labels, groups))}


def print_floors(floors: dict[tuple[str, str, str], list[dict[float, float]]]) -> None:
    """Per kept floor: the Recall@1 change of the guard's choice against the pretrained backbone, per data set and
    setting (both methods, all seeds: the worst run), and over every run."""
    keys = list(floors)
    columns = list(dict.fromkeys((d, s) for d, s, _ in keys))
    print("\nRecall@1 of the guard's choice minus the pretrained backbone's, at each kept floor: the worst run of "
          f"both pseudo-label methods and all seeds per column; 'within' counts runs no more than {TOLERANCE} below "
          "(floor > 1: always the start, epoch 0).\n")
    print("| kept floor | " + " | ".join(f"{d}, {s}" for d, s in columns) + " | mean over runs | runs within |")
    print("|---|" + "---|" * (len(columns) + 2))
    for floor in (*FLOORS, 1.01):
        cells, every = [], []
        for column in columns:
            deltas = [run[floor] for (d, s, _), group in floors.items() if (d, s) == column for run in group]
            every += deltas
            cells.append(f"{min(deltas):+.3f}")
        within = sum(delta >= -TOLERANCE for delta in every)
        label = "start only (> 1)" if floor > 1 else f"{floor:.1f}"
        print(f"| {label} | " + " | ".join(cells) + f" | {statistics.mean(every):+.3f} | {within}/{len(every)} |")


def print_instance(args: argparse.Namespace, work: Path) -> None:
    """Instance discrimination on the digits subset, both settings."""
    print(f"\nInstance discrimination (NT-Xent, whole backbone fine-tuned, backbone lr 1e-4, light augmentation): "
          f"digits, {INSTANCE['dataset_kwargs']['limit_per_class']} images a class, {args.instance_epochs} epochs; "
          "mean ± standard deviation over seeds.\n")
    print("| setting | model | images | MAP@R | Recall@1 | neighbours_kept@10 | epoch |")
    print("|---|---|---|---|---|---|---|")
    for setting in args.settings:
        runs = []
        for seed in args.seeds:
            config = {**INSTANCE, "eval_split": SETTINGS[setting], "epochs": args.instance_epochs, "seed": seed,
                      "out": str(work / "instance" / setting / f"seed{seed}")}
            runs.append(trained(config))
        reference = pretrained_once(config, work / "instance" / setting / "pretrained.json")
        images = str(reference["images"])
        print(f"| {setting} | pretrained backbone | {images} | {reference['map@r']:.3f} | "
              f"{reference['recall@1']:.3f} | 1 | - |")
        for name, picked in (("guarded (best.pt, kept floor 0.5)", [r["report"]["best"] for r in runs]),
                             ("last epoch (no guard)", [r["report"]["last"] for r in runs])):
            print(f"| {setting} | {name} | {images} | {cell([r['map@r'] for r in picked])} | "
                  f"{cell([r['recall@1'] for r in picked])} | {cell([r[KEPT] for r in picked])} | "
                  f"{', '.join(str(r['epoch']) for r in picked)} |")


if __name__ == "__main__":
    main()
