"""What ``retrieval index upgrade`` checks before a new model's upgrade begins, and what it does to a recorded text
model, so that an upgrade never makes search or text search worse without saying so.

* A model declared compatible whose training measured it not compatible (its ONNX metadata's verdict,
  ``compatibility.recorded_compatibility``) is refused before anything is embedded: a mixed upgrade serves its
  queries against the old vectors until the last one is replaced.
* On the index's own labels (``curation.compare.measure_on_labels``: a bounded, seeded sample), a model that searches
  worse beyond noise than the stored vectors (or, mixed, whose queries find the stored vectors worse) is refused.
* ``force`` goes past both; what it went past is logged, returned and kept in index.json (``check_record``).
* A text model maps text into one image model's space: where the new vectors leave that space, ``text_off`` moves its
  record aside (``TEXT_MODEL_OFF``), so that a text query is told why and how to re-fit one instead of being
  answered worse.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrieval.compatibility import (
    COMPATIBILITY_METRICS,
    MIN_DROP,
    NOT_COMPATIBLE,
    compatibility_sentence,
    recorded_compatibility,
)
from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue
from retrieval.index.curation.compare import measure_on_labels
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.shards import ShardStore
from retrieval.index.sources import printable_path
from retrieval.index.writing.upgrade_text import index_root_of, measure_text_on_captions, text_sentence
from retrieval.records.index_info import IndexInfo
from retrieval.text.text_index import (
    TEXT_FIELDS,
    TEXT_MODEL_OFF,
    has_text_model,
    open_text_model,
    text_off_problem,
)
from retrieval.text.text_onnx import TextModelError
from retrieval.utils.workers import default_decode_threads

log = logging.getLogger(__name__)


class UpgradeRefused(ParameterError):
    """An upgrade that would make search worse, refused before it begins (``force`` goes on)."""

    def __init__(self, problem: str) -> None:
        super().__init__("model", problem)


def check_upgrade(catalogue: Catalogue, store: ShardStore, info: IndexInfo, embedder: ImageEmbedder, mode: str,
                  force: bool, options: IngestOptions) -> dict[str, Any]:
    """What an upgrade checks before it begins: for a mixed one the verdict its training recorded (not compatible:
    refused before anything is embedded), then, on the index's own labels, the stored vectors against the new
    model's (and, mixed, its queries against the stored vectors: ``measure_on_labels``), refused where the new is
    worse beyond noise. ``force``: each refusal is logged and recorded instead (``forced``)."""
    refusals = []
    verdict = recorded_compatibility(getattr(embedder, "metadata", None)) if mode == "mixed" else None
    if verdict is not None and verdict["verdict"] == NOT_COMPATIBLE:
        said = compatibility_sentence(verdict)
        refusals.append(f"its training measured it not compatible with the index's model ({said}), and a compatible "
                        "upgrade serves its queries against the old vectors until every image is re-embedded")
        if not force:  # nothing to embed before saying no
            raise UpgradeRefused(refusal(refusals))
    workers = default_decode_threads() if options.workers is None else options.workers
    labels = measure_on_labels(catalogue, store, embedder, cross=mode == "mixed", batch_size=options.batch_size,
                               workers=workers, max_pixels=options.max_pixels)
    log.debug("on the index's labels: %s", labels_sentence(labels))  # the summary carries it (on_labels)
    if labels["worse"]:
        refusals.append(f"it searches worse than the index's vectors do on the index's own labels "
                        f"({labels_sentence(labels)})")
    on_text = _measure_text(catalogue, store, info, embedder, options, workers) \
        if mode == "mixed" and has_text_model(info) else None
    if refusals and not force:
        raise UpgradeRefused(refusal(refusals))
    for reason in refusals:
        log.warning("upgrading anyway (force): %s", reason)
    return {"mode": mode, "verdict": None if verdict is None else verdict["verdict"], "on_labels": labels,
            "forced": refusals, **({"on_text": on_text} if on_text is not None else {}),
            "refuted": verdict is not None and verdict["verdict"] == NOT_COMPATIBLE}


def _measure_text(catalogue: Catalogue, store: ShardStore, info: IndexInfo, embedder: ImageEmbedder,
                  options: IngestOptions, workers: int) -> dict[str, Any]:
    """The recorded text model on the index's captions, with the stored vectors and the new model's
    (``upgrade_text``); a text model that cannot be opened is not measured, and says why."""
    try:
        text = open_text_model(info, index_root_of(catalogue))
    except (TextModelError, ParameterError, OSError) as exc:
        return {"measured": False, "worse": False, "reason": f"its text model could not be opened: {exc}"}
    measured = measure_text_on_captions(catalogue, store, info, embedder, text, batch_size=options.batch_size,
                                        workers=workers, max_pixels=options.max_pixels)
    log.debug("%s", text_sentence(measured))
    return measured


def refusal(reasons: list[str]) -> str:
    """The refusal's words: each reason, that nothing changed, and the way past it."""
    return (f"is refused: {'; and '.join(reasons)}. The index is unchanged. Train or choose another model; to "
            "upgrade to this one anyway, give `force`")


LABEL_SERIES = {"new": "the new model's vectors", "cross_model": "its queries against the stored vectors"}


def labels_sentence(labels: Mapping[str, Any]) -> str:
    """An upgrade's measurement on the index's labels (``measure_on_labels``) in words: each model's Recall@1 and
    MAP@R on the same sampled images, and which is worse beyond noise."""
    if not labels.get("measured"):
        return f"not measured: {labels.get('reason')}"
    old = labels["old"]
    parts = [f"stored vectors Recall@1 {old['recall@1']:.3f}, MAP@R {old['map@r']:.3f}"]
    for name, what in LABEL_SERIES.items():
        if name not in labels:
            continue
        compared = labels["compared"][name]
        change = ", ".join(f"{metric} {compared['difference'][metric]:+.3f} (95% interval "
                           f"{compared['interval'][metric][0]:+.3f} to {compared['interval'][metric][1]:+.3f})"
                           for metric in COMPATIBILITY_METRICS)
        judged = ("WORSE beyond noise" if compared["worse"] else
                  "too few queries to tell" if compared["too_few"] else "not worse beyond noise")
        parts.append(f"{what} Recall@1 {labels[name]['recall@1']:.3f}, MAP@R {labels[name]['map@r']:.3f}: "
                     f"{change}, {judged}")
    return (f"{'; '.join(parts)} (on {labels['images']} images of {labels['labels']} labels, each a query among "
            f"the others; worse beyond noise: a drop of at least {MIN_DROP} whose whole interval is below 0)")


def text_off(info: IndexInfo, embedder: ImageEmbedder, why: str, index_root: str | Path,
             model_path: str | Path) -> IndexInfo:
    """``info`` with its text model turned off (its fields moved to ``TEXT_MODEL_OFF`` with why): its tower maps
    text into a space the index's vectors are no longer in, so text search says so rather than answer worse."""
    record = {"text_model_hash": info.text.hash, "image_model_hash": info.model.hash,
              "upgraded_to": embedder.model_hash, "reason": why}
    off = info.without(*TEXT_FIELDS).with_fields({TEXT_MODEL_OFF: record})
    log.warning("%s", text_off_problem(record, printable_path(str(index_root)), printable_path(str(model_path))))
    return off


def check_record(checks: Mapping[str, Any] | None) -> dict[str, Any]:
    """What index.json keeps of an upgrade's checks, for ``index stats``, /stats and the app."""
    if not checks:
        return {}
    labels = checks.get("on_labels") or {}
    on_text = checks.get("on_text")
    return {"verdict": checks.get("verdict"), "on_labels": labels, "on_labels_text": labels_sentence(labels),
            "forced": checks.get("forced") or [],
            **({"on_text": on_text, "on_text_text": text_sentence(on_text)} if on_text else {})}
