"""`index add`'s near-duplicate check: each image this add embedded is searched among the images the index held
before it (its faiss part as it was, with its search settings); one whose nearest is at least the threshold is a
near-duplicate of that image and is reported, or, on request, skipped: catalogued ``duplicate`` of it (the status
of exact copies, its reason in the row's ``error``) and never added to faiss. Only new against old: two new images
that copy each other are both added (``retrieval index duplicates`` finds them afterwards).

Resumable as the add is: the new images are the indexed rows faiss does not hold yet, so a run killed between
embedding and the faiss update checks the same images again.
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

import numpy as np

from retrieval.index.catalogue import Catalogue, Outcome, Status
from retrieval.index.faiss_backend import faiss_files, faiss_params
from retrieval.index.layout import IndexLayout
from retrieval.index.search import public_path
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks
from retrieval.near_duplicates import DuplicateCheck
from retrieval.records.index_info import IndexInfo

EXAMPLES_SHOWN = 20  # near-duplicates listed in the summary; the counts cover all


def check_new_images(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, info: IndexInfo,
                     check: DuplicateCheck, batch: int = 4096) -> dict[str, Any] | None:
    """Search the indexed rows faiss does not hold yet among those it holds; report (and with ``skip`` catalogue
    as duplicates) those at least ``check.duplicate_threshold`` alike. None when the check is off."""
    if check.duplicates == "off":
        return None
    index = faiss_files.read_index(layout.faiss)
    faiss_params.set_search_params(index, info.vectors.params if info.holds("params") else {})
    done = catalogue.done_shards()
    held = faiss_params.index_ids(index)
    new = np.setdiff1d(np.fromiter(done, np.int64, len(done)), held)
    found: list[tuple[int, int, float]] = []
    if len(new) and index.ntotal:
        for ids, vectors in done_chunks(store, {int(i): done[int(i)] for i in new}):
            for start in range(0, len(ids), batch):
                scores, twins = index.search(np.ascontiguousarray(vectors[start:start + batch]), 1)
                for own, twin, score in zip(ids[start:start + batch].tolist(), twins[:, 0].tolist(),
                                            scores[:, 0].tolist(), strict=True):
                    if twin >= 0 and score >= check.duplicate_threshold:
                        found.append((int(own), int(twin), float(min(score, 1.0))))
    found.sort()
    skipped = check.duplicates == "skip"
    if skipped and found:
        rows = catalogue.rows([own for own, _, _ in found])
        catalogue.record(
            Outcome(own, Status.DUPLICATE, rows[own]["sha256"], rows[own]["size"], duplicate_of=twin,
                    error=f"near-duplicate of id {twin} (cosine {score:.4f} >= {check.duplicate_threshold:g}); "
                          "skipped by index add --duplicates skip")
            for own, twin, score in found)
    examples = found[:EXAMPLES_SHOWN]
    rows = catalogue.rows([i for own, twin, _ in examples for i in (own, twin)])
    root = PurePath(info.catalogue.gallery_root or catalogue.get_meta("gallery_root") or "/")

    def shown(image_id: int) -> str | None:
        row = rows.get(image_id)
        return public_path(row["path"], root) if row else None

    return {"action": check.duplicates, "threshold": check.duplicate_threshold, "checked": int(len(new)),
            "found": len(found), "skipped": len(found) if skipped else 0,
            "examples": [{"id": own, "path": shown(own), "duplicate_of": twin, "duplicate_of_path": shown(twin),
                          "similarity": round(score, 4)} for own, twin, score in examples]}
