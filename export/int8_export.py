"""Static int8 quantization of an exported image embedder (``retrieval export --int8``): calibrated on a seeded sample
of the user's own images, verified against its fp32 parent on other images of the same source, and refused, with the
numbers, where it loses more than the bounds below.

What keeps the recall (measured, docs/BENCHMARKS.md "CPU throughput"): weights in int8 per output channel (per tensor,
the depthwise convolutions of EfficientNet and MobileNet lose their small channels: median cosine to fp32 0.70), uint8
activations with a zero point of their own (symmetric int8 activations kept the recall but ran slower than fp32),
ranges read as the calibration's minimum and maximum (percentile and entropy calibration were within noise of it and
10x slower to calibrate), every operator onnxruntime quantizes (a convolution quantized alone, its ReLU6 not folded
into its range, lost 0.06 MAP@R), in the QDQ format (onnxruntime fuses it into the same integer kernels as QOperator,
and other runtimes read it); the pooling and the L2 normalisation stay in fp32, as onnxruntime leaves them.

Its memory is planned whole before an image is read (``plan_memory``): batches and verification images are lowered
to fit ``INT8_MEMORY_BYTES``, or the export is refused with the numbers.

This module imports no torch: an existing fp32 export is quantized on the base install.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import INT8_KEY, cross_neighbour_overlap, label_metrics, neighbour_overlap
from retrieval.compatibility import INT8_NEIGHBOURS as NEIGHBOURS
from retrieval.data.decode import DEFAULT_MAX_PIXELS
from retrieval.data.decode_budget import DECODE_BUDGET_BYTES
from retrieval.errors import ParameterError
from retrieval.index.embedding.decode import AHEAD, GalleryDecodeDataset, thread_batches
from retrieval.index.query_embedder import COMPATIBLE_WITH, PARENT_MODEL_KEY, declared_compatible, model_hashes
from retrieval.index.sources import GalleryItem, list_gallery, printable_path
from retrieval.onnx_runtime import INPUT_NAME, OnnxEmbedder
from retrieval.utils.io import atomic_write
from retrieval.utils.progress import progress_bar
from retrieval.utils.sizes import size_text

logger = logging.getLogger(__name__)
Log = Callable[[str], None]

CALIBRATION_IMAGES = 256  # a seeded sample of the source: 64 images measured within noise of 256
MIN_CALIBRATION_IMAGES = 16
VERIFY_IMAGES = 256  # images of the source outside the calibration sample the int8 model is verified on
MIN_HELD_OUT = 32  # fewer left over: the calibration images verify it, and the record says so
CALIBRATION_BATCH = 8
READ_BATCH = 32  # images decoded together while the previous ones are copied in
# What an export plans to hold at once (``plan_memory``): the calibration and verification images preprocessed, the
# batches in flight and the models. Beyond it the batch, then the verification images are lowered, then it refuses.
INT8_MEMORY_BYTES = 4 * 2**30
# A model run's memory per image of its batch, in preprocessed images (3 x S x S float32), EfficientNet-Lite0
# measured at 224 and 512 px: ~11 for an embedding; 150-180 for the quantizer's calibration run, whose session holds
# every activation at once. With a margin for models of wider activations.
ACTIVATION_IMAGES = 24
CALIBRATION_RUN_IMAGES = 256
DECODED_IMAGES = AHEAD + 2  # per image of a batch: the batches decoded ahead, the one embedded and its copy
# the model's copies held at once: the parent's session, the pre-processed graph, the quantizer's two, its
# calibration session and the int8 session
MODEL_COPIES = 6
# the bounds an int8 model must meet against its parent on the verification images (docs/INDEX.md "int8"); the
# recipe below measured median cosine 0.99, 1st percentile 0.96-0.98 and 0.89-0.92 of 10 neighbours kept on product
# photos
MIN_MEDIAN_COSINE = 0.98
MIN_LOW_COSINE = 0.90  # the 1st percentile of the images' cosines: a few images may move, not many
MIN_NEIGHBOURS_KEPT = 0.75  # the mean share of an image's 10 nearest under fp32 it keeps, alone and across models


@dataclass(frozen=True)
class Int8Recipe:
    """How ``quantize_static`` is asked to quantize (the defaults are what the module's docstring found)."""

    quant_format: str = "QDQ"  # or QOperator
    per_channel: bool = True
    calibration: str = "MinMax"  # or Percentile, Entropy
    symmetric_activations: bool = False
    op_types: tuple[str, ...] | None = None  # None: every operator onnxruntime quantizes
    pre_process: bool = True  # onnxruntime's shape inference and graph optimisation first, as its guide advises

    def describe(self) -> str:
        """The recipe in one line."""
        ops = ", ".join(self.op_types) if self.op_types else "every quantizable operator"
        return (f"{self.quant_format}, weights int8 per {'channel' if self.per_channel else 'tensor'}, activations "
                f"{'int8 symmetric' if self.symmetric_activations else 'uint8 asymmetric'}, {self.calibration} "
                f"ranges, {ops}")


DEFAULT_RECIPE = Int8Recipe()


class Int8Refused(ValueError):  # noqa: N818  (a refusal, said as one)
    """The int8 model loses more than the bounds allow; ``verification`` has the numbers, nothing was written."""

    def __init__(self, message: str, verification: Int8Verification) -> None:
        super().__init__(message)
        self.verification = verification


# ---------------------------------------------------------------- the images

@dataclass
class ImageSample:
    """Preprocessed images of the source, as the model sees them."""

    paths: list[str]
    labels: list[str | None]
    arrays: np.ndarray  # float32 [n, 3, S, S]
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)


def sample_items(source: str | Path, count: int, seed: int, verify_count: int = VERIFY_IMAGES
                 ) -> tuple[list[GalleryItem], list[GalleryItem], int]:
    """A seeded sample of ``count`` images of a folder or manifest for calibration and up to ``verify_count`` others
    for verification (none when too few are left: the caller verifies on the calibration images); and the total."""
    if count < MIN_CALIBRATION_IMAGES:
        raise ParameterError("calibration_images", f"must be at least {MIN_CALIBRATION_IMAGES}, got {count}")
    gallery = list_gallery(source)
    items = sorted(gallery.items, key=lambda item: item.path)
    if len(items) < MIN_CALIBRATION_IMAGES:
        raise ParameterError("calibration", f"{printable_path(gallery.source)} holds {len(items)} image(s); int8 "
                                            f"calibration needs at least {MIN_CALIBRATION_IMAGES} of your own images "
                                            f"(a few hundred are best)")
    order = np.random.default_rng(seed).permutation(len(items))
    chosen = [items[i] for i in order[:count]]
    rest = [items[i] for i in order[count:count + verify_count]]
    return chosen, (rest if len(rest) >= MIN_HELD_OUT else []), len(items)


def read_images(items: Sequence[GalleryItem], embedder: OnnxEmbedder, max_pixels: int = DEFAULT_MAX_PIXELS,
                workers: int = 2, desc: str = "read", batch: int = READ_BATCH) -> ImageSample:
    """Decode and preprocess ``items`` as ``embedder`` needs them, as the index build does (``thread_batches``); a
    file that cannot be read is listed with its reason, never fatal."""
    size = embedder.input_size
    arrays = np.empty((len(items), 3, size, size), np.float32)  # the images held once, readable ones first
    sample = ImageSample([], [], arrays[:0])
    dataset = GalleryDecodeDataset(list(enumerate(item.path for item in items)), embedder.preprocessing, max_pixels)
    with progress_bar(total=len(items), desc=desc, unit="img") as bar:
        for decoded in thread_batches(dataset, batch, workers):
            if decoded.ok_index:
                arrays[len(sample.paths):len(sample.paths) + len(decoded.ok_index)] = decoded.array()
            for record in decoded.records:
                item = items[record.id]
                if record.error is not None:
                    sample.unreadable.append((item.path, record.error))
                    continue
                sample.paths.append(item.path)
                sample.labels.append(item.label)
            bar.update(len(decoded.records))
    sample.arrays = arrays[:len(sample.paths)]
    return sample


# ---------------------------------------------------------------- quantization

class BatchReader:
    """onnxruntime's calibration reader over a preprocessed array (``CalibrationDataReader``'s protocol)."""

    def __init__(self, arrays: np.ndarray, batch_size: int = CALIBRATION_BATCH) -> None:
        # equal batches: the percentile and entropy calibrators stack them (the remainder is left out)
        whole = max(1, len(arrays) // batch_size) * batch_size
        self.batches = iter([arrays[start:start + batch_size] for start in range(0, min(whole, len(arrays)),
                                                                                      batch_size)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        return None if batch is None else {INPUT_NAME: batch}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = self.get_next()
        if batch is None:
            raise StopIteration
        return batch


def quantize_model(fp32_path: str | Path, out: str | Path, calibration: np.ndarray,
                   recipe: Int8Recipe = DEFAULT_RECIPE, batch: int = CALIBRATION_BATCH) -> None:
    """Write ``out``: ``fp32_path`` statically quantized to int8 with activation ranges from ``calibration``
    [n, 3, S, S] (the file's metadata is the parent's; ``export_int8`` writes the int8 record)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    with tempfile.TemporaryDirectory() as tmp, _quiet_quantizer():
        prepared = Path(tmp) / "prepared.onnx" if recipe.pre_process else Path(fp32_path)
        if recipe.pre_process:  # shapes inferred and the graph optimised first: fused ops quantize as one
            quant_pre_process(str(fp32_path), str(prepared), skip_symbolic_shape=True)
        quantize_static(
            str(prepared), str(out), BatchReader(calibration, batch),
            quant_format=getattr(QuantFormat, recipe.quant_format), per_channel=recipe.per_channel,
            activation_type=QuantType.QInt8 if recipe.symmetric_activations else QuantType.QUInt8,
            weight_type=QuantType.QInt8, calibrate_method=getattr(CalibrationMethod, recipe.calibration),
            op_types_to_quantize=list(recipe.op_types) if recipe.op_types else None,
            extra_options={"ActivationSymmetric": recipe.symmetric_activations},
        )


class _QuantizerNotices(logging.Filter):
    """onnxruntime's quantizer logs on the root logger, a line per tensor it leaves alone (shapes, integer
    constants): notices for its developers, not for ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING


@contextlib.contextmanager
def _quiet_quantizer():
    root, notices = logging.getLogger(), _QuantizerNotices()
    root.addFilter(notices)
    try:
        yield
    finally:
        root.removeFilter(notices)


# ---------------------------------------------------------------- verification

@dataclass
class Int8Verification:
    """The int8 model against its parent on the same images."""

    images: int
    held_out: bool  # verified on images outside the calibration sample
    cosine: dict[str, float]  # per image, int8 vs fp32: min, p01, median, mean
    neighbours_kept: float  # mean share of an image's NEIGHBOURS nearest under fp32 that int8 keeps
    int8_queries_in_fp32: float  # the same, for an int8 query in the gallery fp32 embedded
    fp32_queries_in_int8: float  # and for an fp32 query in the gallery int8 embedded
    labels: dict[str, dict[str, float]] | None = None  # with labels: fp32, int8, cross-model Recall@1 and MAP@R
    failures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def describe(self) -> str:
        """The numbers in one sentence."""
        on = f"{self.images} {'held-out' if self.held_out else 'calibration'} images"
        text = (f"on {on}: cosine to fp32 median {self.cosine['median']:.4f}, 1st percentile {self.cosine['p01']:.4f} "
                f"(min {self.cosine['min']:.4f}); {NEIGHBOURS} nearest neighbours kept {self.neighbours_kept:.2f}, "
                f"int8 queries in an fp32 gallery {self.int8_queries_in_fp32:.2f}, fp32 queries in an int8 gallery "
                f"{self.fp32_queries_in_int8:.2f}")
        if self.labels:
            text += "; with the folders' labels " + ", ".join(
                f"{name} Recall@1 {row['recall@1']:.3f} MAP@R {row['map@r']:.3f}" for name, row in self.labels.items())
        return text


def _unit(rows: np.ndarray) -> np.ndarray:
    rows = rows.astype(np.float64)
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)


def verify_int8(fp32: np.ndarray, int8: np.ndarray, held_out: bool, labels: Sequence[str | None] | None = None
                ) -> Int8Verification:
    """Compare the embeddings [n, d] of the same images by the parent (``fp32``) and the int8 model against the
    bounds; ``labels`` (None where unknown) add Recall@1 and MAP@R of each model and across them."""
    if len(fp32) != len(int8) or len(fp32) <= NEIGHBOURS:
        raise ParameterError("images", f"int8 verification needs more than {NEIGHBOURS} readable images, got "
                                       f"{min(len(fp32), len(int8))}")
    old, new = _unit(fp32), _unit(int8)
    cosine = (old * new).sum(axis=1)
    cosines = {"min": float(cosine.min()), "p01": float(np.quantile(cosine, 0.01)),
               "median": float(np.median(cosine)), "mean": float(cosine.mean())}
    result = Int8Verification(
        len(old), held_out, cosines, float(neighbour_overlap(old, new, NEIGHBOURS).mean()),
        float(cross_neighbour_overlap(old, new, NEIGHBOURS).mean()),
        float(cross_neighbour_overlap(new, old, NEIGHBOURS).mean()))
    if labels is not None:
        rows = {"fp32": label_metrics(old, old, labels), "int8": label_metrics(new, new, labels),
                "int8 queries, fp32 gallery": label_metrics(new, old, labels)}
        result.labels = rows if all(row is not None for row in rows.values()) else None
    if cosines["median"] < MIN_MEDIAN_COSINE:
        result.failures.append(f"median cosine to fp32 {cosines['median']:.4f} < {MIN_MEDIAN_COSINE}")
    if cosines["p01"] < MIN_LOW_COSINE:
        result.failures.append(f"1st percentile cosine {cosines['p01']:.4f} < {MIN_LOW_COSINE}")
    for name, kept in (("neighbours kept", result.neighbours_kept),
                       ("int8 queries' neighbours in an fp32 gallery", result.int8_queries_in_fp32),
                       ("fp32 queries' neighbours in an int8 gallery", result.fp32_queries_in_int8)):
        if kept < MIN_NEIGHBOURS_KEPT:
            result.failures.append(f"{name} {kept:.2f} < {MIN_NEIGHBOURS_KEPT}")
    return result


# ---------------------------------------------------------------- memory

@dataclass(frozen=True)
class MemoryPlan:
    """What an int8 export holds at once: its ``calibration_images`` preprocessed at ``input_size`` px throughout,
    the model's copies and the decodes; then the larger of the quantizer's calibration run (``calibration_batch``
    images) and the verification (``verify_images`` held-out images, run ``batch`` at a time)."""

    input_size: int
    calibration_images: int
    verify_images: int
    batch: int
    calibration_batch: int
    model_bytes: int
    budget: int = INT8_MEMORY_BYTES
    every_batch: bool = False  # the calibration run holds every batch's activations (percentile, entropy)
    lowered: tuple[str, ...] = ()  # what was lowered to fit, as people read it

    @property
    def image_bytes(self) -> int:
        """One preprocessed image."""
        return 3 * self.input_size**2 * 4

    def parts(self) -> dict[str, int]:
        """The bytes each part takes."""
        image = self.image_bytes
        return {"calibration images": self.calibration_images * image, "decoding": DECODE_BUDGET_BYTES,
                "models": MODEL_COPIES * self.model_bytes,
                "calibration run": (self.calibration_images if self.every_batch else self.calibration_batch)
                * image * CALIBRATION_RUN_IMAGES,
                "verification images": self.verify_images * image,
                "batches": self.batch * image * (ACTIVATION_IMAGES + DECODED_IMAGES)}

    @property
    def total(self) -> int:
        """The bytes it holds at once, at the most."""
        parts = self.parts()
        return (parts["calibration images"] + parts["decoding"] + parts["models"]
                + max(parts["calibration run"], parts["verification images"] + parts["batches"]))

    def describe(self) -> str:
        """Its parts and total in one line."""
        shown = {name: size_text(size) for name, size in self.parts().items()}
        run = "every batch held" if self.every_batch else f"{self.calibration_batch} a batch"
        return (f"calibration images {shown['calibration images']} + decoding {shown['decoding']} + models "
                f"{shown['models']} + the larger of the calibration run ({shown['calibration run']}, {run}) and "
                f"the verification ({shown['verification images']} of images "
                f"+ {shown['batches']} of batches of {self.batch}) = {size_text(self.total)}")

    def record(self) -> dict[str, Any]:
        """What the int8 record keeps of it."""
        return {"planned_bytes": self.total, "budget_bytes": self.budget, "batch": self.batch,
                "calibration_batch": self.calibration_batch, "verify_images": self.verify_images,
                "lowered": list(self.lowered)}


def plan_memory(input_size: int, model_bytes: int, calibration_images: int, budget: int | None = None,
                every_batch: bool = False) -> MemoryPlan:
    """The most an export of ``calibration_images`` at ``input_size`` px holds within ``budget`` (None:
    ``INT8_MEMORY_BYTES``; ``every_batch``: the calibration method keeps every batch's activations): the calibration
    batch and the verification's batch halved to fit, then its images lowered (to ``MIN_HELD_OUT`` at least);
    ParameterError with the numbers and the fix where even that is over, before anything is read."""
    budget = INT8_MEMORY_BYTES if budget is None else budget
    plan = MemoryPlan(input_size, calibration_images, VERIFY_IMAGES, READ_BATCH, CALIBRATION_BATCH, model_bytes,
                      budget, every_batch)
    parts = plan.parts()
    room = budget - parts["calibration images"] - parts["decoding"] - parts["models"]  # for a run or a verification
    while plan.calibration_batch > 1 and plan.parts()["calibration run"] > room:
        plan = replace(plan, calibration_batch=plan.calibration_batch // 2)
    while plan.batch > 1 and plan.parts()["verification images"] + plan.parts()["batches"] > room:
        plan = replace(plan, batch=plan.batch // 2)
    most_verified = (room - plan.parts()["batches"]) // plan.image_bytes
    if MIN_HELD_OUT <= most_verified < VERIFY_IMAGES:
        plan = replace(plan, verify_images=most_verified)
    lowered = tuple(f"{name} {first} -> {now}" for name, first, now in (
        ("calibration batch", CALIBRATION_BATCH, plan.calibration_batch), ("batch", READ_BATCH, plan.batch),
        ("verification images", VERIFY_IMAGES, plan.verify_images)) if now < first)
    if plan.total > budget:
        least = replace(plan, verify_images=MIN_HELD_OUT, batch=1, calibration_batch=1)
        most = (budget - replace(least, calibration_images=0).total) // (
            plan.image_bytes * (1 + (CALIBRATION_RUN_IMAGES if every_batch else 0)))
        fix = (f"give at most {most} (a few hundred are enough)" if most >= MIN_CALIBRATION_IMAGES else
               f"even {MIN_CALIBRATION_IMAGES} images do not fit: quantize a model exported at a smaller --image-size")
        if every_batch:
            fix += "; or calibrate by MinMax, which holds one batch at a time"
        raise ParameterError("calibration_images", f"{calibration_images} images at {input_size} px would hold "
                                                   f"{size_text(least.total)} at once, one image a batch and "
                                                   f"{MIN_HELD_OUT} verification images ({least.describe()}), more "
                                                   f"than the {size_text(budget)} an int8 export plans for; {fix}")
    return replace(plan, lowered=lowered)


# ---------------------------------------------------------------- the export

@dataclass
class Int8Result:
    path: Path
    parent: Path
    metadata: dict[str, str]
    verification: Int8Verification
    calibration_images: int
    unreadable: int
    seconds: float

    @property
    def model_hash(self) -> str:
        return self.metadata["model_hash"]


def export_int8(fp32_path: str | Path, out: str | Path, calibration: str | Path,
                images: int = CALIBRATION_IMAGES, seed: int = 0, recipe: Int8Recipe = DEFAULT_RECIPE,
                max_pixels: int = DEFAULT_MAX_PIXELS, workers: int = 2, log: Log | None = None) -> Int8Result:
    """Quantize the fp32 export ``fp32_path`` to int8 at ``out``, calibrated on a seeded sample of ``images`` of
    ``calibration`` (a folder or manifest of the user's own images) and verified against it on up to
    ``VERIFY_IMAGES`` others; raises ``Int8Refused`` (nothing written) where it misses a bound.

    The int8 model's metadata is its parent's, with precision int8, its own model_hash, the parent's hash
    (``PARENT_MODEL_KEY``), the recipe, calibration set and verification (``INT8_KEY``), and, as measured, the parent
    among the models it is compatible with: an index the parent built is searched with it, and one it built is
    searched with the parent (the index records the parent's hash)."""
    log = log or logger.info
    started = time.perf_counter()
    fp32_path, out = Path(fp32_path), Path(out)
    if fp32_path.resolve() == out.resolve():
        raise ParameterError("out", f"is the fp32 model {fp32_path}; write the int8 model to another file")
    parent = OnnxEmbedder(fp32_path, providers="cpu")
    if parent.precision != "fp32":
        raise ParameterError("model", f"{fp32_path} is {parent.precision}; int8 is quantized from an fp32 export")
    plan = plan_memory(parent.input_size, fp32_path.stat().st_size, images,
                       every_batch=recipe.calibration != "MinMax")
    if plan.lowered:
        log(f"int8: {', '.join(plan.lowered)} to hold {size_text(plan.total)} at {parent.input_size} px, within "
            f"{size_text(plan.budget)}")
    parent.batch_size = plan.batch
    chosen, held_out, total = sample_items(calibration, images, seed, plan.verify_images)
    log(f"int8: calibrating on {len(chosen)} of the {total} images of {printable_path(calibration)} (seed {seed}), "
        f"verifying on {len(held_out) or 'the same'} {'others' if held_out else 'images'} ...")
    calib = read_images(chosen, parent, max_pixels, workers, "calibration", plan.batch)
    if len(calib.paths) < MIN_CALIBRATION_IMAGES:
        raise ParameterError("calibration", f"only {len(calib.paths)} of the {len(chosen)} sampled images could be "
                                            f"read (first: {calib.unreadable[0][1] if calib.unreadable else '-'}); "
                                            f"give at least {MIN_CALIBRATION_IMAGES} readable images")
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp) / "int8.onnx"
        quantize_model(fp32_path, draft, calib.arrays, recipe, plan.calibration_batch)
        # read after the calibration run: the plan never holds its activations and these images together
        check = read_images(held_out, parent, max_pixels, workers, "verification", plan.batch) if held_out else calib
        if held_out and len(check.paths) < MIN_HELD_OUT:
            check, held_out = calib, []
        if not held_out:  # the calibration images verify it: at most as many as a held-out set
            check = ImageSample(check.paths[:VERIFY_IMAGES], check.labels[:VERIFY_IMAGES],
                                check.arrays[:VERIFY_IMAGES])
        model = OnnxEmbedder(draft, providers="cpu", batch_size=plan.batch)
        labels = check.labels if any(label is not None for label in check.labels) else None
        verification = verify_int8(parent.embed_batch(check.arrays), model.embed_batch(check.arrays),
                                   bool(held_out), labels)
        if not verification.passed:
            raise Int8Refused(
                f"the int8 model would lose more than the bounds allow against {fp32_path.name} "
                f"({'; '.join(verification.failures)}): {verification.describe()}. Nothing was written: serve the fp32 "
                f"model {fp32_path}, or calibrate on more of your own images (--calibration-images) that look like "
                f"the gallery", verification)
        metadata = _int8_metadata(parent, model, recipe, verification, {
            "source": printable_path(calibration), "images": len(calib.paths), "sampled": len(chosen),
            "seed": int(seed), "of": total, "unreadable": len(calib.unreadable),
            "paths_sha256": _paths_digest(calib.paths), "memory": plan.record()})
        import onnx

        proto = onnx.load(str(draft))
        del proto.metadata_props[:]
        onnx.helper.set_model_props(proto, metadata)
        atomic_write(out, proto.SerializeToString())
    seconds = time.perf_counter() - started
    log(f"quantized and verified in {seconds:.0f} s ({recipe.describe()}): {verification.describe()}")
    return Int8Result(out, fp32_path, metadata, verification, len(calib.paths), len(calib.unreadable), seconds)


def _paths_digest(paths: Sequence[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(sorted(paths)).encode()).hexdigest()[:16]


def _int8_metadata(parent: OnnxEmbedder, model: OnnxEmbedder, recipe: Int8Recipe, verification: Int8Verification,
                   calibration: dict[str, Any]) -> dict[str, str]:
    """The parent's metadata made the int8 model's (see ``export_int8``)."""
    metadata = parent.metadata
    metadata["precision"] = "int8"
    metadata["model_hash"] = model.model_hash  # its own graph and weights (the metadata is never hashed)
    metadata[PARENT_MODEL_KEY] = parent.model_hash
    # by every hash an index may record the parent under (one built before model hashes were computed as now)
    metadata[COMPATIBLE_WITH] = json.dumps(sorted(declared_compatible(parent) | set(model_hashes(parent))))
    metadata[INT8_KEY] = json.dumps({
        "fp32_model_hash": parent.model_hash, "recipe": asdict(recipe), "calibration": calibration,
        "verification": asdict(verification),
        "bounds": {"median_cosine": MIN_MEDIAN_COSINE, "p01_cosine": MIN_LOW_COSINE,
                   "neighbours_kept": MIN_NEIGHBOURS_KEPT}}, sort_keys=True)
    return metadata
