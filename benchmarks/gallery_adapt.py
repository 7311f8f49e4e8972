"""A zero-shot text tower adapted to a gallery with pseudo-captions (``retrieval.text.gallery_adapt``) against the
tower as it is: Precision@10 of class-name queries on Fashion-MNIST test photos, and of subgroup-name queries on the
demo's emoji test gallery (benchmarks/text_search.py's), across the fit's parameters, one varied at a time from the
defaults, over 3 seeds (the gallery's sample and held-out split). Beside each: the held-out pseudo-caption Recall@10
the adaptation is checked by (delivered only when not worse than the source's).

    python benchmarks/gallery_adapt.py --model model.onnx --emoji EMOJI_DIR --out OUT [--tower ZS.onnx]
        [--per-class 300] [--seeds 0 1 2] [--save MACHINE]

--model: `retrieval export --pretrained efficientnet_lite0`'s model.onnx. --tower: the zero-shot text tower for it
(its model.text.onnx); without it a stand-in is trained onto the head's rows (``retrieval.train.zero_shot_tower``,
``--tower-epochs``) and cached in OUT. EMOJI_DIR: `retrieval data prepare emoji`'s folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from text_search import evaluate as emoji_evaluate  # noqa: E402  (beside this file)
from text_search import test_set  # noqa: E402

from retrieval.text.gallery_adapt import AdaptConfig, fit_for_gallery, tower_metadata, zero_shot_classes  # noqa: E402
from retrieval.text.text_onnx import TextEmbedder  # noqa: E402

# one parameter varied at a time from the defaults
GRID = {"classes_per_caption": [1, 3, 5], "lam": [0.1, 1.0, 10.0, 100.0], "anchor": [0.0, 0.2, 0.5],
        "weighting": ["equal", "confidence"], "sample": [500, 1000, 20000]}


def stand_in_tower(model: Path, out: Path, epochs: int) -> Path:
    """A zero-shot tower trained onto efficientnet_lite0's head rows, exported for ``model`` with its metadata."""
    path = out / "zero_shot.text.onnx"
    if path.is_file():
        return path
    import onnx

    from retrieval.export.text_export import export_text_tower
    from retrieval.index.query_embedder import load_model
    from retrieval.train.zero_shot_tower import ZeroShotSettings, imagenet_head, train_zero_shot_tower

    trained = train_zero_shot_tower(imagenet_head("efficientnet_lite0"), ZeroShotSettings(epochs=epochs),
                                    progress=True)
    export_text_tower(trained.tower, trained.tokenizer, path, load_model(str(model)).model_hash,
                      trained.encoder_record, trained.check_texts)
    proto = onnx.load(str(path))
    props = {p.key: p.value for p in proto.metadata_props} | trained.metadata()
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, props)
    onnx.save_model(proto, str(path))
    return path


def embed_images(model: Path, images: list, cache: Path) -> np.ndarray:
    """The image model's vectors of ``images`` (PIL images or paths), cached."""
    if cache.is_file():
        return np.load(cache)["vectors"]
    from retrieval.data.decode import open_image
    from retrieval.index.query_embedder import load_model

    embedder = load_model(str(model))
    out = []
    for start in range(0, len(images), 64):
        chunk = [open_image(i) if isinstance(i, (str, Path)) else i for i in images[start:start + 64]]
        out.append(embedder.embed(chunk))
    vectors = np.concatenate(out).astype(np.float32)
    np.savez(cache, vectors=vectors)
    return vectors


def fashion_gallery(model: Path, out: Path, per_class: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Fashion-MNIST test photos (``per_class`` of each class): vectors, labels, class names as queries."""
    from retrieval.data import load_dataset

    data = load_dataset("fashion-mnist", split="test", limit_per_class=per_class)
    images = [data.load_image(i) for i in range(len(data))]
    vectors = embed_images(model, images, out / f"fashion-{per_class}.npz")
    names = [str(n).replace("-", " ") for n in data.class_names]
    return vectors, np.asarray(data.labels), names


def precision_at_10(queries: np.ndarray, images: np.ndarray, relevant: list[np.ndarray]) -> float:
    top = np.argsort(-(queries @ images.T), axis=1)[:, :10]
    return float(np.mean([np.isin(t, r).mean() for t, r in zip(top, relevant, strict=True)]))


class Cached:
    """A tower's embedding of texts, each text embedded once across the whole run."""

    def __init__(self, tower: TextEmbedder) -> None:
        self.tower, self.known = tower, {}

    def __call__(self, texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.known]
        if missing:
            self.known.update(zip(missing, self.tower.embed(missing), strict=True))
        return np.stack([self.known[t] for t in texts]) if texts else np.zeros((0, self.tower.dim), np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--emoji", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--tower", type=Path)
    parser.add_argument("--tower-epochs", type=int, default=20)
    parser.add_argument("--per-class", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--save", metavar="MACHINE")
    args = parser.parse_args()
    from retrieval.data.emoji_captions import caption_manifests

    args.out.mkdir(parents=True, exist_ok=True)
    tower = TextEmbedder(args.tower or stand_in_tower(args.model, args.out, args.tower_epochs))
    classes = zero_shot_classes(tower_metadata(tower))
    embed = Cached(tower)
    fashion, labels, names = fashion_gallery(args.model, args.out, args.per_class)
    fashion_relevant = [np.flatnonzero(labels == c) for c in range(len(names))]
    test = test_set(caption_manifests(args.emoji / "manifest.csv")[1])
    emoji = embed_images(args.model, test[0], args.out / "emoji.npz")

    def measure(query_embed) -> dict:
        return {"fashion_p@10": precision_at_10(query_embed(names), fashion, fashion_relevant),
                "emoji_p@10": emoji_evaluate(query_embed, emoji, *test[1:])["subgroup_precision@10"]}

    results = {"source": measure(embed), "runs": []}
    print("source", results["source"], flush=True)
    settings = [("default", AdaptConfig())] + [
        (f"{key}={value}", dataclasses.replace(AdaptConfig(), **{key: value}))
        for key, values in GRID.items() for value in values if value != getattr(AdaptConfig(), key)]
    for name, config in settings:
        for seed in args.seeds:
            row = {"setting": name, "seed": seed}
            for gallery, vectors in (("fashion", fashion), ("emoji", emoji)):
                started = time.perf_counter()
                adaptation, report = fit_for_gallery(tower, vectors, dataclasses.replace(config, seed=seed), classes,
                                                     embed)
                adapted = measure(lambda texts, a=adaptation: a(embed(texts)))
                row[gallery] = {"p@10": adapted[f"{gallery}_p@10"], "seconds": round(time.perf_counter() - started, 2),
                                **{k: report[k] for k in ("source_recall@10", "adapted_recall@10",
                                                          "distinct_captions", "fit_images")}}
            results["runs"].append(row)
            print(json.dumps(row), flush=True)
    (args.out / "gallery_adapt.json").write_text(json.dumps(results, indent=2))
    if args.save:
        from results_io import write_result

        table = []
        for name, _ in settings:
            runs = [r for r in results["runs"] if r["setting"] == name]

            def spread(gallery: str, key: str, runs=runs) -> str:
                values = [r[gallery][key] for r in runs]
                return f"{np.mean(values):.3f} ± {np.std(values):.3f}"

            table.append([name, spread("fashion", "p@10"), spread("fashion", "source_recall@10") + " -> "
                          + spread("fashion", "adapted_recall@10"), spread("emoji", "p@10"),
                          spread("emoji", "source_recall@10") + " -> " + spread("emoji", "adapted_recall@10")])
        table.insert(0, ["zero-shot tower as it is", f"{results['source']['fashion_p@10']:.3f}", "-",
                         f"{results['source']['emoji_p@10']:.3f}", "-"])
        write_result("gallery-adapt", args.save, "python " + " ".join(sys.argv),
                     ["setting (one changed from the defaults)", "Fashion-MNIST class-name P@10",
                      "Fashion-MNIST held-out pseudo-caption R@10 (source -> adapted)", "emoji subgroup P@10",
                      "emoji held-out pseudo-caption R@10 (source -> adapted)"], table,
                     notes=f"defaults {dataclasses.asdict(AdaptConfig())}; seeds {args.seeds} (mean ± std); "
                           f"Fashion-MNIST: {len(fashion)} test photos, emoji: {len(emoji)} test-subgroup drawings; "
                           f"tower: {tower.path.name}")


if __name__ == "__main__":
    main()
