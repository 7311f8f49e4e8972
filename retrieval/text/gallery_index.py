"""A zero-shot text tower adapted to an index folder's gallery (``retrieval.text.gallery_adapt``) and recorded in it:
what `retrieval index text` and `retrieval index build` run for a zero-shot tower. The gallery's vectors are a
seeded sample of the index's stored ones, read shard by shard (memory: the sample, whatever the index's size)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError
from retrieval.index.layout import IndexLayout
from retrieval.index.sources import printable_path
from retrieval.text.gallery_adapt import AdaptConfig, GalleryAdaptError, adapt_tower, is_zero_shot
from retrieval.text.text_index import checked_text_model, record_text_model
from retrieval.text.text_onnx import TextEmbedder

ADAPTED_NAME = "text.adapted.*.onnx"  # the adapted tower's file in the index folder (*: its hash, or "pending")
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _priority(ids: np.ndarray, seed: int) -> np.ndarray:
    """A seeded pseudo-random key per id (splitmix64): the sample is the ids of smallest key, whatever their order."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64(seed + 1) * _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_vectors(index_dir: str | os.PathLike, size: int, seed: int = 0, rows: int = 65_536) -> np.ndarray:
    """Up to ``size`` of a folder index's stored vectors (L2-normalised, [n, d] float32), a seeded sample read
    from the shards that hold them; the catalogue is walked ``rows`` ids at a time."""
    from retrieval.index.catalogue_reader import CatalogueReader
    from retrieval.index.catalogue_schema import Status
    from retrieval.index.shards import ShardStore

    layout = IndexLayout(index_dir)
    layout.require_finished()  # a Milvus collection's vectors are not in the folder
    dim = int(layout.read_record().model.embedding_dim)  # type: ignore[arg-type]  # a finished index records it
    catalogue = CatalogueReader(layout.catalogue)
    keep_ids, keep_keys, keep_shards = np.zeros(0, np.int64), np.zeros(0, np.uint64), np.zeros(0, object)
    try:
        cursor = catalogue.db.execute("SELECT id, shard FROM images WHERE status = ? AND shard IS NOT NULL",
                                      (Status.DONE,))
        while batch := cursor.fetchmany(rows):
            ids = np.fromiter((r[0] for r in batch), np.int64, len(batch))
            keep_ids = np.concatenate([keep_ids, ids])
            keep_keys = np.concatenate([keep_keys, _priority(ids, seed)])
            keep_shards = np.concatenate([keep_shards, np.asarray([r[1] for r in batch], object)])
            if len(keep_ids) > size:
                best = np.argpartition(keep_keys, size - 1)[:size]
                keep_ids, keep_keys, keep_shards = keep_ids[best], keep_keys[best], keep_shards[best]
    finally:
        catalogue.close()
    store, out = ShardStore(layout.shards, read_only=True), []
    for shard in sorted(set(keep_shards.tolist())):
        wanted = keep_ids[keep_shards == shard]
        held = store.read(shard, with_outcomes=False)
        mask = np.isin(held.ids, wanted)
        out.append(np.asarray(held.vectors[mask], np.float32))
    return np.concatenate(out) if out else np.zeros((0, dim), np.float32)


def adapted_path(index_dir: str | os.PathLike, model_hash: str | None = None) -> Path:
    """Where the adapted tower of the index in ``index_dir`` is written (``model_hash`` None: while it is written),
    then named by its hash, so that a tower the index records is never overwritten before a new one is recorded."""
    name = ADAPTED_NAME.replace("*", "pending") if model_hash is None else ADAPTED_NAME.replace("*", model_hash[:16])
    return IndexLayout(index_dir).root / name


def record_adapted(index_dir: str | os.PathLike, text_model: str | os.PathLike,
                   config: AdaptConfig | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Adapt ``text_model`` to the index's gallery (``adapt_for_index``) and record the tower it delivers (the adapted
    one, else ``text_model``): (what ``record_text_model`` recorded, the adaptation's report)."""
    report = adapt_for_index(index_dir, text_model, config)
    recorded = _record_new(index_dir, report) if report["adapted"] else record_text_model(index_dir, text_model)
    return recorded, report


def _record_new(index_dir: str | os.PathLike, report: dict[str, Any]) -> dict[str, Any]:
    """Record a new adapted tower (``report["text_model"]``): removed again where it cannot be recorded (unless the
    index records that very file already); once it is, the adapted towers the index no longer records are."""
    layout = IndexLayout(index_dir)
    path = Path(report["text_model"])
    ours = layout.read_record().text.hash != report["adapted_hash"]
    try:
        recorded = record_text_model(index_dir, path)
    except BaseException:
        if ours:
            path.unlink(missing_ok=True)
        raise
    for stale in layout.root.glob(ADAPTED_NAME):
        if stale.name != path.name:
            stale.unlink(missing_ok=True)
    return recorded


def adapt_for_index(index_dir: str | os.PathLike, text_model: str | os.PathLike,
                    config: AdaptConfig | None = None) -> dict[str, Any]:
    """The text model to record for the index in ``index_dir``: ``text_model`` adapted to the index's gallery when it
    is a zero-shot tower that fits the index and the adaptation measures not worse on held-out pseudo-captions, else
    ``text_model`` as it is. The report says which (``adapted``), why (``reason``) and the measures."""
    config = config or AdaptConfig()
    layout = IndexLayout(index_dir)
    source = TextEmbedder(text_model)
    kept = {"adapted": False, "text_model": str(source.path), "source_hash": source.model_hash}
    if not is_zero_shot(source):
        return {**kept, "reason": "not a zero-shot tower: recorded as it is"}
    layout.require_finished(vectors_in_milvus=True)
    if layout.vectors_in() is not None:
        return {**kept, "reason": "the index's vectors are in a Milvus collection, which the adaptation does not read: "
                                  "the zero-shot tower is recorded as it is"}
    checked_text_model(source, layout.read_record(), layout.root)  # a tower of another image model: refused first
    out = adapted_path(index_dir)
    if out.resolve() == source.path.resolve():
        return {**kept, "reason": f"the zero-shot tower is {printable_path(str(out))}, where the adapted one would be "
                                  "written: recorded as it is"}
    try:
        report = adapt_tower(source, sample_vectors(index_dir, config.sample, config.seed), out, config)
    except GalleryAdaptError as exc:
        return {**kept, "reason": str(exc)}
    if report["adapted"]:
        named = adapted_path(index_dir, report["adapted_hash"])
        os.replace(out, named)
        report["text_model"] = str(named)
    return report


def adaptation_sentence(report: dict[str, Any] | None) -> str:
    """What the adaptation did, as a clause of a command's output ("" for a tower that is not zero-shot)."""
    if not report or report.get("reason", "").startswith("not a zero-shot tower"):
        return ""
    if report["adapted"]:
        return (f"; the zero-shot tower {report['source_hash']} was adapted to the gallery ({report['fit_images']} "
                f"images' pseudo-captions; {report['reason']}): the adapted tower is the one recorded")
    return f"; the zero-shot tower was not adapted: {report['reason']}"


def adapt_recorded(index_dir: str | os.PathLike, text_model: str | os.PathLike,
                   config: AdaptConfig | None = None) -> dict[str, Any]:
    """After a build recorded ``text_model``: adapted to the gallery (``adapt_for_index``) and the adapted tower
    recorded in its place when it is delivered; a problem is the report's ``reason``, the index stays as it is."""
    try:
        report = adapt_for_index(index_dir, text_model, config)
        if report["adapted"]:
            report["recorded"] = _record_new(index_dir, report)
    except (ParameterError, OSError, ValueError) as exc:  # a damaged class list, a folder that cannot be written
        return {"adapted": False, "text_model": str(text_model), "reason": str(exc)}
    return report
