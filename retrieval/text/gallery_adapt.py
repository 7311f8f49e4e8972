"""A zero-shot text tower adapted to a gallery with pseudo-captions, in the image space, with no torch.

A zero-shot tower (metadata ``text_origin`` "zero-shot", ``zero_shot_classes``: the classifier's class names in its
head's order) maps "a photo of a {class}" onto that class's head row. A gallery's images sit elsewhere in the space:
each image's pseudo-caption (its top classes by cosine against the tower's class prompts, "a photo of a c1, c2 or
c3") is embedded by the tower (t), and a linear map with a bias is fitted so that normalize(M t + c) lands on the
image vector v, ridge-regularised toward the identity, while the class prompts p keep their place (M p + c ~ p):

    minimise  (1 - a)/n sum_i ||M t_i + c - v_i||^2 + a/m sum_j ||M p_j + c - p_j||^2 + lam/d (||M - I||^2 + b ||c||^2)

(lam in units of 1/d, a unit vector's mean variance per dimension: lam = 1 weighs the identity like the data's
average direction) in closed form: normal equations in float64, accumulated in chunks (memory d^2 whatever the
gallery's size). The map is appended to the tower's graph (MatMul, Add, L2 normalisation with an epsilon), written
as a new text.onnx whose metadata says ``text_origin`` "adapted", ``adapted_from`` (the source's hash) and the fit's
parameters. It is delivered only when its held-out pseudo-caption Recall@10 is not worse than the source's.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.text.class_texts import PHOTO_TEMPLATES, templated
from retrieval.text.sibling_text import ADAPTED, TEXT_ORIGIN, ZERO_SHOT, ZERO_SHOT_CLASSES
from retrieval.text.text_onnx import TEXT_OUTPUT, TextEmbedder, TextModelError

ADAPTED_FROM, ADAPTATION = "adapted_from", "gallery_adaptation"  # an adapted tower's metadata: its source, the fit
MAX_CLASSES = 10_000
MAX_CLASS_CHARS = 200
MAX_CLASSES_JSON_CHARS = 2_000_000  # checked before parsing: 10,000 names of 200 characters
MAX_SAMPLE = 200_000  # gallery images a fit may read
MIN_IMAGES = 50  # a gallery smaller than this has too few held-out images to tell a better map from a worse
CHUNK = 8192  # images per step of the normal equations
RECALL_K = 10
NODE_PREFIX = "gallery_adapt/"


class GalleryAdaptError(ParameterError):
    """A text model or gallery the adaptation cannot use; the message names the problem and the fix."""

    def __init__(self, problem: str, param: str = "text_model") -> None:
        super().__init__(param, problem)


@dataclass(frozen=True)
class AdaptConfig:
    """The fit's parameters (recorded in the adapted tower's metadata)."""

    classes_per_caption: int = 3
    weighting: str = "equal"  # "equal": each image counts once; "confidence": by its top classes' share of the scores
    lam: float = 1.0  # ridge toward the identity, in units of 1/d (module docstring)
    anchor: float = 0.0  # the class prompts' share of the data weight (0 measured best: benchmarks/gallery_adapt.py)
    bias_ridge: float = 0.01  # the bias's ridge toward 0, relative to lam
    sample: int = 20_000  # gallery images read (seeded sample); a share of them is held out
    held_out: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"classes_per_caption": 1 <= self.classes_per_caption <= 10, "weighting": self.weighting in
                  ("equal", "confidence"), "lam": 0 < self.lam <= 1e6, "anchor": 0 <= self.anchor < 1,
                  "bias_ridge": 0 < self.bias_ridge <= 1e6, "sample": 2 <= self.sample <= MAX_SAMPLE,
                  "held_out": 0 < self.held_out < 1, "seed": self.seed >= 0}
        bad = [name for name, fine in checks.items() if not fine]
        if bad:
            raise ParameterError(bad[0], f"is out of range: {getattr(self, bad[0])!r}")


def zero_shot_classes(metadata: Mapping[str, str]) -> list[str] | None:
    """The class names a zero-shot tower's metadata lists (``ZERO_SHOT_CLASSES``), checked; None for a tower that is
    not zero-shot (``text_origin``); ``GalleryAdaptError`` naming what is wrong with a damaged list."""
    if metadata.get(TEXT_ORIGIN) != ZERO_SHOT:
        return None
    raw = metadata.get(ZERO_SHOT_CLASSES)
    fix = "export the zero-shot tower again with its image model (`retrieval export`)"
    if not isinstance(raw, str):
        raise GalleryAdaptError(f"says it is zero-shot but lists no {ZERO_SHOT_CLASSES}: {fix}")
    if len(raw) > MAX_CLASSES_JSON_CHARS:
        raise GalleryAdaptError(f"has a {ZERO_SHOT_CLASSES} record of {len(raw):,} characters, over the "
                                f"{MAX_CLASSES_JSON_CHARS:,} that {MAX_CLASSES:,} class names take: {fix}")
    try:
        classes = json.loads(raw)
    except (ValueError, RecursionError):
        raise GalleryAdaptError(f"has a {ZERO_SHOT_CLASSES} record that is not JSON: {fix}") from None
    if not isinstance(classes, list) or not all(isinstance(c, str) for c in classes):
        raise GalleryAdaptError(f"has a {ZERO_SHOT_CLASSES} record that is not a list of names: {fix}")
    if not 2 <= len(classes) <= MAX_CLASSES:
        raise GalleryAdaptError(f"lists {len(classes)} {ZERO_SHOT_CLASSES}; 2 to {MAX_CLASSES:,} are taken: {fix}")
    bad = next((c for c in classes if not c.strip() or len(c) > MAX_CLASS_CHARS), None)
    if bad is not None:
        raise GalleryAdaptError(f"lists a class name that is empty or over {MAX_CLASS_CHARS} characters "
                                f"({bad[:40]!r}...): {fix}")
    return classes


def tower_metadata(tower: TextEmbedder) -> dict[str, str]:
    """A loaded tower's metadata_props."""
    return dict(tower.session.get_modelmeta().custom_metadata_map)


def class_prompt(name: str) -> str:
    """A class's prompt: "a photo of a cat", "a photo of an apple"."""
    return templated(PHOTO_TEMPLATES, name)[0]  # the zero-shot tower's own "photo" prompt


def caption_text(names: Sequence[str]) -> str:
    """A pseudo-caption of classes, best first: "a photo of a c1", "... c1 or c2", "... c1, c2 or c3"."""
    return class_prompt(names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1])


def normalize(x: np.ndarray, eps: float = 1e-12) -> np.ndarray:
    """Rows scaled to unit length; a zero row stays zero."""
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def pseudo_captions(vectors: np.ndarray, prompts: np.ndarray, classes: Sequence[str], k: int,
                    chunk: int = CHUNK) -> tuple[list[str], np.ndarray]:
    """Each image's pseudo-caption (its ``k`` classes of highest cosine with the class ``prompts``, best first) and
    its confidence (the softmax mass, at CLIP's logit scale 100, of those classes)."""
    k = min(k, len(classes))
    captions, confidence = [], np.zeros(len(vectors))
    for start in range(0, len(vectors), chunk):
        scores = vectors[start:start + chunk].astype(np.float32) @ prompts.T.astype(np.float32)
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        top = np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, 1), axis=1), 1)
        logits = 100.0 * (scores - scores.max(1, keepdims=True))
        soft = np.exp(logits)
        confidence[start:start + chunk] = np.take_along_axis(soft, top, 1).sum(1) / soft.sum(1)
        captions += [caption_text([classes[j] for j in row]) for row in top.tolist()]
    return captions, confidence


@dataclass(frozen=True)
class Adaptation:
    """normalize(t @ matrix.T + bias): the map found by ``fit_adaptation``."""

    matrix: np.ndarray  # float64 [d, d]
    bias: np.ndarray  # float64 [d]

    def __call__(self, t: np.ndarray) -> np.ndarray:
        return normalize(np.asarray(t, np.float64) @ self.matrix.T + self.bias).astype(np.float32)


def fit_adaptation(texts: np.ndarray, images: np.ndarray, prompts: np.ndarray | None = None,
                   weights: np.ndarray | None = None, lam: float = 0.1, anchor: float = 0.2,
                   bias_ridge: float = 0.01, chunk: int = CHUNK) -> Adaptation:
    """The ridge map of text vectors onto image vectors (module docstring's objective): ``texts`` [n, d] each
    paired with ``images`` [n, d] (``weights``: per pair, default equal), ``prompts`` [m, d] kept in place with
    share ``anchor``; float64 normal equations accumulated ``chunk`` rows at a time. Finite for any finite input
    with lam > 0 (the system is positive definite); an empty one gives the identity."""
    n, d = images.shape
    if texts.shape != (n, d) or not (lam > 0 and bias_ridge > 0 and 0 <= anchor < 1):
        raise ValueError(f"texts {texts.shape} and images {images.shape} must match; lam, bias_ridge > 0, anchor "
                         "in [0, 1)")
    weights = np.ones(n) if weights is None else np.asarray(weights, np.float64)
    gram = np.zeros((d + 1, d + 1))  # sum w [t;1][t;1]^T
    cross = np.zeros((d + 1, d))  # sum w [t;1] v^T
    total = float(weights.sum())
    share = (1 - anchor) if prompts is not None and len(prompts) else 1.0
    if n and total > 0:
        for start in range(0, n, chunk):
            t = _augmented(texts[start:start + chunk])
            w = weights[start:start + chunk, None] * (share / total)
            gram += t.T @ (w * t)
            cross += t.T @ (w * images[start:start + chunk].astype(np.float64))
    if prompts is not None and len(prompts) and anchor > 0:
        p = _augmented(prompts)
        gram += anchor / len(p) * (p.T @ p)
        cross += anchor / len(p) * (p.T @ p[:, :d])
    ridge = np.full(d + 1, lam / max(d, 1))
    ridge[d] *= bias_ridge
    gram[np.diag_indices(d + 1)] += ridge
    cross[:d] += lam / max(d, 1) * np.eye(d)  # toward M = I, c = 0
    solution = np.linalg.solve(gram, cross)  # [d + 1, d] = [M^T; c]
    if not np.isfinite(solution).all():
        raise ValueError("the adaptation's fit is not finite: the inputs hold non-finite values")
    return Adaptation(np.ascontiguousarray(solution[:d].T), solution[d].copy())


def _augmented(x: np.ndarray) -> np.ndarray:
    return np.hstack([np.asarray(x, np.float64), np.ones((len(x), 1))])


def caption_recall(queries: np.ndarray, captions: Sequence[str], images: np.ndarray, k: int = RECALL_K) -> float:
    """Held-out pseudo-caption Recall@k: each distinct caption (its embedding: the row of ``queries`` [n, d] of an
    image that has it) searches ``images`` [n, d]; the share of its images (up to ``k`` of them) found in its top
    ``k``, averaged over the distinct captions."""
    if not len(images):
        return 0.0
    names, first, codes = np.unique(np.asarray(captions), return_index=True, return_inverse=True)
    codes, counts = codes.ravel(), np.bincount(codes.ravel(), minlength=len(names))
    k = min(k, len(images))
    found = []
    for start in range(0, len(names), 1024):
        rows = first[start:start + 1024]
        top = np.argpartition(-(queries[rows] @ images.T), k - 1, axis=1)[:, :k]
        hits = (codes[top] == codes[rows][:, None]).sum(1)
        found.append(hits / np.minimum(counts[codes[rows]], k))
    return float(np.concatenate(found).mean())


def fit_for_gallery(tower: TextEmbedder, vectors: np.ndarray, config: AdaptConfig,
                    classes: Sequence[str] | None = None,
                    embed: Callable[[list[str]], np.ndarray] | None = None) -> tuple[Adaptation, dict[str, Any]]:
    """The adaptation of zero-shot ``tower`` to gallery ``vectors`` [n, d] (L2-normalised; shuffled, seeded, into a
    fit part and a held-out part) and its report: held-out pseudo-caption Recall@10 of the source and adapted
    tower (``embed``: the tower's embedding of texts, default ``tower.embed``). ``GalleryAdaptError`` for a tower
    that is not zero-shot or a gallery under ``MIN_IMAGES``."""
    embed = embed or tower.embed
    classes = classes if classes is not None else zero_shot_classes(tower_metadata(tower))
    if classes is None:
        raise GalleryAdaptError(f"is not a zero-shot tower ({tower.path.name}'s metadata's {TEXT_ORIGIN} is not "
                                f"{ZERO_SHOT!r}): only one is adapted to a gallery", "text_model")
    vectors = np.asarray(vectors, np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != tower.dim or not np.isfinite(vectors).all():
        raise GalleryAdaptError(f"vectors {list(vectors.shape)} are not finite {tower.dim}-dimensional vectors of the "
                                "tower's space", "gallery")
    if len(vectors) < MIN_IMAGES:
        raise GalleryAdaptError(f"holds {len(vectors)} images, under the {MIN_IMAGES} an adaptation needs to be "
                                "checked on held-out images: the zero-shot tower is used as it is", "gallery")
    rng = np.random.default_rng(config.seed)
    order = rng.permutation(len(vectors))[:config.sample]
    held = max(int(round(len(order) * config.held_out)), MIN_IMAGES // 5)
    fit_rows, held_rows = np.sort(order[held:]), np.sort(order[:held])
    prompts = embed([class_prompt(c) for c in classes])
    captions, confidence = pseudo_captions(vectors[order], prompts, classes, config.classes_per_caption)
    by_row = dict(zip(order.tolist(), range(len(order)), strict=True))
    unique, inverse = np.unique(np.asarray(captions), return_inverse=True)
    caption_vectors = embed(unique.tolist())
    fit_at = np.asarray([by_row[r] for r in fit_rows.tolist()], np.int64)
    held_at = np.asarray([by_row[r] for r in held_rows.tolist()], np.int64)
    weights = confidence[fit_at] if config.weighting == "confidence" else None
    adaptation = fit_adaptation(caption_vectors[inverse[fit_at]], vectors[fit_rows], prompts, weights, config.lam,
                                config.anchor, config.bias_ridge)
    held_captions = [captions[i] for i in held_at.tolist()]
    source_queries = caption_vectors[inverse[held_at]]
    report = {"gallery_images": int(len(vectors)), "fit_images": int(len(fit_rows)),
              "held_out_images": int(len(held_rows)), "distinct_captions": int(len(unique)),
              "source_recall@10": caption_recall(source_queries, held_captions, vectors[held_rows]),
              "adapted_recall@10": caption_recall(adaptation(source_queries), held_captions, vectors[held_rows])}
    return adaptation, report


def write_adapted_tower(source: TextEmbedder, adaptation: Adaptation, out: str | os.PathLike,
                        record: Mapping[str, Any]) -> TextEmbedder:
    """``source``'s graph followed by the map (MatMul, Add, L2 normalisation whose epsilon keeps a zero vector
    zero) written to ``out`` (beside it first, renamed once it loads as a text tower), its metadata copied with
    ``text_origin`` "adapted", ``adapted_from`` and ``record`` (the fit's parameters and measures)."""
    import onnx
    from onnx import helper, numpy_helper

    out = Path(out)
    proto = onnx.load_from_string(source.path.read_bytes())
    graph, inner = proto.graph, NODE_PREFIX + "source_" + TEXT_OUTPUT
    taken = {name for node in graph.node for name in (*node.input, *node.output)} | \
        {t.name for t in graph.initializer}
    if any(name.startswith(NODE_PREFIX) for name in taken):
        raise GalleryAdaptError(f"{source.path.name} already holds an adaptation's nodes: adapt the zero-shot tower "
                                "it came from")
    for node in graph.node:
        node.output[:] = [inner if name == TEXT_OUTPUT else name for name in node.output]
        node.input[:] = [inner if name == TEXT_OUTPUT else name for name in node.input]
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 17)
    names = {key: NODE_PREFIX + key for key in ("matrix", "bias", "eps", "axes", "linear", "shifted", "norm", "safe")}
    graph.initializer.extend([
        numpy_helper.from_array(adaptation.matrix.T.astype(np.float32), names["matrix"]),
        numpy_helper.from_array(adaptation.bias.astype(np.float32), names["bias"]),
        numpy_helper.from_array(np.asarray(1e-12, np.float32), names["eps"])])
    if opset >= 18:  # ReduceL2 takes its axes as an input from opset 18
        graph.initializer.append(numpy_helper.from_array(np.asarray([1], np.int64), names["axes"]))
        reduce = helper.make_node("ReduceL2", [names["shifted"], names["axes"]], [names["norm"]], keepdims=1)
    else:
        reduce = helper.make_node("ReduceL2", [names["shifted"]], [names["norm"]], axes=[1], keepdims=1)
    graph.node.extend([
        helper.make_node("MatMul", [inner, names["matrix"]], [names["linear"]]),
        helper.make_node("Add", [names["linear"], names["bias"]], [names["shifted"]]),
        reduce,
        helper.make_node("Max", [names["norm"], names["eps"]], [names["safe"]]),
        helper.make_node("Div", [names["shifted"], names["safe"]], [TEXT_OUTPUT])])
    metadata = {p.key: p.value for p in proto.metadata_props} | {
        TEXT_ORIGIN: ADAPTED, ADAPTED_FROM: source.model_hash, ADAPTATION: json.dumps(dict(record), sort_keys=True)}
    del proto.metadata_props[:]
    helper.set_model_props(proto, metadata)
    onnx.checker.check_model(proto)
    out.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(proto.SerializeToString())
        written = TextEmbedder(scratch, providers=["CPUExecutionProvider"])  # its load checks, before it is named
        os.replace(scratch, out)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    written.path = out
    return written


def adapt_tower(source: TextEmbedder, vectors: np.ndarray, out: str | os.PathLike,
                config: AdaptConfig | None = None) -> dict[str, Any]:
    """Fit ``source`` (zero-shot) to gallery ``vectors`` and write the adapted tower to ``out`` when its held-out
    pseudo-caption Recall@10 is at least the source's; the report says which was kept (``adapted``) and why."""
    config = config or AdaptConfig()
    adaptation, report = fit_for_gallery(source, vectors, config)
    report = {"config": asdict(config), **report, "source_hash": source.model_hash}
    if report["adapted_recall@10"] < report["source_recall@10"]:
        return {**report, "adapted": False, "text_model": str(source.path),
                "reason": f"the adapted tower's held-out pseudo-caption Recall@10 "
                          f"({report['adapted_recall@10']:.3f}) is below the zero-shot tower's "
                          f"({report['source_recall@10']:.3f}): the zero-shot tower is kept"}
    written = write_adapted_tower(source, adaptation, out, report)
    return {**report, "adapted": True, "text_model": str(written.path), "adapted_hash": written.model_hash,
            "reason": f"held-out pseudo-caption Recall@10 {report['source_recall@10']:.3f} -> "
                      f"{report['adapted_recall@10']:.3f}"}


def is_zero_shot(tower: TextEmbedder) -> bool:
    """Whether ``tower`` is a zero-shot tower (its class list is checked: a damaged one is refused)."""
    return zero_shot_classes(tower_metadata(tower)) is not None


__all__ = ["AdaptConfig", "Adaptation", "GalleryAdaptError", "TextModelError", "adapt_tower", "caption_recall",
           "fit_adaptation", "fit_for_gallery", "is_zero_shot", "pseudo_captions", "write_adapted_tower",
           "zero_shot_classes"]
