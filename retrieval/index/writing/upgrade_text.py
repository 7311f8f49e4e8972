"""What an upgrade that keeps the index's text model measures of it first: the text model's search of the index's own
captions (a manifest column that describes each image: the columns the text model was trained on, else the index's
keyword or display columns), against the stored vectors and against the new model's vectors of the same images.

Each sampled image's caption is a query among the sample; it finds its image (or any image captioned alike) in the
top ``TEXT_K`` or not. The two sides are compared on the same queries with the paired bootstrap the compatibility
verdict reads noise with (``compatibility.bootstrap_means``): worse beyond noise is a drop of at least ``MIN_DROP``
whose whole 95 % interval lies below 0. A text model worse beyond noise is turned off by the upgrade (the index says
why and how to fit one for the new model) rather than served worse. No torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import CONFIDENCE, MIN_DROP, MIN_QUERIES, bootstrap_means
from retrieval.index.catalogue import Catalogue, Status
from retrieval.index.display_columns import PRICE_COLUMNS, checked_columns
from retrieval.index.embedding.embed_rows import RowEmbedder
from retrieval.index.query_embedder import ImageEmbedder
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks
from retrieval.records.index_info import IndexInfo
from retrieval.text.gallery_adapt import tower_metadata
from retrieval.text.text_onnx import TextEmbedder
from retrieval.utils.unit_rows import l2_normalize_rows

TEXT_SAMPLE = 1000  # captioned images measured at most
TEXT_K = 10  # a caption finds its image within the top TEXT_K of the sample
MAX_CAPTION_CHARS = 300  # a caption is cut here: a query is short
MAX_COLUMNS_JSON = 4096  # characters of a text model's caption_columns record
MAX_CAPTION_COLUMNS = 8
SQL_CHUNK = 900  # ids in one IN (...) query
SCAN_FACTOR = 20  # rows read at most per caption wanted (a catalogue whose columns are mostly empty)


def caption_columns(info: IndexInfo, text: TextEmbedder) -> list[str]:
    """The columns whose text describes each image: those the text model was trained on (its metadata's
    ``caption_columns``), else the index's keyword columns, else its display columns (index.json); names checked
    as index.json's are (``display_columns.checked_columns``), prices left out."""
    recorded = tower_metadata(text).get("caption_columns") or ""
    try:
        trained_on = json.loads(recorded) if len(recorded) <= MAX_COLUMNS_JSON else None
    except ValueError:
        trained_on = None
    for listed in (trained_on, info.catalogue.text_columns, info.catalogue.display_columns):
        names = [name for name in checked_columns(listed) if name not in PRICE_COLUMNS]
        if names:
            return names[:MAX_CAPTION_COLUMNS]
    return []


def captioned_sample(catalogue: Catalogue, columns: Sequence[str], limit: int = TEXT_SAMPLE,
                     seed: int = 0) -> list[tuple[int, str, str]]:
    """A seeded sample of up to ``limit`` indexed (id, path, caption): the text of ``columns`` of rows that have
    some, joined by ". ". Reads the indexed ids, then the chosen rows only."""
    if not columns:
        return []
    ids = np.asarray([row[0] for row in catalogue.db.execute(
        "SELECT m.id FROM metadata m JOIN images i ON i.id = m.id WHERE i.status=? ORDER BY m.id", (Status.DONE,))],
        dtype=np.int64)
    order = np.random.default_rng(seed).permutation(len(ids))
    picked: list[tuple[int, str, str]] = []
    # rows without the columns' text are passed over, up to SCAN_FACTOR x limit rows read
    for start in range(0, min(len(ids), SCAN_FACTOR * limit), SQL_CHUNK):
        chosen = ids[order[start:start + SQL_CHUNK]].tolist()
        marks = ",".join("?" * len(chosen))
        rows = catalogue.db.execute(
            f"SELECT i.id, i.path, m.data FROM images i JOIN metadata m ON m.id = i.id WHERE i.id IN ({marks})",
            chosen).fetchall()
        for image_id, path, data in sorted(rows):
            caption = _caption(data, columns)
            if caption:
                picked.append((int(image_id), str(path), caption))
        if len(picked) >= limit:
            break
    return picked[:limit]


def _caption(data: str | None, columns: Sequence[str]) -> str:
    try:
        values = json.loads(data or "{}")
    except ValueError:
        return ""
    if not isinstance(values, dict):
        return ""
    parts = [str(values[name]).strip() for name in columns if isinstance(values.get(name), (str, int, float))]
    return ". ".join(part for part in parts if part)[:MAX_CAPTION_CHARS]


def found_within(text: np.ndarray, images: np.ndarray, captions: Sequence[str], k: int = TEXT_K) -> np.ndarray:
    """Per caption [n]: 1.0 where an image captioned alike (its own, or one of the same caption) is among the top
    ``k`` of ``images`` [n, d] for the caption's embedding ``text`` [n, d], else 0.0."""
    if not len(captions):
        return np.zeros(0)
    scores = text @ images.T
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    same = np.asarray(captions, dtype=object)
    return np.asarray([float((same[row] == same[i]).any()) for i, row in enumerate(top)])


def measure_text_on_captions(catalogue: Catalogue, store: ShardStore, info: IndexInfo,
                             embedder: ImageEmbedder, text: TextEmbedder, limit: int = TEXT_SAMPLE, seed: int = 0,
                             batch_size: int = 64, workers: int = 1, max_pixels: int | None = None,
                             ) -> dict[str, Any]:
    """How the text model finds the index's captioned images among the sample: with the stored vectors (``old``)
    and with ``embedder``'s vectors of the same images (``new``), Recall@``TEXT_K`` each and whether ``new`` is
    worse beyond noise (``worse``). Without captions to measure on: ``measured`` False and the ``reason``."""
    columns = caption_columns(info, text)
    base = {"measured": False, "worse": False, "k": TEXT_K, "columns": columns, "sample_limit": int(limit),
            "seed": int(seed)}
    if not columns:
        return base | {"reason": "the index names no caption column (the text model's caption columns, text "
                                 "columns or display columns) to measure the text model on"}
    sample = captioned_sample(catalogue, columns, limit, seed)
    if len(sample) < MIN_QUERIES:
        return base | {"images": len(sample), "reason": f"{len(sample)} images have text in "
                       f"{', '.join(columns)}; at least {MIN_QUERIES} are needed to tell noise from a change"}
    options = {} if max_pixels is None else {"max_pixels": max_pixels}
    embedded = RowEmbedder(embedder, batch_size, workers, **options).embed([(i, path) for i, path, _ in sample])
    stored = {int(i): vector for chunk_ids, vectors in done_chunks(store, catalogue.shards_of(embedded.ids.tolist()))
              for i, vector in zip(chunk_ids.tolist(), vectors, strict=True)}
    kept = [i for i in embedded.ids.tolist() if i in stored]
    if len(kept) < MIN_QUERIES:
        return base | {"images": len(kept), "reason": f"of the {len(sample)} captioned images sampled, {len(kept)} "
                       "could be read"}
    caption_of = {i: caption for i, _, caption in sample}
    captions = [caption_of[i] for i in kept]
    new = l2_normalize_rows(embedded.vectors[np.isin(embedded.ids, kept)], zero_rows="keep")
    old = l2_normalize_rows(np.stack([stored[i] for i in kept]), zero_rows="keep")
    queries = text.embed(captions)
    found = np.stack([found_within(queries, old, captions), found_within(queries, new, captions)], axis=1)
    return base | {"measured": True, "images": len(kept), **compare_found(found[:, 0], found[:, 1])}


def compare_found(old: np.ndarray, new: np.ndarray) -> dict[str, Any]:
    """The same queries' hits (1.0 / 0.0) with the stored vectors (``old``) and the new model's (``new``): their
    means, the paired bootstrap's 95 % interval of the difference (new - old) and whether new is worse beyond noise
    (a drop of at least ``MIN_DROP`` whose whole interval is below 0, from ``MIN_QUERIES`` queries on)."""
    draws = bootstrap_means(np.stack([old, new], axis=1))
    low, high = (float(v) for v in np.quantile(draws[:, 1] - draws[:, 0], [(1 - CONFIDENCE) / 2,
                                                                           (1 + CONFIDENCE) / 2]))
    mean_old, mean_new = float(np.mean(old)), float(np.mean(new))
    worse = len(old) >= MIN_QUERIES and mean_new - mean_old <= -MIN_DROP and high < 0
    return {"old": mean_old, "new": mean_new, "difference": mean_new - mean_old, "interval": [low, high],
            "worse": bool(worse)}


def text_sentence(measured: Mapping[str, Any]) -> str:
    """The text model's measurement on the upgrade (``measure_text_on_captions``) in words."""
    if not measured.get("measured"):
        return f"text search not measured: {measured.get('reason')}"
    low, high = measured["interval"]
    judged = "WORSE beyond noise" if measured["worse"] else "not worse beyond noise"
    return (f"text search on the index's captions ({', '.join(measured['columns'])}: each finds its image in the "
            f"top {measured['k']} of {measured['images']}): Recall@{measured['k']} {measured['old']:.3f} with the "
            f"stored vectors, {measured['new']:.3f} with the new model's ({measured['difference']:+.3f}, 95% "
            f"interval {low:+.3f} to {high:+.3f}), {judged}")


def index_root_of(catalogue: Catalogue) -> Path:
    """The index folder a catalogue file lies in."""
    return Path(catalogue.path).parent
