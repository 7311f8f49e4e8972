"""``repair_index``: finish or mend whatever a crash left in an index folder (see ``writer``: resumability, step by
step)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from retrieval.errors import ParameterError, parameters_named
from retrieval.index.catalogue import Catalogue, Status
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.embedding.engines import open_engine
from retrieval.index.embedding.ingest import ingest
from retrieval.index.faiss_backend.faiss_build import build_faiss, update_faiss
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import MODEL_RELATIVE
from retrieval.index.query_embedder import (
    EMBEDDINGS_SOURCE,
    ImageEmbedder,
    built_without_model,
    load_model,
)
from retrieval.index.shards import ShardStore
from retrieval.index.writing.collection_writes import refuse_collection_repair
from retrieval.index.writing.keyword_build import sync_keywords
from retrieval.index.writing.mend import mend
from retrieval.index.writing.records import (
    NothingToRepairError,
    check_same_model,
    info_from_meta,
    list_images,
    readable_faiss,
    readable_info,
    recorded_model,
    relabel,
    relocate,
    reopen_input,
    writer_summary,
)
from retrieval.records.index_info import IndexInfo

log = logging.getLogger(__name__)




def repair_index(
    index_dir: str | Path,
    model: str | Path | None = None,
    embedder: ImageEmbedder | None = None,
    rebuild: bool = False,
    gpu: bool = False,
    options: IngestOptions | None = None,
    label_from: str | None = None,
    gallery_root: str | Path | None = None,
) -> dict[str, Any]:
    """Finish an interrupted build/add, or mend an index whose parts disagree; returns a summary. A gallery that
    moved (``relocate``; ``gallery_root``: where to) is followed first.

    Re-embeds only images that no shard holds (the model is loaded only then). faiss is updated in
    place (or rebuilt from the shards: an unfinished build, an unreadable faiss file, or ``rebuild``),
    and the result is checked: faiss holds exactly the catalogue's ``done`` ids. ``label_from`` relabels the
    gallery's images by that rule first (``relabel``).
    """
    started = time.perf_counter()
    options = options or IngestOptions()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    engine = open_engine(options)
    with engine, layout.write_lock("repair"), Catalogue(layout.catalogue) as catalogue:
        refuse_collection_repair(layout, catalogue)
        state = catalogue.get_meta("state")
        from_embeddings = catalogue.get_meta("source") == EMBEDDINGS_SOURCE
        if state is None or (catalogue.get_meta("model_hash") is None and not from_embeddings):
            raise NothingToRepairError(f"{layout.root} holds no started build, so there is nothing to repair; build it "
                                       "first")
        if from_embeddings and (model is not None or embedder is not None):
            raise ParameterError("model", f"does not apply: {built_without_model(layout.root)} (its vectors are read "
                                          "again from the embeddings its build started from); leave it out")
        if not from_embeddings:  # a build from embeddings reads no image: its paths are kept as they are
            relocate(layout, catalogue, gallery_root)
        with parameters_named(rule="label_from"):  # only the rule's errors: the gallery's keep their names
            labels = relabel(catalogue, label_from) if label_from is not None else None
        store = ShardStore(layout.shards)
        mended = mend(catalogue, store)
        source = catalogue.get_meta("gallery_images")
        if catalogue.counts()["total"] == 0 and source is not None:  # killed while planning: plan again
            gallery, _ = list_images(source, catalogue.get_meta("gallery_split"), catalogue)
            catalogue.plan(gallery.items, gallery.source, gallery.errors)
        if catalogue.counts()[Status.PENDING.value] and from_embeddings:
            reopen_input(catalogue, layout.root).copy_pending(catalogue, store, options.shard_size, options.progress)
        elif catalogue.counts()[Status.PENDING.value]:
            if embedder is None and model is not None:
                embedder = load_model(model)
            elif embedder is None:
                if catalogue.get_meta("model_path") is None:
                    raise ParameterError(
                        "model", f"is needed: {catalogue.counts()[Status.PENDING.value]} images of {layout.root} "
                        "need embedding and the index records no model path"
                    )
                record = IndexInfo.from_json({key: catalogue.get_meta(key)
                                              for key in ("model_path", MODEL_RELATIVE, "model_hash")})
                embedder, _ = recorded_model(layout, catalogue, record)
            embedder = check_same_model(catalogue, embedder, layout.root)
            ingest(engine, catalogue, store, embedder, options)
        info = info_from_meta(catalogue)
        old = readable_info(layout) if state == "complete" else None
        index = readable_faiss(layout) if old is not None and not rebuild else None
        if old is not None and index is not None:
            updated = update_faiss(layout, catalogue, store, old, gpu, index=index, policy=options.policy)
            info = old.with_fields(updated)
        else:
            key = old.vectors.index_key if old is not None else catalogue.get_meta("index_key") or "auto"
            built = build_faiss(
                layout, catalogue, store, key, info.model.embedding_dim, gpu,
                policy=options.policy, add_vectors=engine.add_vectors,
            )
            if old is not None:
                built["index_key_requested"] = old.requested_index_key
            info = (old if old is not None else IndexInfo()).with_fields({**info.to_json(), **built})
        info = info.with_fields(sync_keywords(layout, catalogue, info))  # a keyword index in step with the rows too
        layout.write_info(info)
        catalogue.set_meta(state="complete")
        return {
            "index_dir": str(layout.root),
            "index_key": info.vectors.index_key,
            "faiss": info.vectors.updated_by if info.holds("updated_by") else "rebuilt from the shards",
            "vectors": info.vectors.count,
            **({"labels": labels} if labels is not None else {}),
            **writer_summary(catalogue, started, mended),
        }
