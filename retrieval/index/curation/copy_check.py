"""Is one image a transformed copy of another? Local features (SIFT) matched under one geometric transform (a
similarity: scale, rotation, shift, fitted by RANSAC), then the aligned contents compared, their grey levels and their
colours. Plain functions over arrays: ``image_features`` once per image, ``compare_pair`` per pair.

A copy is the same picture cropped, scaled, re-encoded, brightened or slightly turned: many features agree under one
transform, the aligned grey levels correlate, and the colours of the content keep their hue. Two products that differ
only in colour (the same photo recoloured, a red and a green traffic light) pass the first two and fail the third;
two photos of alike objects (two T-shirts) fail the first two. Each image is worked on with its longer side at
``WORKING_SIDE`` pixels (small images are upscaled, so a 28 px thumbnail still gives features), and SIFT finds its
features at every scale of its own pyramid; a crop of 80 % then shows its content 1.25x larger, which SIFT matches.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np
from PIL import Image

from retrieval.data.colour import DEFAULT_BACKGROUND, flatten_alpha

WORKING_SIDE = 384  # the longer side each image is compared at (pixels)
SOURCE_SIDE = 512  # the longer side an image is kept at for its levels of detail
MAX_LEVEL = 2  # levels of detail below the image's own: a half and a quarter
FALLBACK_INLIERS = 12  # a comparison at a reduced level with fewer inliers is tried again at full detail
MAX_FEATURES = 800  # SIFT keypoints kept per image, strongest first: bounds matching time (800 x 800 per pair)
CONTRAST_THRESHOLD = 0.02  # SIFT's, below OpenCV's 0.04: flat product shots on white have few strong corners
RATIO = 0.8  # Lowe's ratio test: a match counts when clearly closer than the second best
RANSAC_PIXELS = 6.0  # reprojection error allowed, at WORKING_SIDE
MIN_SCALE, MAX_SCALE = 0.4, 2.5  # the content's scale between the two working images a copy may have
MAX_ROTATION = 30.0  # degrees: copies are turned slightly, not on their side
CHROMATIC = 12.0  # Lab chroma from which a pixel has a colour (below: grey, white, black)
GREY = 5.0  # Lab chroma below which a pixel has none
BACKGROUND_TOLERANCE = 12  # grey levels from the border's colour within which a pixel is background


@dataclass(frozen=True)
class Level:
    """SIFT keypoints (x, y at the working size) and descriptors of one image at one level of detail, and the
    working image itself (RGB uint8, H x W x 3) for the aligned comparison."""

    points: np.ndarray  # (n, 2) float32
    descriptors: np.ndarray  # (n, 128) float32
    rgb: np.ndarray  # (h, w, 3) uint8
    detail: int = WORKING_SIDE  # pixels along the longer side the level holds (the rest is interpolation)

    @property
    def size(self) -> tuple[int, int]:
        """(width, height) of the working image."""
        return int(self.rgb.shape[1]), int(self.rgb.shape[0])


class ImageFeatures:
    """One image prepared for comparison: its features at its own detail (level 0) and, made when a pair needs them,
    at half and a quarter of it (levels 1, 2: what a downscaled copy of it still shows), each at the working size."""

    def __init__(self, source: Image.Image, native_side: int) -> None:
        self.source = source  # RGB, its longer side at most SOURCE_SIDE
        self.native_side = native_side  # the image's own longer side, in pixels
        self._levels: dict[int, Level] = {}
        self._lock = threading.Lock()

    def level(self, number: int) -> Level:
        """The features at ``1 / 2 ** number`` of the image's detail (computed once)."""
        with self._lock:
            if number not in self._levels:
                self._levels[number] = _level(self.source, self.native_side, number)
            return self._levels[number]


@dataclass(frozen=True)
class PairComparison:
    """What ``compare_pair`` measured: ``matches`` passing the ratio test, ``inliers`` agreeing with the fitted
    transform (``scale``, ``rotation`` in degrees; None where none was fitted), ``overlap`` the share of the smaller
    image the aligned other covers, ``correlation`` of the aligned grey levels over the content (-1..1),
    ``colour_mismatch`` how far the colours of the aligned content differ (``colour_difference``: degrees of hue)."""

    matches: int
    inliers: int
    scale: float | None = None
    rotation: float | None = None
    overlap: float = 0.0
    correlation: float = -1.0
    colour_mismatch: float = 0.0
    coloured_pixels: int = 0
    shade: float = 0.0  # how far the colours' strength differs (``shade_difference``): a darker shade of one hue

    def to_dict(self) -> dict[str, float | int | None]:
        """The JSON form, rounded."""
        return {"matches": self.matches, "inliers": self.inliers,
                "scale": None if self.scale is None else round(self.scale, 3),
                "rotation": None if self.rotation is None else round(self.rotation, 1),
                "overlap": round(self.overlap, 3), "correlation": round(self.correlation, 3),
                "colour_mismatch": round(self.colour_mismatch, 3), "coloured_pixels": self.coloured_pixels,
                "shade": round(self.shade, 3)}


def _cv2():
    import cv2

    cv2.setNumThreads(1)  # pairs are spread over threads: OpenCV's own pool on top would oversubscribe the cores
    return cv2


def _resized(image: Image.Image, side: int) -> Image.Image:
    width, height = image.size
    scale = side / max(width, height, 1)
    size = (max(8, round(width * scale)), max(8, round(height * scale)))
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC if scale > 1 else Image.Resampling.LANCZOS)


def image_features(image: Image.Image, background: tuple[int, int, int] = DEFAULT_BACKGROUND) -> ImageFeatures:
    """``image`` (transparency put on ``background``) prepared for ``compare_pair``, its level 0 computed."""
    native_side = max(image.size)
    if native_side > SOURCE_SIDE:  # bounded before any full-size copy is made (a 40 MP photo stays 40 MP otherwise)
        image = image.copy()
        image.thumbnail((SOURCE_SIDE, SOURCE_SIDE), Image.Resampling.LANCZOS)
    rgb = flatten_alpha(image, background).convert("RGB")
    features = ImageFeatures(_resized(rgb, min(native_side, SOURCE_SIDE)), native_side)
    features.level(0)
    return features


def _level(source: Image.Image, native_side: int, number: int) -> Level:
    """SIFT keypoints and descriptors (at most ``MAX_FEATURES``, strongest first) of ``source`` reduced to
    ``native_side / 2 ** number`` pixels a side, then brought to the working size."""
    cv2 = _cv2()
    detail = max(8, round(native_side / 2 ** number))
    reduced = _resized(source, detail) if detail < max(source.size) else source
    rgb = np.asarray(_resized(reduced, WORKING_SIDE))
    grey = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    sift = cv2.SIFT_create(nfeatures=MAX_FEATURES, contrastThreshold=CONTRAST_THRESHOLD)
    keypoints, descriptors = sift.detectAndCompute(grey, None)
    held = min(detail, max(source.size))
    if descriptors is None or not keypoints:
        return Level(np.zeros((0, 2), np.float32), np.zeros((0, 128), np.float32), rgb, held)
    points = np.asarray([k.pt for k in keypoints], dtype=np.float32)
    return Level(points, descriptors.astype(np.float32, copy=False), rgb, held)


def detail_level(larger: int, smaller: int) -> int:
    """The level of the larger image that shows what the smaller one can: its longer sides' ratio in halvings
    (rounded down past a quarter: a 65 % crop stays at level 0), at most ``MAX_LEVEL``."""
    if smaller <= 0 or larger <= smaller:
        return 0
    return int(min(MAX_LEVEL, max(0, math.floor(math.log2(larger / smaller) + 0.25))))


def _ratio_matches(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into a, into b) of the matches passing Lowe's ratio test, one to one: where several points of ``a``
    match one point of ``b``, the closest keeps it (many points sent to one would fit a transform that collapses)."""
    if len(a) < 2 or len(b) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # squared distances through one matrix product: |a|^2 + |b|^2 - 2 a.b (SIFT descriptors: 128 floats)
    distances = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)
    np.maximum(distances, 0.0, out=distances)
    nearest = np.argpartition(distances, 1, axis=1)[:, :2]
    rows = np.arange(len(a))
    first, second = distances[rows, nearest[:, 0]], distances[rows, nearest[:, 1]]
    best = np.where(first <= second, nearest[:, 0], nearest[:, 1])
    low, high = np.minimum(first, second), np.maximum(first, second)
    keep = np.flatnonzero(low < (RATIO ** 2) * high)
    order = keep[np.argsort(low[keep], kind="stable")]  # closest first: np.unique keeps each b's first
    _, first_of_b = np.unique(best[order], return_index=True)
    kept = np.sort(order[first_of_b])
    return rows[kept], best[kept]


def compare_pair(a: ImageFeatures, b: ImageFeatures) -> PairComparison:
    """Whether ``b`` is a transformed copy of ``a`` or the other way: compared at the level of the larger image that
    matches the smaller one's detail (``detail_level``), and at level 0 too where that finds too few inliers; the
    comparison that aligns, then the one with more inliers."""
    first, second = (a, 0), (b, 0)
    if a.native_side >= b.native_side:
        first = (a, detail_level(a.native_side, b.native_side))
    else:
        second = (b, detail_level(b.native_side, a.native_side))
    best = compare_levels(first[0].level(first[1]), second[0].level(second[1]))
    if (first[1] or second[1]) and best.inliers < FALLBACK_INLIERS:
        plain = compare_levels(a.level(0), b.level(0))
        # a plausible alignment first (a transform within the bounds), then more inliers
        if (plain.scale is not None and plain.overlap > 0, plain.inliers) > \
                (best.scale is not None and best.overlap > 0, best.inliers):
            best = plain
    return best


def compare_levels(a: Level, b: Level) -> PairComparison:
    """Match ``a``'s features to ``b``'s, fit one similarity transform (RANSAC) and compare the aligned contents."""
    cv2 = _cv2()
    ia, ib = _ratio_matches(a.descriptors, b.descriptors)
    if len(ia) < 3:
        return PairComparison(int(len(ia)), 0)
    source, target = a.points[ia], b.points[ib]
    transform, inlier_mask = cv2.estimateAffinePartial2D(source, target, method=cv2.RANSAC,
                                                         ransacReprojThreshold=RANSAC_PIXELS, maxIters=2000,
                                                         confidence=0.995)
    if transform is None or inlier_mask is None:
        return PairComparison(int(len(ia)), 0)
    inliers = int(inlier_mask.sum())
    scale = float(math.hypot(transform[0, 0], transform[1, 0]))
    rotation = float(math.degrees(math.atan2(transform[1, 0], transform[0, 0])))
    if not MIN_SCALE <= scale <= MAX_SCALE or abs(rotation) > MAX_ROTATION:
        return PairComparison(int(len(ia)), inliers, scale, rotation)
    overlap, correlation, mismatch, coloured, shade = _aligned(a, b, transform, cv2)
    return PairComparison(int(len(ia)), inliers, scale, rotation, overlap, correlation, mismatch, coloured, shade)


def _aligned(a: Level, b: Level, transform: np.ndarray, cv2) -> tuple[float, float, float, int, float]:
    """``a`` warped onto ``b``: the share of the smaller image covered, the correlation of the grey levels and the
    colour and shade differences, over the content they share, both seen at the detail the poorer of the two
    holds."""
    width, height = b.size
    warped = cv2.warpAffine(a.rgb, transform, (width, height), flags=cv2.INTER_LINEAR,
                            borderMode=cv2.BORDER_CONSTANT, borderValue=(0, 0, 0))
    covered = cv2.warpAffine(np.full(a.rgb.shape[:2], 255, np.uint8), transform, (width, height),
                             flags=cv2.INTER_NEAREST, borderMode=cv2.BORDER_CONSTANT, borderValue=0)
    # erode: the warped border blends with the black outside
    covered = cv2.erode(covered, np.ones((5, 5), np.uint8))
    scale = float(math.hypot(transform[0, 0], transform[1, 0]))
    smaller = min(a.rgb.shape[0] * a.rgb.shape[1] * scale ** 2, width * height)
    overlap = float(min(1.0, int((covered > 0).sum()) / max(1.0, smaller)))
    # a downscaled copy drawn large is blurred: both are compared at the detail the poorer one holds, so that the
    # original's sharpness does not count against the copy
    # ``a`` is drawn ``scale`` times larger in ``b``'s frame: its detail there spans ``a.detail / scale`` pixels of
    # b's working size
    factor = min(a.detail / max(scale, 1e-6), b.detail) / WORKING_SIDE
    target = b.rgb
    if factor < 0.9:
        size = (max(8, round(width * factor)), max(8, round(height * factor)))
        warped = cv2.resize(warped, size, interpolation=cv2.INTER_AREA)
        target = cv2.resize(b.rgb, size, interpolation=cv2.INTER_AREA)
        covered = cv2.resize(covered, size, interpolation=cv2.INTER_NEAREST)
    covered = covered > 0
    if covered.sum() < 16:
        return overlap, -1.0, 0.0, 0, 0.0
    content = covered & (_off_background(warped, target) | _off_background(target, target))
    if content.sum() >= 16:  # a plain ground shared by two alike silhouettes would correlate by itself
        covered = content
    correlation = correlation_of(cv2.cvtColor(warped, cv2.COLOR_RGB2GRAY)[covered],
                                   cv2.cvtColor(target, cv2.COLOR_RGB2GRAY)[covered])
    mismatch, coloured = colour_difference(warped[covered], target[covered])
    return overlap, correlation, mismatch, coloured, shade_difference(warped[covered], target[covered])


def correlation_of(first: np.ndarray, second: np.ndarray) -> float:
    """Pearson's correlation of two aligned grey-level arrays: 1.0 where both are flat, 0.0 where only one is."""
    a, b = first.astype(np.float64), second.astype(np.float64)
    a -= a.mean()
    b -= b.mean()
    norm = math.sqrt(float((a * a).sum() * (b * b).sum()))
    if norm > 0:
        return float((a * b).sum() / norm)
    return 1.0 if not a.any() and not b.any() else 0.0


def _off_background(image: np.ndarray, framed: np.ndarray) -> np.ndarray:
    """Pixels of ``image`` farther than ``BACKGROUND_TOLERANCE`` from the median colour of ``framed``'s border."""
    border = np.concatenate([framed[0], framed[-1], framed[:, 0], framed[:, -1]]).astype(np.int16)
    ground = np.median(border, axis=0)
    return (np.abs(image.astype(np.int16) - ground) > BACKGROUND_TOLERANCE).any(axis=2)


def colour_difference(first: np.ndarray, second: np.ndarray) -> tuple[float, int]:
    """How far the colours of two aligned pixel sets ((n, 3) RGB uint8 each) differ, in degrees of hue: the mean
    hue difference of the pixels coloured in both, weighted by their lower chroma, with a pixel coloured in one and
    grey in the other counting 90 degrees; and how many pixels are coloured in either. Brightness and contrast move
    lightness, not hue: a brightened copy keeps its colours; a product in another colour does not."""
    cv2 = _cv2()
    if not len(first):
        return 0.0, 0
    lab_a = cv2.cvtColor(first.reshape(-1, 1, 3), cv2.COLOR_RGB2LAB).reshape(-1, 3).astype(np.float32) - [0, 128, 128]
    lab_b = cv2.cvtColor(second.reshape(-1, 1, 3), cv2.COLOR_RGB2LAB).reshape(-1, 3).astype(np.float32) - [0, 128, 128]
    chroma_a, chroma_b = np.hypot(lab_a[:, 1], lab_a[:, 2]), np.hypot(lab_b[:, 1], lab_b[:, 2])
    coloured = (chroma_a >= CHROMATIC) | (chroma_b >= CHROMATIC)
    count = int(coloured.sum())
    if not count:
        return 0.0, 0
    hue_a = np.degrees(np.arctan2(lab_a[coloured, 2], lab_a[coloured, 1]))
    hue_b = np.degrees(np.arctan2(lab_b[coloured, 2], lab_b[coloured, 1]))
    apart = np.abs((hue_a - hue_b + 180.0) % 360.0 - 180.0)
    one_grey = (chroma_a[coloured] < GREY) | (chroma_b[coloured] < GREY)
    # a hue read off a faint colour is noise: each pixel weighs by its lower chroma, a grey-against-colour one by
    # the colour's
    weight = np.where(one_grey, np.maximum(chroma_a[coloured], chroma_b[coloured]),
                      np.minimum(chroma_a[coloured], chroma_b[coloured]))
    difference = np.where(one_grey, 90.0, apart)
    return float((difference * weight).sum() / weight.sum()), count


def _chroma(pixels: np.ndarray) -> np.ndarray:
    lab = _cv2().cvtColor(pixels.reshape(-1, 1, 3), _cv2().COLOR_RGB2LAB).reshape(-1, 3).astype(np.float32)
    return np.hypot(lab[:, 1] - 128, lab[:, 2] - 128)


def shade_difference(first: np.ndarray, second: np.ndarray) -> float:
    """How far the strength of two aligned pixel sets' colours differs ((n, 3) RGB uint8 each): |log| of the ratio of
    their mean Lab chroma over the pixels coloured in both (0.0 where fewer than 16 are). Burgundy against red, navy
    against blue, brown against orange: one hue, far weaker or stronger; a brightened copy moves it less."""
    if not len(first):
        return 0.0
    chroma_a, chroma_b = _chroma(first), _chroma(second)
    both = (chroma_a >= CHROMATIC) & (chroma_b >= CHROMATIC)
    if both.sum() < 16:
        return 0.0
    return float(abs(math.log(float(chroma_a[both].mean()) / float(chroma_b[both].mean()))))
