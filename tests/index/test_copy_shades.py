"""A darker shade of one hue (burgundy for red, navy for blue) is another product, not a copy: the copy check
measures the colours' strength (``shade_difference``), the calibration plants a shade variant and puts the shade
cut between it and the planted copies; a brightened copy still passes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import ImageEnhance
from planted import fashion_item

from retrieval.index.curation.copy_calibration import LOOSE_SHADE, TIGHT_SHADE, choose_rules
from retrieval.index.curation.copy_check import PairComparison, compare_pair, image_features, shade_difference
from retrieval.index.curation.copy_planting import SHADE_FACTOR, plant_shade_variant
from retrieval.index.curation.copy_verification import COLOURS_DIFFER, CopyRules


def slow_shade(first: np.ndarray, second: np.ndarray) -> float:
    """|log| of the mean chroma ratio over pixels coloured in both, pixel by pixel through the CIE formulas."""
    def chroma(rgb) -> float:
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in rgb)]
        x = (0.412453 * linear[0] + 0.357580 * linear[1] + 0.180423 * linear[2]) / 0.950456
        y = 0.212671 * linear[0] + 0.715160 * linear[1] + 0.072169 * linear[2]
        z = (0.019334 * linear[0] + 0.119193 * linear[1] + 0.950227 * linear[2]) / 1.088754
        f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
        return math.hypot(500 * (f[0] - f[1]), 200 * (f[1] - f[2]))

    pairs = [(chroma(a), chroma(b)) for a, b in zip(first.tolist(), second.tolist(), strict=True)]
    both = [(a, b) for a, b in pairs if a >= 12 and b >= 12]
    if len(both) < 16:
        return 0.0
    return abs(math.log(sum(a for a, _ in both) / sum(b for _, b in both)))


@pytest.mark.parametrize("seed", range(3))
def test_the_shade_difference_matches_the_formulas_pixel_by_pixel(seed):
    rng = np.random.default_rng(seed)
    first = rng.integers(0, 256, (200, 3)).astype(np.uint8)
    second = (first * rng.uniform(0.4, 1.0)).astype(np.uint8)
    assert shade_difference(first, second) == pytest.approx(slow_shade(first, second), abs=0.03)


def test_grey_pixels_and_identical_colours_have_no_shade_difference():
    grey = np.repeat(np.arange(0, 250, 10, dtype=np.uint8)[:, None], 3, axis=1)
    assert shade_difference(grey, grey // 2) == 0.0
    red = np.tile(np.asarray([[200, 40, 40]], np.uint8), (50, 1))
    assert shade_difference(red, red) == 0.0
    assert shade_difference(red, red // 2) == pytest.approx(shade_difference(red // 2, red))
    assert shade_difference(red, red // 2) > 0.3


def test_a_darker_shade_of_the_same_hue_is_not_a_copy_while_brightened_copies_are():
    item = fashion_item(3, side=192, hue=0.0)  # red
    own = image_features(item)
    shade = compare_pair(own, image_features(plant_shade_variant(item)))
    assert shade.colour_mismatch < 6.0  # the hue alone would call it a copy
    # the shaded edges (blended into white) also lower the correlation: rules loose on content show the shade's part
    loose = CopyRules(correlation=0.6)
    assert shade.shade > TIGHT_SHADE and loose.reason(shade) == COLOURS_DIFFER
    assert CopyRules(correlation=0.6, shade=math.inf).reason(shade) is None
    for factor in (0.8, 1.25):
        brightened = ImageEnhance.Contrast(ImageEnhance.Brightness(item).enhance(factor)).enhance(0.9)
        copy = compare_pair(own, image_features(brightened))
        assert copy.shade < TIGHT_SHADE and CopyRules().reason(copy) is None


def test_the_shade_variant_darkens_the_object_and_keeps_the_white_ground():
    item = fashion_item(3, side=64, hue=0.6)
    rgb, shaded = np.asarray(item).astype(int), np.asarray(plant_shade_variant(item)).astype(int)
    ground = (rgb == 255).all(axis=2)
    assert (shaded[ground] == 255).all()
    dark = (np.abs(rgb - 255) > 40).any(axis=2)
    assert np.allclose(shaded[dark], rgb[dark] * SHADE_FACTOR, atol=1)


def shaded(shade: float) -> PairComparison:
    return PairComparison(40, 20, 1.0, 0.0, 0.9, 0.99, 1.0, 500, shade)


@pytest.mark.parametrize(("copies", "shades", "cut"), [
    ([0.02, 0.05, 0.1], [0.9, 1.0], 0.4975),  # halfway from the copies' 95th percentile (0.095) to 0.9
    ([0.02, 0.05], [0.5, 0.6], TIGHT_SHADE),  # never stricter than brightness moves a copy
    ([0.02, 0.5], [2.0], LOOSE_SHADE),  # never looser
    ([0.02], [], TIGHT_SHADE),  # no shade variant with colour in the sample: the copies' own, within bounds
])
def test_the_shade_cut_lies_between_the_copies_and_the_shade_variants(copies, shades, cut):
    rules = choose_rules([shaded(s) for s in copies], [], [], [shaded(s) for s in shades])
    assert rules.shade == pytest.approx(cut, abs=1e-3)
