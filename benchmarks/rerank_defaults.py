"""Re-ranking's neighbourhood sizes: the papers' values against the sizes a gallery's labels set
(`retrieval.rerank.defaults`), and those an unlabelled gallery gets, on real images with large and small classes.

    .venv/bin/python benchmarks/rerank_defaults.py [--datasets digits fashion-mnist emoji] [--seeds 0 1 2]
        [--draws 10] [--work DIR] [--out results.json]

The embedder is the pretrained EfficientNet-Lite0's pooled features, L2-normalised (`retrieval export --pretrained`:
what a user without a trained model searches with); each data set's test split is embedded once (cached in
``--work``). Per data set, two galleries, each evaluated leave-one-out as `retrieval evaluate --rerank` does:

* whole classes: digits' 5 test classes of ~180 images (R ~ 178 others of a kind), Fashion-MNIST's 10 classes at 60
  images (R = 59), emoji's 983 pairs (R = 1); a seed draws 80 % of each class (emoji: of the pairs);
* small classes (digits and Fashion-MNIST): each class cut to 3 to 17 images (as a catalogue's labels, R ~ 10);
  a seed draws ``--draws`` such galleries and averages them.

Rows: no re-ranking; each method at the papers' sizes (k = 10; k1 = 20, k2 = 6); at the sizes the gallery's labels
set; at the sizes an unlabelled gallery gets. Mean ± half the spread (max - min) over the seeds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

DATASETS = {"digits": ({}, 64), "fashion-mnist": ({"protocol": "standard"}, 64), "emoji": ({}, 224)}
WHOLE_PER_CLASS = {"fashion-mnist": 60}  # Fashion-MNIST's test split cut to 60 a class, as benchmarks/rerank.py
SMALL_CLASSES = (3, 17)
METHODS = ("qe", "dba", "kreciprocal")


def features(dataset: str, work: Path) -> tuple[np.ndarray, np.ndarray]:
    """The test split's pretrained embeddings and labels, cached in ``work``."""
    cached = work / f"{dataset}.npz"
    if cached.is_file():
        data = np.load(cached)
        return data["embeddings"], data["labels"]
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.models import create_pretrained_embedder

    options, size = DATASETS[dataset]
    model = create_pretrained_embedder("efficientnet_lite0", size, "crop")
    data = load_dataset(dataset, None, split="test", transform=build_transforms(model.preprocessing, train=False),
                        **options)
    embedded = embed_samples(model, data, 128, torch.device("cpu"), 0, False, "embeddings", True)
    work.mkdir(parents=True, exist_ok=True)
    np.savez(cached, embeddings=embedded.embeddings, labels=embedded.labels)
    return embedded.embeddings, embedded.labels


def gallery(labels: np.ndarray, rng: np.random.Generator, sizes: tuple[int, int] | None, per_class: int | None,
            share: float) -> np.ndarray:
    """The rows of one drawn gallery: per class, ``per_class`` images, a size drawn in ``sizes``, or ``share``."""
    rows = []
    for label in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == label))
        count = per_class or (int(rng.integers(sizes[0], sizes[1] + 1)) if sizes else round(share * len(members)))
        rows.append(members[:count])
    return np.sort(np.concatenate(rows))


def variants() -> list[tuple[str, Any]]:
    """(row name, the config, or a function of the gallery's labels giving it)."""
    from retrieval.rerank import (
        PAPER_NEIGHBOURHOOD,
        UNLABELLED_RELEVANT,
        Neighbourhood,
        RerankConfig,
        with_gallery_defaults,
    )

    rows: list[tuple[str, Any]] = [("none", None)]
    for method in METHODS:
        rows.append((f"{method}, the papers' sizes", RerankConfig(method=method, **PAPER_NEIGHBOURHOOD)))
        rows.append((f"{method}, from the labels", RerankConfig(method=method)))  # unset: reranked_metrics reads them
        rows.append((f"{method}, unlabelled", with_gallery_defaults(
            RerankConfig(method=method), Neighbourhood(UNLABELLED_RELEVANT, "unlabelled"))))
    return rows


def measure(embeddings: np.ndarray, labels: np.ndarray) -> dict[str, dict[str, float]]:
    """Every row's MAP@R and Recall@1 on one gallery, and the sizes each row used."""
    from retrieval.metrics import evaluate
    from retrieval.metrics.evaluation import reranked_metrics

    out = {}
    for name, config in variants():
        if config is None:
            metrics, params = evaluate(embeddings, labels, ks=(1,), metrics=["recall", "map@r"]), {}
        else:
            block = reranked_metrics(embeddings, labels, None, None, config, ks=(1,))
            metrics, params = block["metrics"], block["params"]
        out[name] = {"map@r": float(metrics["map@r"]), "recall@1": float(metrics["recall@1"]),
                     **{f"param {key}": value for key, value in params.items() if key in ("k", "k1", "k2")}}
    return out


def setting(embeddings: np.ndarray, labels: np.ndarray, seed: int, draws: int, sizes, per_class) -> dict:
    """One seed of one gallery setting: the rows averaged over its draws."""
    rng = np.random.default_rng(seed)
    runs = [measure(embeddings[rows], labels[rows]) for rows in
            (gallery(labels, rng, sizes, per_class, 0.8) for _ in range(draws))]
    return {name: {key: float(np.mean([run[name][key] for run in runs])) for key in runs[0][name]}
            for name in runs[0]}


def spread(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--draws", type=int, default=10, help="small-class galleries drawn per seed")
    parser.add_argument("--work", default="/tmp/rerank-defaults", help="where the embeddings are cached")
    parser.add_argument("--out", help="write every seed's numbers here (JSON)")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for dataset in args.datasets:
        embeddings, labels = features(dataset, Path(args.work))
        settings = {"whole classes": (None, WHOLE_PER_CLASS.get(dataset), 1)}
        if dataset != "emoji":
            settings["small classes"] = (SMALL_CLASSES, None, args.draws)
        for name, (sizes, per_class, draws) in settings.items():
            if dataset == "emoji":  # pairs: a seed keeps 80 % of them, both images of each
                pairs = np.unique(labels)
                seeds = []
                for seed in args.seeds:
                    kept = np.random.default_rng(seed).permutation(pairs)[: round(0.8 * len(pairs))]
                    rows = np.flatnonzero(np.isin(labels, kept))
                    seeds.append(measure(embeddings[rows], labels[rows]))
            else:
                seeds = [setting(embeddings, labels, seed, draws, sizes, per_class) for seed in args.seeds]
            results[f"{dataset}, {name}"] = seeds
            print(f"\n{dataset}, {name}")
            print("| re-ranking | sizes | MAP@R | Recall@1 |\n| --- | --- | --- | --- |")
            for row in seeds[0]:
                params = ", ".join(f"{key[6:]} {np.mean([s[row][key] for s in seeds]):.3g}" for key in seeds[0][row]
                                   if key.startswith("param "))
                print(f"| {row} | {params or '-'} | {spread([s[row]['map@r'] for s in seeds])} | "
                      f"{spread([s[row]['recall@1'] for s in seeds])} |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
