"""Copies and variants planted of gallery images, as people make them, for both calibrations of the near-duplicates:
the cosine threshold (``duplicates_threshold``: ``THRESHOLD_KINDS``) and the copy verification (``copy_calibration``:
``VERIFICATION_KINDS``, and the colour and shade variants, distinct products its checks must tell apart).

- ``plant_copies(image, kinds)``: one copy per kind, drawn in the order of ``kinds`` from one seeded generator.
- ``plant_colour_variant``: the hues turned 25-60 degrees; ``plant_shade_variant``: the object's colours darker.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import numpy as np
from PIL import Image, ImageEnhance

from retrieval.data.colour import DEFAULT_BACKGROUND, flatten_alpha
from retrieval.errors import ParameterError

# the threshold's copies: resized, re-encoded, cropped, and recoloured (saturation, brightness and contrast moved)
THRESHOLD_KINDS = ("resized", "jpeg", "cropped", "recoloured")
# the verification's copies: resized, re-encoded, cropped, brightened, slightly turned, and shrunk (a third of the
# size and brightened: the harsh downscale a re-upload makes, which the correlation cut must let through)
VERIFICATION_KINDS = ("resized", "jpeg", "cropped", "brightness", "rotated", "shrunk")
SHADE_FACTOR = 0.55  # the planted shade variant: the object's colours this much darker, its ground kept
SHRUNK_SHARE = 1 / 3  # of each side, the shrunk copy
SHRUNK_BRIGHTNESS = 1.2  # and its brightness


def plant_copies(image: Image.Image, kinds: Sequence[str], seed: int = 0,
                 background: Sequence[int] = DEFAULT_BACKGROUND) -> dict[str, Image.Image]:
    """One copy of ``image`` per kind of ``kinds`` (of ``THRESHOLD_KINDS`` and ``VERIFICATION_KINDS``), in that
    order: resized (half the size), jpeg (quality 35), cropped (80 % of each side at a seeded offset), recoloured
    (saturation x 0.5, brightness x 1.2, contrast x 0.85), brightness (x 1.25, contrast x 0.85), rotated (3 to 8
    degrees either way, corners filled with ``background``), shrunk (a third of each side, brightness x 1.2).
    Transparent pixels are first put on ``background`` (the model's), as the index does."""
    unknown = [kind for kind in kinds if kind not in _MAKERS]
    if unknown:
        raise ParameterError("kinds", f"holds {unknown!r}; the kinds of copy planted are {sorted(_MAKERS)}")
    rng = np.random.default_rng(seed)
    rgb = flatten_alpha(image, background).convert("RGB")
    return {kind: _MAKERS[kind](rgb, rng, tuple(background)) for kind in kinds}


def _resized(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    return rgb.resize((max(8, rgb.width // 2), max(8, rgb.height // 2)), Image.Resampling.BICUBIC)


def _jpeg(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    buffer = io.BytesIO()
    rgb.save(buffer, format="JPEG", quality=35)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def _cropped(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    width, height = rgb.size
    crop_w, crop_h = max(1, round(width * 0.8)), max(1, round(height * 0.8))
    left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
    return rgb.crop((left, top, left + crop_w, top + crop_h))


def _recoloured(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    return ImageEnhance.Contrast(ImageEnhance.Brightness(ImageEnhance.Color(rgb).enhance(0.5))
                                 .enhance(1.2)).enhance(0.85)


def _brightness(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    return ImageEnhance.Contrast(ImageEnhance.Brightness(rgb).enhance(1.25)).enhance(0.85)


def _rotated(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    angle = float(rng.uniform(3, 8) * rng.choice([-1, 1]))
    return rgb.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=background)


def _shrunk(rgb: Image.Image, rng: np.random.Generator, background: tuple[int, ...]) -> Image.Image:
    size = (max(8, round(rgb.width * SHRUNK_SHARE)), max(8, round(rgb.height * SHRUNK_SHARE)))
    return ImageEnhance.Brightness(rgb.resize(size, Image.Resampling.BILINEAR)).enhance(SHRUNK_BRIGHTNESS)


_MAKERS: dict[str, Callable[[Image.Image, np.random.Generator, tuple[int, ...]], Image.Image]] = {
    "resized": _resized, "jpeg": _jpeg, "cropped": _cropped, "recoloured": _recoloured, "brightness": _brightness,
    "rotated": _rotated, "shrunk": _shrunk}


def plant_colour_variant(image: Image.Image, seed: int = 0,
                         background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image:
    """``image`` with its hues turned by a seeded 25 to 60 degrees either way (red to orange, blue to violet) and
    its grey parts tinted: the same product in a near colour, which is not a copy."""
    rng = np.random.default_rng(seed)
    rgb = flatten_alpha(image, background).convert("RGB")
    hsv = np.asarray(rgb.convert("HSV")).copy()
    shift = int(rng.integers(18, 43)) * int(rng.choice([-1, 1]))  # of 256: 25 to 60 degrees
    hsv[..., 0] = (hsv[..., 0].astype(np.int64) + shift) % 256
    # grey pixels have no hue to turn: give the not-quite-white ones a colour of their own
    grey = (hsv[..., 1] < 40) & (hsv[..., 2] < 235)
    hsv[..., 1] = np.where(grey, 160, hsv[..., 1])
    hsv[..., 0] = np.where(grey, (shift * 3) % 256, hsv[..., 0])
    return Image.fromarray(hsv, "HSV").convert("RGB")


def plant_shade_variant(image: Image.Image, background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image:
    """``image`` with its object (the pixels off ``background``) ``SHADE_FACTOR`` times darker and its ground kept:
    the same product in a darker shade of its colours (burgundy for red, navy for blue), which is not a copy."""
    rgb = np.asarray(flatten_alpha(image, background).convert("RGB")).astype(np.float32)
    ground = np.asarray(background, np.float32)[:3]
    # the ground kept: a darkened copy darkens it too, a product in a darker shade does not
    off = (np.abs(rgb - ground) > 12).any(axis=2, keepdims=True)
    return Image.fromarray(np.where(off, rgb * SHADE_FACTOR, rgb).round().astype(np.uint8), "RGB")
