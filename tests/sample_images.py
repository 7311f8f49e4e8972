"""Small images made in memory for the tests: any image as PNG bytes, plain and noisy PNGs, a noisy JPEG, a
transparent sticker; and folders of distinct noise PNGs written to disk."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image


def encode_png(image: Image.Image) -> bytes:
    """``image`` as the bytes of a PNG file."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_bytes(size: tuple[int, int] = (32, 32), colour=(200, 30, 30)) -> bytes:
    """One flat colour: the cheapest valid PNG (its truncations make broken ones)."""
    return encode_png(Image.new("RGB", size, colour))


def jpeg_bytes(size: tuple[int, int] = (64, 64)) -> bytes:
    """Noise, so that the JPEG is large enough to cut into a broken one."""
    buffer = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(noise).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def noisy_png(color: tuple[int, int, int], seed: int, size: int = 24) -> bytes:
    """Mostly noise with a quarter of ``color``: images of one colour are alike but never identical (a class)."""
    noise = np.random.default_rng(seed).integers(0, 256, (size, size, 3))
    buffer = io.BytesIO()
    Image.fromarray((0.75 * noise + 0.25 * np.array(color)).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def sticker(size: int = 48) -> Image.Image:
    """A red disc on a fully transparent background whose hidden RGB is black (as most exporters leave it)."""
    yy, xx = np.mgrid[:size, :size]
    inside = (yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 3) ** 2
    pixels = np.zeros((size, size, 4), np.uint8)
    pixels[inside] = (220, 30, 30, 255)
    return Image.fromarray(pixels, "RGBA")


def write_images(folder: Path, count: int, start: int = 0) -> list[Path]:
    """``count`` distinct 16 px noise PNGs directly in ``folder``, img_{start:03d}.png on, each seeded by its number
    (the same number, the same image)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(start, start + count):
        pixels = np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8)
        paths.append(folder / f"img_{i:03d}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def smooth_picture(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth colour field (JPEG keeps it well), distinct per seed: a wrong crop or flip of it shows."""
    coarse = np.random.default_rng(seed).integers(0, 256, (4, 4, 3)).astype(np.uint8)
    return np.asarray(Image.fromarray(coarse).resize((width, height), Image.BICUBIC))


def save_jpeg(path: Path, pixels: np.ndarray, **options) -> str:
    """``pixels`` saved as a quality-95 JPEG at ``path`` (Pillow's ``options``, e.g. progressive); the path."""
    Image.fromarray(pixels).save(path, format="JPEG", quality=95, **options)
    return str(path)


class NoisePictures:
    """A map-style data set of ``count`` different noise pictures (60 x 50 RGB) through ``transform``, labelled
    ``index % classes``; at module level, so that DataLoader workers started by any method can unpickle it."""

    def __init__(self, transform, count: int = 12, classes: int = 4) -> None:
        self.transform, self.count, self.classes = transform, count, classes

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int):
        pixels = np.random.default_rng(index).integers(0, 256, (60, 50, 3), dtype=np.uint8)
        return self.transform(Image.fromarray(pixels)), index % self.classes
