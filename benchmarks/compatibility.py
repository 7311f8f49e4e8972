"""Backward-compatible training (--compatible-with) and the backfill curve, 3 seeds, on the frozen-feature path.

    .venv/bin/python benchmarks/compatibility.py [--datasets digits fashion-mnist emoji] [--seeds 0 1 2] [--epochs 10]

Per data set and seed: an old model (ms, 3 epochs, seed s); a new model trained independently (triplet, --epochs,
another seed's head: s + 100); the same new model trained --compatible-with the old one (weight 1). All on pretrained
EfficientNet-Lite0 features (cached; 32 px, emoji 224 px and 3x the batches an epoch) with a trained 64-d head.
Reported on the test split (leave-one-out): Recall@1 and MAP@R of old/old, new/new and cross-model (new queries
against the gallery the old model embedded),
for both new models; BCT's criterion is cross-model >= old/old. The independent model is trained with
--compatible-weight 1e-6 so that the run measures the three blocks; at that weight the term changes nothing.

Then the backfill curve: queries embedded by the new model, a gallery whose share x is re-embedded by it (the rest
keeps the old vectors), Recall@1 against x, for the compatible and the independent model, re-embedded in
``uncertainty_order`` (least certain old embedding first, as ``retrieval index upgrade --order uncertain``) and in
random order. Mean over the seeds, with the spread (max - min).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHARES = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)


# data set -> (its options, images of a class in a batch, image size, batches an epoch): emoji has two images a class
# (one per artist), is class-disjoint already and needs the results grid's 224 px; the others use their standard
# protocol (the same classes, other images) at 32 px
DATASETS = {"digits": ({"protocol": "standard"}, 4, 32, 10),
            "fashion-mnist": ({"protocol": "standard", "limit_per_class": 60}, 4, 32, 10),
            "emoji": ({}, 2, 224, 30)}


def config(dataset: str, out: Path, cache: Path, seed: int, **overrides):
    from retrieval.train import TrainConfig

    options, per_class, size, batches = DATASETS[dataset]
    values = dict(dataset=dataset, dataset_kwargs=dict(options), backbone="efficientnet_lite0",
                  pretrained=True, image_size=size, freeze_backbone=True, embedding_dim=64, loss="ms", batch_size=40,
                  per_class=per_class, batches_per_epoch=batches, epochs=3, lr=1e-3, seed=seed, workers=0, device="cpu",
                  out=str(out), feature_cache=str(cache), plots=False, tensorboard=False, eval_before=False)
    values.update(overrides)
    return TrainConfig(**values)


def test_embeddings(run: Path, dataset: str) -> tuple[np.ndarray, np.ndarray]:
    """The test split embedded by a run's last.pt (the whole model on the images), with the labels."""
    import torch

    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.models import load_embedder

    model = load_embedder(run / "last.pt")
    data = load_dataset(dataset, None, split="test", transform=build_transforms(model.preprocessing, train=False),
                        **DATASETS[dataset][0])
    embedded = embed_samples(model, data, 128, torch.device("cpu"), 0, False, "embed", False)
    return embedded.embeddings, embedded.labels


def backfill_curve(old: np.ndarray, new: np.ndarray, labels: np.ndarray, order: str, seed: int) -> list[float]:
    """Recall@1 of new queries against a gallery whose first share x (in ``order``) is re-embedded, per share."""
    import faiss

    from retrieval.index.writing.upgrade import NEIGHBOURS, uncertainty_order
    from retrieval.metrics import evaluate

    ids = np.arange(len(old))
    if order == "uncertain":
        index = faiss.IndexFlatIP(old.shape[1])
        index.add(old.astype(np.float32))
        scores, found = index.search(old.astype(np.float32), NEIGHBOURS + 1)
        ranked = uncertainty_order(ids, scores, found, {i: str(label) for i, label in enumerate(labels)})
    else:
        ranked = np.random.default_rng(seed).permutation(ids)
    curve = []
    for share in SHARES:
        gallery = old.copy()
        chosen = ranked[: round(share * len(ids))]
        gallery[chosen] = new[chosen]
        curve.append(evaluate(new, labels, gallery, labels, ks=(1,), metrics=["recall"], same_items=True)["recall@1"])
    return curve


def spread(values: list[float]) -> str:
    return f"{np.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["digits", "fashion-mnist"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    from retrieval.train import train

    work = Path(tempfile.mkdtemp(prefix="compat-bench-"))
    results: dict = {}
    for dataset in args.datasets:
        rows: dict[str, list] = {}
        curves: dict[str, list] = {}
        cache = work / "cache"
        for seed in args.seeds:
            old = work / dataset / f"old-{seed}"
            train(config(dataset, old, cache, seed), progress=False)
            for name, weight in (("independent", 1e-6), ("compatible", 1.0)):
                run = work / dataset / f"{name}-{seed}"
                train(config(dataset, run, cache, seed + 100, loss="triplet", epochs=args.epochs, lr=3e-3,
                             compatible_with=str(old / "last.pt"), compatible_weight=weight), progress=False)
                blocks = json.loads((run / "report.json").read_text())["last"]["compatibility"]
                for block in ("old", "new", "cross_model"):
                    for metric in ("recall@1", "map@r"):
                        rows.setdefault(f"{name}/{block}/{metric}", []).append(blocks[block][metric])
                # the share of seeds whose verdict (a bootstrap interval over the queries) is "compatible"
                rows.setdefault(f"{name}/compatible", []).append(float(blocks["verdict"] == "compatible"))
                old_vectors, labels = test_embeddings(old, dataset)
                new_vectors, _ = test_embeddings(run, dataset)
                for order in ("uncertain", "random"):
                    curves.setdefault(f"{name}/{order}", []).append(
                        backfill_curve(old_vectors, new_vectors, labels, order, seed))
            print(f"{dataset} seed {seed} done", file=sys.stderr)
        results[dataset] = {
            "table": {key: spread(values) for key, values in rows.items()},
            "backfill_recall@1": {key: [spread([c[i] for c in values]) for i in range(len(SHARES))]
                                  for key, values in curves.items()},
            "shares": list(SHARES),
        }
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
