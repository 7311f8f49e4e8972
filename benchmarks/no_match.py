"""False rates of the "no good match" floor (``retrieval.text.no_match``): on queries naming products a gallery does
not hold it should say ``no_match`` on at least 3/4, and on at most 1/10 of queries that have answers.

Two galleries, each with its calibration (the shipped everyday texts, ``no_match_texts``) at several quantiles and
at the default (``QUANTILE``), 3 seeds:

- emoji: the test subgroups (unseen by the tower) split in two by the seed; one half's images are the gallery, its
  subgroup names ("face affection") the queries with answers, the other half's names the queries without. The tower:
  `retrieval text train` on the train subgroups' captions (name, subgroup name), one per seed.
- Fashion-MNIST photos: an index of `retrieval data prepare fashion-mnist` test images (`index build`), its text
  model recorded with `index text` (the real calibration); queries with answers: the 10 classes as a customer types
  them (``FASHION_PRESENT``); without: ImageNet-1k class names (timm's shipped lemmas) that are no clothing, shoe or
  bag, 200 drawn by the seed.

Besides the floor's rates, ``best single floor``: the lowest rate on queries with answers that any floor reaches
while saying no_match on 3/4 of those without (what the best calibration could do on this gallery).

    python benchmarks/no_match.py --model model.onnx --emoji EMOJI_DIR --fashion-index FM_INDEX \
        --fashion-text TEXT.onnx --out OUT [--seeds 0 1 2] [--save MACHINE]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from retrieval.text.no_match import QUANTILE, best_scores, calibration_record, floor_of
from retrieval.text.no_match_texts import CALIBRATION_TEXTS

QUANTILES = (0.5, 0.75, 0.8, 0.85, 0.9, 0.95)
ABSENT_TARGET, PRESENT_TARGET = 0.75, 0.10

# the Fashion-MNIST classes as a shop's customers type them
FASHION_PRESENT = (
    "a t-shirt", "a top", "t-shirt", "trousers", "a pair of trousers", "jeans", "a pullover", "a jumper", "a sweater",
    "a dress", "a summer dress", "a coat", "a jacket", "a winter coat", "a sandal", "sandals", "a shirt", "a blouse",
    "a sneaker", "trainers", "running shoes", "a bag", "a handbag", "a shoulder bag", "an ankle boot", "boots",
    "a leather boot", "a long-sleeved shirt", "a short dress", "a canvas bag",
)
# ImageNet classes a clothing shop may well hold: not queries without answers
WEARABLE = ("shoe", "boot", "sandal", "clog", "loafer", "sneaker", "jersey", "shirt", "coat", "dress", "gown",
            "skirt", "bag", "purse", "sock", "cardigan", "sweat", "suit", "kimono", "abaya", "apron", "bikini",
            "brassiere", "trunks", "jean", "pajama", "poncho", "stole", "cloak", "vestment", "wallet", "backpack",
            "mitten", "sombrero", "hat", "cap", "bonnet", "helmet", "tie", "maillot", "sarong", "uniform", "vest",
            "mail", "breastplate", "boa", "diaper", "bib", "knee pad", "wig", "mask", "scarf", "glove", "cuirass",
            "overskirt", "hoopskirt", "fur", "wool", "velvet", "umbrella", "holster", "pouch", "case", "sack",
            "tote", "crash helmet", "sunglass", "spectacles")


class Vectors:
    """An exact search over gallery vectors (what a Flat index answers): ``len`` and ``search_arrays``."""

    def __init__(self, vectors: np.ndarray) -> None:
        self.vectors = np.asarray(vectors, np.float32)

    def __len__(self) -> int:
        return len(self.vectors)

    def search_arrays(self, queries: np.ndarray, k: int = 10) -> tuple[np.ndarray, np.ndarray]:
        scores = queries @ self.vectors.T
        top = np.argsort(-scores, axis=1)[:, :k]
        return np.take_along_axis(scores, top, 1), top.astype(np.int64)


def rates(present: np.ndarray, absent: np.ndarray, floor: float) -> dict[str, float]:
    """The share of queries without answers said no_match, and of those with answers (the false alarms)."""
    return {"absent_no_match": float(np.mean(absent < floor)), "present_no_match": float(np.mean(present < floor))}


def best_single_floor(present: np.ndarray, absent: np.ndarray) -> dict[str, float]:
    """The floor that says no_match on ``ABSENT_TARGET`` of ``absent`` with the fewest ``present`` said so."""
    ordered = np.sort(absent)
    floor = float(np.nextafter(ordered[int(np.ceil(ABSENT_TARGET * len(ordered))) - 1], 1.0))
    return {"floor": floor, **rates(present, absent, floor)}


def measure(searchable, text, present: list[str], absent: list[str], model_hash: str | None) -> dict:
    """The calibration on ``searchable`` with ``text`` and the rates of its floor at each quantile."""
    calibration = best_scores(searchable, text.embed(list(CALIBRATION_TEXTS)))
    best_present = best_scores(searchable, text.embed(present))
    best_absent = best_scores(searchable, text.embed(absent))
    record = calibration_record(calibration, CALIBRATION_TEXTS, text.model_hash, model_hash, len(searchable))
    by_quantile = {str(q): {"floor": floor_of(calibration, q)[0], **rates(best_present, best_absent,
                                                                          floor_of(calibration, q)[0])}
                   for q in QUANTILES}
    everything = float(np.quantile(calibration[np.isfinite(calibration)], QUANTILE))  # no text left out
    by_quantile[f"{QUANTILE}, no text left out"] = {"floor": everything, **rates(best_present, best_absent,
                                                                                 everything)}
    return {"record": record, "by_quantile": by_quantile, "best_single_floor": best_single_floor(best_present,
                                                                                                  best_absent),
            "present_scores": _spread(best_present), "absent_scores": _spread(best_absent),
            # the chance that a query with answers scores above one without: 0.5, no floor can tell them apart
            "auc": float(np.mean(best_present[:, None] > best_absent[None, :])
                         + 0.5 * np.mean(best_present[:, None] == best_absent[None, :])),
            "missed_absent": [q for q, s in zip(absent, best_absent, strict=True) if s >= record["floor"]][:10],
            "flagged_present": [q for q, s in zip(present, best_present, strict=True) if s < record["floor"]]}


def _spread(scores: np.ndarray) -> dict[str, float]:
    return {"p10": float(np.quantile(scores, 0.1)), "median": float(np.median(scores)),
            "p90": float(np.quantile(scores, 0.9))}


def emoji_seed(args, seed: int) -> dict:
    """The emoji measurement of one seed: its tower and its split of the test subgroups."""
    from retrieval.data.emoji_captions import caption_manifests
    from retrieval.text.text_onnx import TextEmbedder
    from retrieval.train.text_tower import embed_images

    train_manifest, test_manifest = caption_manifests(args.emoji / "manifest.csv")
    rows = list(csv.DictReader(open(test_manifest, encoding="utf-8")))
    paths = [str(test_manifest.parent / r["path"]) for r in rows]
    images, model_hash, readable = embed_images(str(args.model), paths, args.out / "emoji_test.npz", progress=False)
    assert len(readable) == len(paths), "every test image must be readable"
    run = args.out / f"emoji-tower-seed{seed}"
    if not (run / "text.onnx").is_file():
        cache = args.out / "emoji-tower-seed0" / "image_embeddings.npz"  # the same images: embedded once
        if cache.is_file() and seed != 0:
            run.mkdir(parents=True, exist_ok=True)
            shutil.copy(cache, run / "image_embeddings.npz")
        subprocess.run([sys.executable, "-m", "retrieval", "text", "train", "--model", str(args.model), "--images",
                        str(train_manifest), "--caption-column", "name", "--caption-column", "subgroup_text",
                        "--out", str(run), "--seed", str(seed), "--json"], check=True, stdout=subprocess.DEVNULL)
    text = TextEmbedder(run / "text.onnx")
    subgroups = sorted({r["subgroup_text"] for r in rows})
    order = np.random.default_rng(seed).permutation(len(subgroups))
    present = [subgroups[i] for i in order[: len(subgroups) // 2]]
    absent = [subgroups[i] for i in order[len(subgroups) // 2:]]
    in_gallery = np.asarray([r["subgroup_text"] in set(present) for r in rows])
    return {"seed": seed, "images": int(in_gallery.sum()), "present": len(present), "absent": len(absent),
            **measure(Vectors(images[in_gallery]), text, present, absent, model_hash)}


def imagenet_absent(seed: int, count: int = 200) -> list[str]:
    """ImageNet-1k class names (first lemma) that are no wearable thing, ``count`` drawn by ``seed``."""
    from retrieval.text.class_texts import read_imagenet_classes

    names = sorted({c.name.lower() for c in read_imagenet_classes()})
    kept = [n for n in names if not any(w in n for w in WEARABLE)]
    chosen = np.random.default_rng(seed).choice(len(kept), min(count, len(kept)), replace=False)
    return [f"a {kept[i]}" for i in sorted(chosen)]


def fashion_seed(args, seed: int, index_dir: Path) -> dict:
    """The Fashion-MNIST measurement of one seed (the draw of absent queries), on the index as recorded."""
    from retrieval.index import Index
    from retrieval.text.no_match import read_floor
    from retrieval.text.text_onnx import TextEmbedder

    text = TextEmbedder(args.fashion_text)
    absent = imagenet_absent(seed)
    with Index.open(index_dir) as index:
        result = measure(index, text, list(FASHION_PRESENT), absent, index.model_hash)
        floor = read_floor(index.info, text.model_hash)  # the recorded floor, through the product's own path
        found = index.search(text.embed(list(FASHION_PRESENT) + absent), 10)
    said = [floor.verdict(results) for results in found]
    result["product_path"] = {"floor": floor.floor,
                              "absent_no_match": float(np.mean(said[len(FASHION_PRESENT):])),
                              "present_no_match": float(np.mean(said[: len(FASHION_PRESENT)]))}
    return {"seed": seed, "images": len(index), "present": len(FASHION_PRESENT), "absent": len(absent), **result}


def summary(runs: list[dict]) -> dict:
    """Mean and spread over seeds of each quantile's rates, the default's and the best single floor's."""
    def spread(values: list[float]) -> dict[str, float]:
        return {"mean": float(np.mean(values)), "std": float(np.std(values)), "values": values}

    out = {q: {key: spread([r["by_quantile"][q][key] for r in runs]) for key in ("floor", "absent_no_match",
                                                                              "present_no_match")}
           for q in runs[0]["by_quantile"]}
    out["best_single_floor"] = {key: spread([r["best_single_floor"][key] for r in runs])
                                for key in ("floor", "absent_no_match", "present_no_match")}
    out["auc"] = spread([r["auc"] for r in runs])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="the image model (export --pretrained)")
    parser.add_argument("--emoji", type=Path, help="`retrieval data prepare emoji`'s folder")
    parser.add_argument("--fashion-index", type=Path, help="an index of Fashion-MNIST test images (--model's)")
    parser.add_argument("--fashion-text", type=Path, help="the text model searching it")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--save", metavar="MACHINE", help="write benchmarks/results/no-match-MACHINE.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"quantile_default": QUANTILE, "calibration_texts": len(CALIBRATION_TEXTS)}
    if args.emoji:
        runs = [emoji_seed(args, seed) for seed in args.seeds]
        results["emoji"] = {"runs": runs, "summary": summary(runs)}
    if args.fashion_index:
        from retrieval.text.text_index import record_text_model

        copy = args.out / "fashion-index"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(args.fashion_index, copy)
        record_text_model(copy, args.fashion_text)  # calibrates the floor as `index text` does
        runs = [fashion_seed(args, seed, copy) for seed in args.seeds]
        results["fashion"] = {"runs": runs, "summary": summary(runs), "text_model": str(args.fashion_text)}
    results["command"] = "python " + " ".join(sys.argv)
    (args.out / "no_match.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v["summary"] if isinstance(v, dict) and "summary" in v else v for k, v in results.items()},
                     indent=2))
    if args.save:
        save(results, args)


def save(results: dict, args) -> None:
    """benchmarks/results/no-match-MACHINE.json: per gallery and quantile, the floor and both rates over seeds."""
    from results_io import write_result  # beside this file

    def cell(spread: dict) -> str:
        return f"{spread['mean']:.3f} ± {spread['std']:.3f}" if len(spread["values"]) > 1 else \
            f"{spread['values'][0]:.3f}"

    rows = []
    for gallery in ("emoji", "fashion"):
        if gallery not in results:
            continue
        for key, value in results[gallery]["summary"].items():
            if key == "auc":
                continue
            name = "best single floor (chosen on the queries themselves)" if key == "best_single_floor" else \
                f"quantile {key}" + (" (default)" if key == str(QUANTILE) else "")
            rows.append([gallery, name, cell(value["floor"]), cell(value["absent_no_match"]),
                         cell(value["present_no_match"])])
    first = next(results[g]["runs"][0] for g in ("emoji", "fashion") if g in results)
    write_result("no-match", args.save, results["command"],
                 ["gallery", "floor", "floor value", "no_match on queries without answers (>= 0.75)",
                  "no_match on queries with answers (<= 0.10)"], rows,
                 notes=f"{len(CALIBRATION_TEXTS)} calibration texts; seeds {args.seeds}; AUC of the best scores "
                       "(a query with answers above one without): "
                       + ", ".join(f"{g} {cell(results[g]['summary']['auc'])}" for g in ("emoji", "fashion")
                                   if g in results) + "; "
                       f"first run: {first['images']} images, {first['present']} queries with answers, "
                       f"{first['absent']} without")


if __name__ == "__main__":
    main()
