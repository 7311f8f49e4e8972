"""The class-disjoint part of benchmarks/shop_text.py (``--parts disjoint``): Fashion-MNIST's classes split in two
(``TRAIN_CLASSES`` / the others), each photo a coloured cut-out as the shop's are, captioned by its title and its
class's description (``DESCRIPTIONS``); a tower trained on the train classes' captions, then each test photo's caption
searched among the test photos: Recall@10 of its own photo, Precision@10 of its class.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
from shop_catalogue import COLOURS, FASHION, coloured, cut_out, on_white
from shop_text import cli, index_info, mean_spread, search, train_tower

TRAIN_CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat")  # the dataset's own disjoint split (0-4 / 5-9)
DESCRIPTIONS = {  # written for each class, in words a shop would use
    "t-shirt": "a short-sleeved casual top in cotton jersey",
    "trouser": "long trousers with two legs, worn from the waist to the ankles",
    "pullover": "a warm knitted jumper with long sleeves, pulled on over the head",
    "dress": "a one-piece garment for women with a skirt",
    "coat": "a long warm outer garment with sleeves and buttons, worn outdoors",
    "sandal": "an open summer shoe held on the foot by straps",
    "shirt": "a collared top with buttons down the front and long sleeves",
    "sneaker": "a lace-up sports shoe with a rubber sole, for running",
    "bag": "a handbag with handles or a strap, for carrying things",
    "ankle-boot": "a short boot that covers the ankle, with a heel",
}
DISJOINT_PER_CLASS = 40


def disjoint_catalogue(folder: Path, seed: int) -> tuple[Path, Path]:
    """The class-disjoint split's photos (coloured cut-outs, as the shop's) with a caption each: train.csv (the
    train classes) and test.csv (the others), made once per seed."""
    from retrieval.data.builtin import FASHION_MNIST_CLASSES, read_fashion_mnist

    train_csv, test_csv = folder / "train.csv", folder / "test.csv"
    if test_csv.is_file():
        return train_csv, test_csv
    rng = np.random.default_rng(1000 + seed)
    images, labels = read_fashion_mnist(None, "t10k")  # the test IDX: photos the shop catalogue never uses
    written = {"train": [], "test": []}
    for index, name in enumerate(FASHION_MNIST_CLASSES):
        part = "train" if name in TRAIN_CLASSES else "test"
        count = DISJOINT_PER_CLASS * (2 if part == "train" else 1)
        colours = rng.permutation(np.resize(list(COLOURS), count))
        titles = FASHION[name][1]
        for n, (position, colour) in enumerate(zip(rng.permutation(np.flatnonzero(labels == index))[:count],
                                                   colours, strict=True)):
            crop, mask = cut_out(np.asarray(images[position]))
            path = Path(part) / name / f"{int(position):05d}.jpg"
            (folder / path).parent.mkdir(parents=True, exist_ok=True)
            on_white(coloured(crop, COLOURS[colour]), mask, rng, (3, 6)).save(folder / path, quality=90)
            title = titles[n % len(titles)].format(colour=colour)
            written[part].append({"path": path.as_posix(), "label": name,
                                  "caption": f"{title[0].upper()}{title[1:]}: {DESCRIPTIONS[name]}"})
    for part, csv_path in (("train", train_csv), ("test", test_csv)):
        with open(csv_path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=["path", "label", "caption"])
            writer.writeheader()
            writer.writerows(written[part])
    return train_csv, test_csv


def disjoint_measures(found: list[list[str]], rows: list[dict]) -> dict:
    """Recall@10 of each caption's own photo and Precision@10 of its class, from each caption's top paths."""
    label = {r["path"]: r["label"] for r in rows}
    own = [r["path"] in top[:10] for r, top in zip(rows, found, strict=True)]
    same = [np.mean([label.get(p) == r["label"] for p in top[:10]]) for r, top in zip(rows, found, strict=True)]
    return {"recall@10": float(np.mean(own)), "category_p@10": float(np.mean(same))}


def linear_map(model: Path, train_csv: Path, cache: Path):
    """The ridge regression of the train photos' vectors on frozen MiniLM sentence features of their captions (the
    ridge start), as a function from texts to vectors."""
    from text_search import ridge_map

    return ridge_map(train_csv, ("caption",), model, cache)


def disjoint_part(work: Path, seeds: list[int], model: Path, features: dict) -> dict:
    """Per seed: the zero-shot tower (as the export writes it, and as index build records it), the trained tower
    and the linear map, each caption of a test photo searched among the test photos."""
    from retrieval.train.text_tower import embed_images

    out: dict[str, list[dict]] = {}
    for seed in seeds:
        folder = work / f"disjoint{seed}"
        train_csv, test_csv = disjoint_catalogue(folder, seed)
        with open(test_csv, newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        captions = [r["caption"] for r in rows]
        paths = [str(folder / r["path"]) for r in rows]
        images, _, readable = embed_images(str(model), paths, folder / "test_images.npz", progress=False)
        assert len(readable) == len(rows), "every test photo must be readable"

        def ranked(text_vectors: np.ndarray, images: np.ndarray = images, rows: list[dict] = rows) -> list[list[str]]:
            top = np.argsort(-(text_vectors @ images.T), axis=1)[:, :10]
            return [[rows[i]["path"] for i in t] for t in top]

        found: dict[str, dict] = {}
        found["linear map on frozen MiniLM"] = disjoint_measures(
            ranked(linear_map(model, train_csv, folder / "train_images.npz")(captions)), rows)
        if features["zero_shot"]:
            from retrieval.text.text_onnx import TextEmbedder

            found["zero-shot tower, as exported"] = disjoint_measures(
                ranked(TextEmbedder(features["zero_shot"]).embed(captions)), rows)
            index = folder / "index-zero-shot"
            shutil.rmtree(index, ignore_errors=True)
            cli("index", "build", "--model", str(model), "--images", str(test_csv), "--out", str(index))
            if index_info(index).get("text_model_path"):
                found["zero-shot tower, as index build records it"] = disjoint_measures(
                    [[r["path"] for r in a["results"]] for a in search(index, captions)], rows)
        tower, report = train_tower(model, train_csv, folder / "text", seed, "caption")
        if tower is not None:
            index = folder / "index-trained"
            shutil.rmtree(index, ignore_errors=True)
            cli("index", "build", "--model", str(model), "--images", str(test_csv), "--out", str(index))
            cli("index", "text", str(index), "--text-model", str(tower))
            found["trained tower (text train, train classes)"] = disjoint_measures(
                [[r["path"] for r in a["results"]] for a in search(index, captions)], rows) | report
        for name, measured in found.items():
            out.setdefault(name, []).append({"seed": seed, **measured})
        print(json.dumps({"seed": seed, **found}), flush=True)
    return out


def disjoint_rows(results: dict) -> list[list[str]]:
    return [[name, mean_spread([r["recall@10"] for r in runs]), mean_spread([r["category_p@10"] for r in runs])]
            for name, runs in results.items()]
