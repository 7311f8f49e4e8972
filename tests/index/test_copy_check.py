"""Is one image a transformed copy of another (``copy_check``)? A product shot (a Fashion-MNIST item shaded in one
colour on white, upscaled) against its crop, thumbnails, JPEG, brightened and slightly turned copies: many features
agree under one transform, the aligned grey levels correlate and the colours keep their hue; against its hue-turned
variant the colours differ; against another product nothing aligns. ``colour_difference`` against a slow reference,
``detail_level``'s halvings, and degenerate images (blank, 1 x 1, a thin strip, transparent) that never raise nor
give NaN."""

from __future__ import annotations

import io
import math

import cv2
import numpy as np
import pytest
from PIL import Image, ImageEnhance
from planted import fashion_item

from retrieval.index.curation.copy_check import (
    CHROMATIC,
    GREY,
    MAX_LEVEL,
    PairComparison,
    colour_difference,
    compare_levels,
    compare_pair,
    detail_level,
    image_features,
)
from retrieval.index.curation.copy_planting import plant_colour_variant
from retrieval.index.curation.copy_verification import CopyRules

SIDE = 160
ITEM = 1  # a pullover: shading and a textured body give SIFT dozens of features
HUE = 0.6  # blue


@pytest.fixture(scope="module")
def photo() -> Image.Image:
    return fashion_item(ITEM, SIDE, hue=HUE)


@pytest.fixture(scope="module")
def features(photo):
    return image_features(photo)


def jpeg(image: Image.Image, quality: int) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def crop(image: Image.Image) -> Image.Image:
    """75 % of each side, off centre."""
    width, height = image.size
    left, top = round(width * 0.15), round(height * 0.1)
    return image.crop((left, top, left + round(width * 0.75), top + round(height * 0.75)))


def turned(image: Image.Image, degrees: float) -> Image.Image:
    return image.rotate(degrees, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=(255, 255, 255))


def shrunk(image: Image.Image, factor: int) -> Image.Image:
    return image.resize((image.width // factor, image.height // factor), Image.Resampling.LANCZOS)


# the transformed copies, with the scale the fitted transform should find from the original's working image to the
# copy's (each is compared with its longer side at the same working size): a 75 % crop shows its content 1 / 0.75
# larger, a turned copy's expanded canvas shows it cos + sin smaller
COPIES = {
    "cropped": (crop, 1 / 0.75, 0.0),
    "half size": (lambda image: shrunk(image, 2), 1.0, 0.0),
    "quarter size": (lambda image: shrunk(image, 4), 1.0, 0.0),
    "jpeg": (lambda image: jpeg(image, 30), 1.0, 0.0),
    "brightened": (lambda image: ImageEnhance.Brightness(image).enhance(1.2), 1.0, 0.0),
    "turned 6 degrees": (lambda image: turned(image, 6), 1 / (math.cos(math.radians(6)) + math.sin(math.radians(6))),
                         6.0),
    "turned -6 degrees": (lambda image: turned(image, -6),
                          1 / (math.cos(math.radians(6)) + math.sin(math.radians(6))), 6.0),
}


def finite(comparison: PairComparison) -> bool:
    values = [comparison.overlap, comparison.correlation, comparison.colour_mismatch]
    values += [v for v in (comparison.scale, comparison.rotation) if v is not None]
    return all(math.isfinite(v) for v in values) and all(math.isfinite(v) for v in comparison.to_dict().values()
                                                         if isinstance(v, float))


@pytest.mark.parametrize("kind", list(COPIES))
def test_a_transformed_copy_aligns_correlates_and_keeps_its_colours(photo, features, kind):
    make, scale, degrees = COPIES[kind]
    comparison = compare_pair(features, image_features(make(photo)))
    assert comparison.inliers >= 4 and comparison.matches >= comparison.inliers
    assert comparison.correlation > 0.9 and comparison.overlap > 0.9
    assert comparison.colour_mismatch < 8.0 and comparison.coloured_pixels > 500
    assert comparison.scale == pytest.approx(scale, rel=0.03)
    assert abs(comparison.rotation) == pytest.approx(degrees, abs=1.0)
    assert CopyRules().reason(comparison) is None


def test_the_verdict_does_not_depend_on_which_image_comes_first(photo, features):
    half = image_features(shrunk(photo, 2))
    other = image_features(fashion_item(4, SIDE, hue=HUE))
    rules = CopyRules()
    assert rules.reason(compare_pair(features, half)) is None and rules.reason(compare_pair(half, features)) is None
    assert rules.reason(compare_pair(features, other)) is not None
    assert rules.reason(compare_pair(other, features)) is not None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_hue_turned_variant_is_not_a_copy_for_its_colours(photo, features, seed):
    """The same product in another colour: its hues turned 25 to 60 degrees. Whether or not its grey levels still
    correlate (a hue turn moves lightness too), the colours of the aligned content differ far beyond a copy's."""
    variant = plant_colour_variant(photo, seed=seed)
    comparison = compare_pair(features, image_features(variant))
    assert comparison.colour_mismatch > 20.0 and comparison.coloured_pixels > 1000
    assert CopyRules().reason(comparison) is not None
    if comparison.inliers >= 4 and comparison.correlation >= CopyRules().correlation:
        assert CopyRules().reason(comparison) == "colours differ"


def test_a_variant_whose_grey_levels_still_agree_fails_on_colour_alone(photo, features):
    comparison = compare_pair(features, image_features(plant_colour_variant(photo, seed=0)))
    assert comparison.inliers >= 10 and comparison.correlation > 0.95  # the shape and shading agree
    assert CopyRules().reason(comparison) == "colours differ"


@pytest.mark.parametrize("other", [0, 2, 3, 4, 5, 7, 8, 11, 16, 24])  # 24: another pullover, like item 1
def test_another_product_is_not_a_copy(features, other):
    comparison = compare_pair(features, image_features(fashion_item(other, SIDE, hue=HUE)))
    assert CopyRules().reason(comparison) is not None
    assert finite(comparison)


def test_a_level_compared_with_itself_is_the_identity(features):
    level = features.level(0)
    comparison = compare_levels(level, level)
    assert comparison.inliers >= 20 and comparison.inliers <= len(level.points)
    assert comparison.scale == pytest.approx(1.0, abs=1e-3) and comparison.rotation == pytest.approx(0.0, abs=0.1)
    assert comparison.overlap == pytest.approx(1.0) and comparison.correlation == pytest.approx(1.0)
    assert comparison.colour_mismatch == pytest.approx(0.0, abs=1e-6)


def test_the_levels_of_detail_are_made_at_the_working_size_and_once():
    """Level n shows what the image holds at 1 / 2 ** n of its size (fine noise blurs away), at the working size."""
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8))
    prepared = image_features(noise)
    levels = [prepared.level(n) for n in range(MAX_LEVEL + 1)]
    assert prepared.level(1) is levels[1]  # computed once
    assert all(level.size == (384, 384) for level in levels)
    assert all(len(level.points) == len(level.descriptors) > 0 and level.descriptors.shape[1] == 128
               for level in levels)
    sharpness = [cv2.Laplacian(cv2.cvtColor(level.rgb, cv2.COLOR_RGB2GRAY), cv2.CV_64F).var() for level in levels]
    assert sharpness[0] > 2 * sharpness[1] > 4 * sharpness[2]


# --- colour_difference against a slow reference
def reference_colour_difference(first: np.ndarray, second: np.ndarray) -> tuple[float, int]:
    """``colour_difference`` as its docstring says, one pixel at a time in float64: the pixels coloured (Lab chroma
    >= CHROMATIC) in either count; a pixel grey (chroma < GREY) in one of the two counts 90 degrees, weighted by the
    other's chroma; any other compares its two hue angles (the shorter way round), weighted by the lower chroma."""
    total = weights = 0.0
    count = 0
    for rgb_a, rgb_b in zip(first, second, strict=True):
        lab = [cv2.cvtColor(np.asarray(rgb, np.uint8).reshape(1, 1, 3), cv2.COLOR_RGB2LAB)[0, 0].astype(np.float64)
               for rgb in (rgb_a, rgb_b)]
        a = [float(x[1]) - 128.0 for x in lab]
        b = [float(x[2]) - 128.0 for x in lab]
        chroma = [math.sqrt(a[i] ** 2 + b[i] ** 2) for i in range(2)]
        if max(chroma) < CHROMATIC:
            continue
        count += 1
        if min(chroma) < GREY:
            difference, weight = 90.0, max(chroma)
        else:
            hues = [math.degrees(math.atan2(b[i], a[i])) for i in range(2)]
            apart = abs(hues[0] - hues[1]) % 360.0
            difference, weight = min(apart, 360.0 - apart), min(chroma)
        total += difference * weight
        weights += weight
    return (total / weights if weights else 0.0), count


def pixel_mix(seed: int, n: int = 400) -> np.ndarray:
    """Vivid colours, greys and faint tints (chroma around GREY and CHROMATIC), mixed."""
    rng = np.random.default_rng(seed)
    vivid = rng.integers(0, 256, (n // 2, 3))
    grey = np.repeat(rng.integers(0, 256, (n // 4, 1)), 3, axis=1)
    faint = np.clip(rng.integers(60, 200, (n - n // 2 - n // 4, 1)) + rng.integers(-12, 13, (n - n // 2 - n // 4, 3)),
                    0, 255)
    pixels = np.concatenate([vivid, grey, faint]).astype(np.uint8)
    return pixels[rng.permutation(len(pixels))]


@pytest.mark.parametrize("seed", range(4))
def test_colour_difference_equals_the_slow_reference(seed):
    first, second = pixel_mix(seed), pixel_mix(seed + 100)
    measured, count = colour_difference(first, second)
    expected, expected_count = reference_colour_difference(first, second)
    assert count == expected_count > 0
    assert measured == pytest.approx(expected, rel=1e-4, abs=1e-3)


def test_colour_difference_of_a_brightened_copy_and_of_other_hues():
    rng = np.random.default_rng(5)
    pixels = pixel_mix(5)
    brighter = np.clip(pixels.astype(np.float64) * 1.15 + 10, 0, 255).astype(np.uint8)
    assert colour_difference(pixels, pixels) == (0.0, reference_colour_difference(pixels, pixels)[1])
    assert colour_difference(pixels, brighter)[0] < 6.0  # lightness moves, hue does not
    assert colour_difference(pixels, brighter)[0] == pytest.approx(reference_colour_difference(pixels, brighter)[0],
                                                                   rel=1e-4, abs=1e-3)
    shuffled = pixels[rng.permutation(len(pixels))]
    assert colour_difference(pixels, shuffled)[0] > 30.0
    red, green = np.asarray([[220, 30, 30]], np.uint8), np.asarray([[30, 200, 30]], np.uint8)
    assert colour_difference(red, green)[0] > 90.0 and colour_difference(red, green)[1] == 1
    grey = np.asarray([[128, 128, 128]], np.uint8)
    assert colour_difference(red, grey) == (90.0, 1) and colour_difference(grey, red) == (90.0, 1)


def test_colour_difference_of_no_pixels_or_only_greys_is_zero():
    empty = np.zeros((0, 3), np.uint8)
    assert colour_difference(empty, empty) == (0.0, 0)
    greys = np.repeat(np.arange(0, 256, 5, dtype=np.uint8)[:, None], 3, axis=1)
    assert colour_difference(greys, greys[::-1]) == (0.0, 0)


# --- detail_level
@pytest.mark.parametrize(("larger", "smaller", "level"), [
    (100, 100, 0), (100, 200, 0), (100, 0, 0), (0, 0, 0),
    (154, 100, 0),  # a 65 % crop stays at level 0
    (168, 100, 0), (169, 100, 1),  # halvings rounded down past a quarter: 2 ** 0.75 = 1.68
    (200, 100, 1), (336, 100, 1), (337, 100, 2),  # 2 ** 1.75 = 3.36
    (400, 100, 2), (1600, 100, MAX_LEVEL), (10 ** 6, 1, MAX_LEVEL),
])
def test_detail_level_counts_the_halvings_between_two_sizes(larger, smaller, level):
    assert detail_level(larger, smaller) == level


# --- degenerate images
def transparent_photo(photo: Image.Image) -> Image.Image:
    """The product on a transparent ground whose hidden colour is black."""
    rgb = np.asarray(photo).copy()
    ground = (rgb >= 250).all(axis=2)
    rgb[ground] = 0
    alpha = np.where(ground, 0, 255).astype(np.uint8)
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


DEGENERATE = {
    "blank white": lambda: Image.new("RGB", (120, 90), (255, 255, 255)),
    "blank black": lambda: Image.new("L", (64, 64), 0),
    "one pixel": lambda: Image.new("RGB", (1, 1), (200, 30, 40)),
    "thin strip": lambda: Image.fromarray(np.random.default_rng(0).integers(0, 256, (1, 300, 3), dtype=np.uint8)),
    "transparent": lambda: Image.fromarray(np.dstack([np.random.default_rng(1).integers(0, 256, (50, 50, 3),
                                                                                         dtype=np.uint8),
                                                      np.zeros((50, 50), np.uint8)]), "RGBA"),
}


@pytest.mark.parametrize("kind", list(DEGENERATE))
def test_a_degenerate_image_is_compared_without_error_or_nan_and_copies_nothing(photo, features, kind):
    image = DEGENERATE[kind]()
    prepared = image_features(image)
    for level in range(MAX_LEVEL + 1):
        assert prepared.level(level).rgb.shape[2] == 3
    rules = CopyRules()
    for a, b in ((prepared, features), (features, prepared)):
        comparison = compare_pair(a, b)
        assert finite(comparison)
        assert rules.reason(comparison) is not None
    alone = compare_pair(prepared, image_features(DEGENERATE[kind]()))
    assert finite(alone)


def test_blank_images_are_not_copies_of_each_other():
    white = image_features(Image.new("RGB", (80, 80), (255, 255, 255)))
    comparison = compare_pair(white, image_features(Image.new("RGB", (40, 40), (255, 255, 255))))
    assert comparison.inliers == 0 and CopyRules().reason(comparison) == "no geometric agreement"


def test_a_transparent_image_is_put_on_white_before_it_is_compared(photo, features):
    """The product on a transparent ground (hidden black) is the product on white: a copy, colours and all."""
    sticker = transparent_photo(photo)
    prepared = image_features(sticker)
    # the ground is white, not the hidden black: the picture is the product on white, to a pixel's rounding
    assert np.abs(prepared.level(0).rgb.astype(int) - features.level(0).rgb).max() <= 8
    comparison = compare_pair(features, prepared)
    assert comparison.correlation > 0.99 and comparison.colour_mismatch < 2.0
    assert CopyRules().reason(comparison) is None
    on_black = image_features(sticker, background=(0, 0, 0))
    assert (on_black.level(0).rgb[:, 0] < 8).all() and (features.level(0).rgb[:, 0] > 247).all()
