"""The zero-shot tower's class bridge, by setting, on the shop's customer queries (benchmarks/shop_text.py's
catalogues and queries): the linear map alone (the tower's projection), the class bridge alone (a query's cosine to
each class's best text, the softmax of the top classes over a temperature, their classifier rows), and the two summed
(what `retrieval export --pretrained` writes). Precision@5 by category and by item against each seed's zero-shot
index (the pretrained export's vectors).

    python benchmarks/zero_shot_bridge.py --work WORK --tower WORK/model/model.text.onnx [--seeds 0 1 2]
        [--save MACHINE]

WORK is shop_text.py's work folder after a run (seedN/catalogue/manifest.csv, seedN/zero-shot).
"""

from __future__ import annotations

import argparse
import csv
import shlex
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from shop_text import QUERIES, relevant

from retrieval.index import Index
from retrieval.models import efficientnet_lite0_classifier
from retrieval.text.class_texts import class_texts, read_imagenet_classes
from retrieval.text.encoder import SentenceEncoder
from retrieval.text.tokens import TextTokenizer
from retrieval.text.tower import ClassBridge
from retrieval.train.text_tower import default_encoder, sentence_features

SETTINGS = [
    ("linear map alone (the projection)", None, None, False),
    ("class bridge alone, temperature 0.05, top 20", 0.05, 20, False),
    ("class bridge alone, temperature 0.1, top 20", 0.1, 20, False),
    ("class bridge alone, temperature 0.1, every class", 0.1, None, False),
    ("linear map + class bridge, temperature 0.1, top 20", 0.1, 20, True),
    ("linear map + class bridge, temperature 0.1, every class (the export's)", 0.1, None, True),
]


def gallery(work: Path, seed: int) -> tuple[np.ndarray, list[str], list[dict]]:
    """The seed's zero-shot index: its unit vectors, their paths (relative to the catalogue) and manifest rows."""
    root = work / f"seed{seed}" / "catalogue"
    rows = {r["path"]: r for r in csv.DictReader(open(root / "manifest.csv", encoding="utf-8"))}
    index = Index.open(work / f"seed{seed}" / "zero-shot")
    ids = index.ids
    found = index.indexed_rows(ids.tolist())
    paths = [str(Path(found[int(i)]["path"]).relative_to(root)) for i in ids]
    vectors = index.reconstructed_vectors(ids)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), paths, [rows[p] for p in paths]


def precision_at_5(queries: np.ndarray, vectors: np.ndarray, paths: list[str], rows: list[dict]) -> tuple[float, float]:
    """Mean Precision@5 (over min(5, relevant)) by category and by item of the shop's queries."""
    top = np.argsort(-(queries @ vectors.T), axis=1)[:, :5]
    by_category, by_item = [], []
    for (_, categories, items), found in zip(QUERIES, top, strict=True):
        wanted_category, wanted_item = relevant(rows, categories, items)
        hits = [paths[j] for j in found]
        by_category.append(sum(h in wanted_category for h in hits) / min(5, len(wanted_category)))
        by_item.append(sum(h in wanted_item for h in hits) / min(5, len(wanted_item)))
    return float(np.mean(by_category)), float(np.mean(by_item))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--tower", type=Path, required=True, help="the zero-shot tower (its projection is read)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    weights = {i.name: numpy_helper.to_array(i) for i in onnx.load(str(args.tower)).graph.initializer
               if i.name.startswith("projection.")}
    folder = default_encoder()
    encoder = SentenceEncoder.from_folder(folder)
    tokenizer = TextTokenizer.from_file(str(folder / "tokenizer.json"), 32)
    classes = read_imagenet_classes()
    texts, owner = [], []
    for row, cls in enumerate(classes):
        for made in class_texts(cls, ("names", "photo")).values():
            texts += made
            owner += [row] * len(made)
    rows = efficientnet_lite0_classifier(True)._fc.weight.detach()
    with torch.no_grad():
        features = sentence_features(encoder, tokenizer, texts)
        queries = sentence_features(encoder, tokenizer, [q for q, _, _ in QUERIES], progress=False)
        linear = torch.nn.functional.normalize(queries @ torch.from_numpy(weights["projection.weight"]).T
                                               + torch.from_numpy(weights["projection.bias"]), dim=-1)
        embedded = {}
        for name, temperature, top, mixed in SETTINGS:
            if temperature is None:  # the linear map alone
                embedded[name] = linear.numpy()
                continue
            bridge = ClassBridge.of_texts(features, torch.tensor(owner), rows, temperature, top)
            bridged = torch.nn.functional.normalize(bridge(queries), dim=-1)
            embedded[name] = torch.nn.functional.normalize(bridged + linear if mixed else bridged, dim=-1).numpy()
    measured = {name: [] for name, *_ in SETTINGS}
    for seed in args.seeds:
        vectors, paths, manifest_rows = gallery(args.work, seed)
        for name in measured:
            measured[name].append(precision_at_5(embedded[name], vectors, paths, manifest_rows))
    columns = ["query embedding", "P@5 category", "P@5 item"]
    table = [[name, *(f"{np.mean(v):.3f} ± {np.std(v):.3f}" for v in zip(*values, strict=True))]
             for name, values in measured.items()]
    for line in table:
        print(" | ".join(line))
    if args.save:
        from results_io import write_result

        write_result("zero-shot-bridge", args.save, shlex.join(["python", "benchmarks/zero_shot_bridge.py",
                                                                 *sys.argv[1:]]), columns, table, notes=(
            f"mean ± std over seeds {args.seeds}: each seed's shop gallery (benchmarks/shop_text.py); "
            f"{len(QUERIES)} customer queries with answers; {len(texts)} class texts (names, photo)"))


if __name__ == "__main__":
    main()
