"""Zero-shot text search with no captions: the text tower `retrieval export --pretrained efficientnet_lite0` writes,
trained onto the backbone's ImageNet head from the class names and definitions timm ships, measured on images it
never saw, with queries no tower was trained on. Prompt sets, epochs, batch and sampling are compared (3 seeds).

    python benchmarks/zero_shot_text.py --out OUT [--seeds 0 1 2] [--per-class 100] [--save MACHINE]

- Fashion-MNIST test photos (the Debian package dataset-fashion-mnist), ``--per-class`` of each class, queried with
  the 10 class names ("trouser", "sneaker", ...): Precision@10, the mean over the 10 queries.
- The demo's emoji (`retrieval data prepare emoji`, written to OUT/emoji when missing), the test subgroups'
  images of benchmarks/text_search.py: a subgroup's name as the query, Precision@10; each emoji's name, Recall@10.

Each tower is evaluated in PyTorch (its ONNX export equals it: tests/text/test_zero_shot_tower.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

FASHION_QUERIES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                   "ankle boot")  # the data set's class names as words, label order
# name -> settings changed from the defaults (ZeroShotSettings)
CONFIGS = {
    "ridge start only (0 epochs)": {"epochs": 0},
    "names": {"prompts": ("names",)},
    "names + photo": {"prompts": ("names", "photo")},
    "names + photo + definition, 20 epochs (the default)": {},
    "default, 10 epochs": {"epochs": 10},
    "default, 60 epochs": {"epochs": 60},
    "default, batch 256 classes": {"batch_size": 256},
    "default, texts sampled uniformly (not by prompt set)": {"balance": "text"},
    "+ 8 templates a lemma": {"prompts": ("names", "photo", "definition", "templates")},
}


def embed_files(model: Path, images: list, cache: Path) -> np.ndarray:
    """L2-normalised embeddings of ``images`` (paths or arrays) with the ONNX model, cached."""
    if cache.is_file():
        return np.load(cache)["vectors"]
    from retrieval.onnx_runtime import OnnxEmbedder
    from retrieval.utils.progress import progress_bar

    embedder = OnnxEmbedder(model)
    parts = []
    for start in progress_bar(range(0, len(images), 32), desc=f"embed {cache.stem}", unit="batch"):
        parts.append(embedder.embed(images[start: start + 32]))
    vectors = np.concatenate(parts).astype(np.float32)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    np.savez(cache, vectors=vectors)
    return vectors


def fashion_set(model: Path, out: Path, per_class: int) -> tuple[np.ndarray, np.ndarray]:
    """The first ``per_class`` Fashion-MNIST test images of each class, embedded, and their labels."""
    from retrieval.data import load_dataset

    data = load_dataset("fashion-mnist", split="test")
    keep = np.concatenate([np.flatnonzero(data.labels == c)[:per_class] for c in range(10)])
    images = [data.load_image(int(i)) for i in keep]
    return embed_files(model, images, out / f"fashion-test-{per_class}.npz"), data.labels[keep]


def emoji_set(model: Path, out: Path) -> tuple[np.ndarray, list[str], list[str], list[str]]:
    """The emoji test subgroups' images, embedded, with their emoji, names and subgroup texts."""
    from text_search import test_set  # beside this file

    from retrieval.data.emoji_captions import caption_manifests

    folder = out / "emoji"
    if not (folder / "manifest.csv").is_file():
        subprocess.run([sys.executable, "-m", "retrieval", "data", "prepare", "emoji", "--out", str(folder)],
                       check=True, stdout=subprocess.DEVNULL)
    _, test_manifest = caption_manifests(folder / "manifest.csv")
    paths, labels, names, subgroups = test_set(test_manifest)
    return embed_files(model, paths, out / "emoji-test.npz"), labels, names, subgroups


def precision_at(text: np.ndarray, images: np.ndarray, relevant: list[np.ndarray], k: int = 10) -> float:
    """Mean Precision@k of queries [q, d] against images [n, d]."""
    top = np.argsort(-(text @ images.T), axis=1)[:, :k]
    return float(np.mean([np.isin(t, r).mean() for t, r in zip(top, relevant, strict=True)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--per-class", type=int, default=100)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help="the CONFIGS measured (names)")
    parser.add_argument("--save", metavar="MACHINE", help="write benchmarks/results/zero-shot-text-MACHINE.json")
    args = parser.parse_args()
    import torch
    from text_search import evaluate  # beside this file

    from retrieval.export.onnx_export import export_pretrained
    from retrieval.train.zero_shot_tower import ZeroShotSettings, imagenet_head, train_zero_shot_tower

    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model.onnx"
    if not model.is_file():
        export_pretrained("efficientnet_lite0", model, verify=False)
    fashion, fashion_labels = fashion_set(model, args.out, args.per_class)
    emoji = emoji_set(model, args.out)
    # the image model's ceiling: each class's mean image vector as its query
    centroids = np.stack([fashion[fashion_labels == c].mean(0) for c in range(10)])
    ceiling = precision_at(centroids / np.linalg.norm(centroids, axis=1, keepdims=True), fashion,
                           [np.flatnonzero(fashion_labels == c) for c in range(10)])
    head = imagenet_head("efficientnet_lite0")
    cache = args.out / "text-features.pt"  # sentence features by text: the encoder is the same for every config
    encoded: dict = torch.load(cache) if cache.is_file() else {}
    results = []
    for name in args.configs:
        for seed in args.seeds:
            settings = replace(ZeroShotSettings(seed=seed), **CONFIGS[name])
            started = time.perf_counter()
            trained = train_zero_shot_tower(head, settings, progress=False, encoded=encoded)
            seconds = time.perf_counter() - started

            def embed(texts: list[str], trained=trained) -> np.ndarray:
                ids, mask = trained.tokenizer(list(texts))
                with torch.no_grad():
                    return trained.tower(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

            row = {"config": name, "seed": seed, "texts": trained.texts, "train_seconds": round(seconds, 1),
                   "fashion_precision@10": precision_at(embed(list(FASHION_QUERIES)), fashion,
                                                        [np.flatnonzero(fashion_labels == c) for c in range(10)]),
                   **{f"emoji_{k}": v for k, v in evaluate(embed, *emoji).items()
                      if k in ("subgroup_precision@10", "name_recall@10")}}
            print(json.dumps(row), flush=True)
            results.append(row)
        torch.save(encoded, cache)
    (args.out / "zero_shot_text.json").write_text(json.dumps(results, indent=2))
    keys = ("fashion_precision@10", "emoji_subgroup_precision@10", "emoji_name_recall@10")
    rows = []
    for name in args.configs:
        mine = [r for r in results if r["config"] == name]
        rows.append([name, str(mine[0]["texts"]),
                     *[f"{np.mean([r[k] for r in mine]):.3f} ± {np.std([r[k] for r in mine]):.3f}" for k in keys],
                     f"{np.mean([r['train_seconds'] for r in mine]):.0f}"])
    table = ["| tower | texts | Fashion-MNIST class names P@10 | emoji subgroups P@10 | emoji names R@10 | s |",
             "| --- | --- | --- | --- | --- | --- |"] + ["| " + " | ".join(r) + " |" for r in rows]
    print("\n".join(table))
    if args.save:
        from results_io import write_result  # beside this file

        write_result("zero-shot-text", args.save, "python " + shlex.join(sys.argv),
                     ["zero-shot tower (EfficientNet-Lite0's ImageNet head)", "training texts",
                      "Fashion-MNIST class names P@10", "emoji subgroups P@10", "emoji names R@10",
                      "seconds (encode once + train)"], rows,
                     notes=f"mean ± std over seeds {args.seeds}; Fashion-MNIST: {args.per_class} test images a "
                           "class, the 10 class names as queries (random: 0.10; each class's mean image vector as "
                           f"the query, the image model's ceiling: {ceiling:.2f}); emoji: benchmarks/text_search.py's "
                           "test subgroups (a caption-trained tower: 0.175 / 0.143); seconds: the first config of a "
                           "run includes encoding the texts")


if __name__ == "__main__":
    main()
