"""Galleries for the near-duplicate and label-audit tests: sklearn's digits as PNGs in one folder per class, copies of
some planted beside them (``retrieval.index.curation.copy_planting.plant_copies``: resized, re-encoded,
recoloured), labels flipped by moving files into another class's folder, and the tiny ONNX model that embeds them;
and photo-like product shots (Fashion-MNIST items, each in one colour on white) for the copy verification tests."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import numpy as np
from embedders import write_projection_onnx
from PIL import Image

# the kinds a raw-pixel projection model sees as copies (a crop moves every pixel, a recolouring changes them all:
# a real network sees those)
PIXEL_KINDS = ("resized", "jpeg")


def write_digits(folder: Path, count: int, start: int = 0, size: int = 32) -> list[Path]:
    """Digits ``start`` .. ``start + count - 1`` of sklearn's set as ``folder/<digit>/d<number>.png`` (upscaled to
    ``size`` px, RGB)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    paths = []
    for i in range(start, start + count):
        path = folder / str(digits.target[i]) / f"d{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
        Image.fromarray(pixels).resize((size, size), Image.Resampling.BICUBIC).convert("RGB").save(path)
        paths.append(path)
    return paths


def write_patterns(folder: Path, count: int, start: int = 0, size: int = 48, classes: int = 5) -> list[Path]:
    """``count`` smooth random colour patterns (4 x 4 colours, upscaled) as ``folder/c<n % classes>/p<n>.png``:
    unlike digits, distinct ones are far apart even in raw pixels, so copies stand out to the projection model."""
    paths = []
    for i in range(start, start + count):
        path = folder / f"c{i % classes}" / f"p{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        small = np.random.default_rng(i).integers(0, 256, (4, 4, 3), dtype=np.uint8)
        Image.fromarray(small).resize((size, size), Image.Resampling.BICUBIC).save(path)
        paths.append(path)
    return paths


def fashion_item(number: int, side: int = 128, hue: float | None = None) -> Image.Image:
    """Fashion-MNIST test item ``number`` as a product shot: shaded in one colour (``hue`` in [0, 1), default a
    seeded one) on white, upscaled to ``side`` px (RGB). Local Debian data: /usr/share/datasets/fashion-mnist."""
    import colorsys

    images, _ = _fashion()
    item = images[number].astype(np.float64) / 255.0
    hue = float(np.random.default_rng(number).uniform(0, 1)) if hue is None else hue
    colour = np.asarray(colorsys.hsv_to_rgb(hue, 0.8, 0.9))
    shaded = item[..., None] * colour * (0.3 + 0.7 * item[..., None])  # darker where the item is faint
    rgb = 255.0 * (1.0 - item[..., None]) + 255.0 * shaded
    return Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).resize((side, side), Image.Resampling.BICUBIC)


@functools.lru_cache(maxsize=1)
def _fashion() -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's test part (images, labels), read once."""
    from retrieval.data.builtin import read_fashion_mnist

    return read_fashion_mnist(None, "t10k")


def write_items(folder: Path, numbers: list[int], side: int = 128) -> list[Path]:
    """Fashion-MNIST test items ``numbers`` as product shots (``fashion_item``) in
    ``folder/<class>/f<number>.png``."""
    _, labels = _fashion()
    paths = []
    for number in numbers:
        path = folder / f"class{labels[number]}" / f"f{number:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fashion_item(number, side).save(path)
        paths.append(path)
    return paths


def plant(sources: list[Path], kinds: tuple[str, ...] = PIXEL_KINDS,
          folder: Path | None = None) -> dict[Path, list[Path]]:
    """Copies of each source (``plant_copies``) saved beside it, or in ``folder`` keeping its class folder: the JPEG
    copy as a .jpg (its re-encoding kept), the others as PNG. source -> its copies."""
    from retrieval.index.curation.copy_planting import THRESHOLD_KINDS, plant_copies

    planted = {}
    for n, source in enumerate(sources):
        target = source.parent if folder is None else folder / source.parent.name
        target.mkdir(parents=True, exist_ok=True)
        copies = plant_copies(Image.open(source), THRESHOLD_KINDS, seed=n)
        paths = []
        for kind in kinds:
            path = target / f"{source.stem}_{kind}.{'jpg' if kind == 'jpeg' else 'png'}"
            copies[kind].save(path, **({"quality": 95} if kind == "jpeg" else {}))
            paths.append(path)
        planted[source] = paths
    return planted


def flip(paths: list[Path], classes: int = 10) -> dict[Path, str]:
    """Move each file into the next class's folder (digit + 1 mod ``classes``): new path -> its true label."""
    moved = {}
    for path in paths:
        true = path.parent.name
        target = path.parent.parent / str((int(true) + 1) % classes) / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(path, target)
        moved[target] = true
    return moved


def projection_model(folder: Path) -> Path:
    """The tiny ONNX embedder (a fixed random projection of the pixels, 64-d) the tests index digits with."""
    folder.mkdir(parents=True, exist_ok=True)
    return write_projection_onnx(folder / "model.onnx", dim=64)


def graph_of(rows: dict[int, list[tuple[int, float]]]):
    """A ``NeighbourGraph`` by hand: image id -> its neighbours (id, cosine), best first; -1 / -inf pad the rest."""
    from retrieval.index.curation.neighbour_graph import NeighbourGraph

    ids = np.asarray(sorted(rows), dtype=np.int64)
    k = max(len(r) for r in rows.values())
    scores = np.full((len(ids), k), -np.inf, np.float32)
    neighbours = np.full((len(ids), k), -1, np.int64)
    for row, image in enumerate(ids.tolist()):
        for column, (other, score) in enumerate(rows[image]):
            neighbours[row, column], scores[row, column] = other, score
    return NeighbourGraph(ids, scores, neighbours)
