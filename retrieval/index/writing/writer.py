"""The index writer's commands: ``build_index``, ``add_images``, ``remove_images`` and ``build_from_embeddings`` (an
index of vectors someone already has: no images, no model; its steps are the same, the ingest a copy of the input's
vectors, ``embedding_input``); ``repair_index`` is ``repair``'s, what they share ``records``'.

Each plans the catalogue, mends what a crash left (``mend``), embeds the pending rows with the engine the options
choose (``engines``, ``ingest``) and builds or updates faiss (``faiss_build``).

Resumability, step by step (a kill -9 at any point loses nothing and duplicates nothing):
1. plan: every gallery path gets a ``pending`` catalogue row in one transaction (idempotent: a path
   already catalogued keeps its row and id);
2. ingest (``ingest``): pending images are decoded in threads (``decode.thread_batches``) and embedded
   in batches; a shard file (ids, vectors and the outcomes of its images) is written atomically, then its rows
   are marked done/error/duplicate in one transaction;
3. reconcile (``mend``, at the start of every run): a shard written but not yet recorded (a kill between the
   two steps of 2) has its outcomes recorded from the file itself;
4. faiss (``faiss_build``): the index is rebuilt from the shards (rows ``done``) and written atomically, then
   ``index.json``; ``add``/``remove`` update it in place by set difference between the ids the index
   holds and the ``done`` rows, which is idempotent too.

One writer at a time: every command here and ``repair_index`` holds the folder's writer lock
(``IndexLayout.write_lock``) for its whole run. ``repair_index`` finishes or mends whatever a crash (or, before the
lock, two writers at once) left: it reconciles the shards, points each ``done`` row at a shard that holds its vector
(re-embedding only rows no shard holds), embeds the pending rows, brings faiss in line and checks that
faiss holds exactly the ``done`` ids. Every "unfinished" or "inconsistent" message names it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from retrieval.errors import ParameterError
from retrieval.index.catalogue import Catalogue
from retrieval.index.curation.add_check import check_new_images
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.embedding.engines import open_engine
from retrieval.index.embedding.ingest import ingest
from retrieval.index.faiss_backend import faiss_gpu, faiss_keys
from retrieval.index.faiss_backend.faiss_build import update_faiss
from retrieval.index.formats.embedding_input import open_embeddings
from retrieval.index.layout import VECTORS_IN, IndexLayout, repair_command
from retrieval.index.portable import GALLERY_RELATIVE, relative_to_index
from retrieval.index.query_embedder import (
    EMBEDDINGS_SOURCE,
    ImageEmbedder,
    NoModelError,
    built_without_model,
    load_model,
)
from retrieval.index.search import public_path
from retrieval.index.shards import ShardStore
from retrieval.index.sources import (
    GalleryItem,
    is_utf8,
    label_summary,
    printable_path,
)
from retrieval.index.writing.collection_writes import (
    add_into_collection,
    build_into_collection,
    check_resumed_place,
    collection_meta,
    remove_from_collection,
)
from retrieval.index.writing.keyword_build import build_keywords, check_text_columns, recorded_columns, sync_keywords
from retrieval.index.writing.mend import mend
from retrieval.index.writing.records import (
    SIMILARITY,
    FinishedIndexError,
    check_same_input,
    check_same_key,
    check_same_model,
    labelled_images,
    list_images,
    meta_values,
    model_fields,
    publish_faiss,
    recorded_model,
    refuse_finished,
    relocate,
    require_complete,
    tally,
    writer_summary,
)
from retrieval.near_duplicates import DuplicateCheck

if TYPE_CHECKING:
    from retrieval.index.milvus.milvus_collection import MilvusPlace

log = logging.getLogger(__name__)




def build_index(
    images: str | Path,
    out: str | Path,
    model: str | Path | None = None,
    embedder: ImageEmbedder | None = None,
    index_key: str = "auto",
    split: str | None = None,
    gpu: bool = False,
    options: IngestOptions | None = None,
    label_from: str | None = None,
    milvus: MilvusPlace | None = None,
    milvus_index_type: str | None = None,
    text_columns: Sequence[str] | None = None,
    label_column: str | None = None,
) -> dict[str, Any]:
    """Build (or finish an interrupted build of) an index of the images in ``out``; returns a summary.

    ``text_columns``: the manifest columns (``label`` too) a keyword index holds (``keyword_build``, beside the
    faiss index; None: those an interrupted build of this folder recorded, if any).

    ``label_from`` (``sources.LABEL_RULES``): where an image's label comes from; default: its folder's name (a
    folder) or the label column (a manifest: ``label_column``, 'label' unless named; recorded, so that ``add_images``
    reads the same). The summary says which classes it found, and where a manifest has none, the column that looks
    like them. A manifest whose images are not there (it moved) is refused in one line before anything is embedded.

    ``options.engine`` chooses who decodes and embeds (``local``, or ``ray`` on a Ray cluster); every
    engine writes the same folder layout, so an index is resumed, searched and updated the same way.

    ``milvus`` (with ``options.engine`` ray and a Milvus server): the Ray actors write the vectors straight into
    that collection (``milvus_build``; ``milvus_index_type``: its vector index, default AUTOINDEX) and ``out``
    keeps the catalogue and the model's record, no shards and no faiss index.
    """
    started = time.perf_counter()
    options = options or IngestOptions()
    if milvus is not None:
        from retrieval.index.milvus.milvus_build import check_build_place

        check_build_place(milvus, options.engine)  # before the model loads or Ray starts
    if gpu:
        faiss_gpu.require_gpu()  # fail before any work
    if embedder is None:
        if model is None:
            raise ParameterError("model", "is needed (an exported .onnx file) to embed the images with")
        embedder = load_model(model)
    layout = IndexLayout(out)
    layout.root.mkdir(parents=True, exist_ok=True)
    engine = open_engine(options)
    with engine, layout.write_lock("build an index in"), Catalogue(layout.catalogue) as catalogue:
        state = catalogue.get_meta("state")
        store = ShardStore(layout.shards)
        if state == "complete" and catalogue.get_meta(VECTORS_IN) is not None:
            raise FinishedIndexError(f"{layout.root} already holds a finished index, its vectors in Milvus "
                                     f"({json.loads(catalogue.get_meta(VECTORS_IN))['collection']}); add images "
                                     "to it, or build into another folder")
        if state == "complete":
            refuse_finished(layout, catalogue, store)
        if state is not None:
            if catalogue.get_meta("source") == EMBEDDINGS_SOURCE:
                raise FileExistsError(
                    f"{layout.root} holds an interrupted build from the embeddings in "
                    f"{catalogue.get_meta('embeddings_dir')}; finish that one (run it again, or "
                    f"`{repair_command(layout.root)}`), or build from images into another folder")
            embedder = check_same_model(catalogue, embedder, layout.root)
            check_resumed_place(catalogue, milvus, layout.root)
            if milvus is None:
                check_same_key(catalogue, index_key, layout.root)
        # Ray's workers read the files: the driver may not see them
        gallery, rule = list_images(images, split, catalogue, label_from, label_column,
                                    look_for_files=options.engine == "local")
        if state is None:
            fields = model_fields(embedder, str(model) if model else None, layout.root)
            catalogue.set_meta(state="building", index_key=index_key, **meta_values(fields),
                               **collection_meta(milvus, embedder))
        if catalogue.get_meta("gallery_root") is None:  # what repair re-lists if planning never finished
            catalogue.set_meta(
                gallery_root=gallery.root, gallery_images=str(Path(images).expanduser().resolve()),
                **{GALLERY_RELATIVE: relative_to_index(gallery.root, layout.root)},
                **({"gallery_split": split} if split is not None else {}),
            )
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        text_columns = list(text_columns) if text_columns else recorded_columns(catalogue)
        if text_columns:
            if milvus is not None:
                raise ParameterError("text_columns", "keep their keyword index beside a folder's faiss index; a "
                                                     "build into a Milvus collection has none")
            check_text_columns(text_columns, catalogue)  # before any image is embedded
        if milvus is not None:
            built = build_into_collection(layout, catalogue, store, engine, embedder, options, milvus,
                                           milvus_index_type)
            return {"index_dir": str(layout.root), **built, "labels": label_summary(gallery, rule),
                    **writer_summary(catalogue, started, {})}
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        if text_columns:  # recorded in the catalogue's meta, which index.json is written from next
            build_keywords(layout, catalogue, text_columns)
        built = publish_faiss(layout, catalogue, store, index_key, int(embedder.embedding_dim), gpu, options,
                               engine.add_vectors)
        return {
            "index_dir": str(layout.root),
            "index_key": built["index_key"],
            "params": built["params"],
            **({"budget": built["budget"]} if "budget" in built else {}),
            "labels": label_summary(gallery, rule),
            **writer_summary(catalogue, started, mended),
        }


def build_from_embeddings(
    embeddings: str | Path,
    out: str | Path,
    index_key: str = "auto",
    gpu: bool = False,
    options: IngestOptions | None = None,
    chunk_rows: int | None = None,
    allow_outside_paths: bool = False,
) -> dict[str, Any]:
    """Build (or finish an interrupted build of) an index in ``out`` from vectors someone already has, with no
    images and no model; returns a summary.

    ``embeddings`` is a folder in the layout ``index export`` (npy) and clip-retrieval write: ``embeddings/*.npy``
    (or ``img_emb/*.npy``) and optionally ``metadata/*.parquet`` with the same rows (``embedding_input``: the
    checks, and how ids, paths, labels and other columns are read). Every value is checked before anything is
    recorded; then the rows are catalogued in one transaction, the vectors copied into shards (``options.
    shard_size`` rows each; a killed build resumes from the rows still pending, as an image build does) and faiss
    built as for images (``options.policy``: the auto key and the budgets). index.json records no model
    (``source`` "embeddings"): the index is searched with embeddings; whatever needs a model is refused.
    ``chunk_rows``: rows read at a time (default: 16 MiB of vectors). A metadata path that resolves outside the
    folder the input's paths are taken from (absolute, ``..``, through a symlink) is refused unless
    ``allow_outside_paths``: a server sends every catalogued file to whoever searches.
    """
    started = time.perf_counter()
    if gpu:
        faiss_gpu.require_gpu()  # fail before any work
    options = options or IngestOptions()
    # the headers, row counts and column sizes, before the folder is touched
    source = open_embeddings(embeddings, chunk_rows, allow_outside_paths)
    layout = IndexLayout(out)
    layout.root.mkdir(parents=True, exist_ok=True)
    with layout.write_lock("build an index in"), Catalogue(layout.catalogue) as catalogue:
        state = catalogue.get_meta("state")
        store = ShardStore(layout.shards)
        if state == "complete":
            refuse_finished(layout, catalogue, store, "build into another folder (an index built from embeddings "
                                                       "takes no additions: build it again from the whole set)")
        if state is not None:
            check_same_input(catalogue, source, layout.root)
            check_same_key(catalogue, index_key, layout.root)
        else:
            if catalogue.counts()["total"]:
                raise FileExistsError(f"{layout.root} holds catalogued images but no record of a build; build into "
                                      "an empty folder")
            source.check_values(options.progress)  # a bad value is refused before anything is recorded
            fields = {"model_path": None, "model_hash": None, "embedding_dim": source.dim, "similarity": SIMILARITY,
                      "source": EMBEDDINGS_SOURCE, "embeddings_dir": str(source.root.resolve())}
            source.plan(catalogue, {"state": "building", "index_key": index_key, **meta_values(fields),
                                    "gallery_root": source.gallery_root,
                                    GALLERY_RELATIVE: relative_to_index(source.gallery_root, layout.root),
                                    "embeddings_fingerprint": source.fingerprint})
        mended = mend(catalogue, store)
        source.copy_pending(catalogue, store, options.shard_size, options.progress)
        built = publish_faiss(layout, catalogue, store, index_key, source.dim, gpu, options)
        labels = catalogue.label_counts()
        classes = {label: count for label, count in labels.items() if label is not None}
        largest = sorted(classes.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
        return {
            "index_dir": str(layout.root),
            "source": EMBEDDINGS_SOURCE,
            "embeddings_dir": str(source.root.resolve()),
            "embedding_dim": source.dim,
            "index_key": built["index_key"],
            "params": built["params"],
            **({"budget": built["budget"]} if "budget" in built else {}),
            "labels": {"from": "label" if classes else "none", "classes": len(classes),
                       "unlabelled": labels.get(None, 0), "largest_classes": dict(largest)},
            **writer_summary(catalogue, started, mended),
        }


def add_images(
    index_dir: str | Path,
    images: str | Path,
    model: str | Path | None = None,
    embedder: ImageEmbedder | None = None,
    split: str | None = None,
    gpu: bool = False,
    options: IngestOptions | None = None,
    label_from: str | None = None,
    duplicates: DuplicateCheck | None = None,
    gallery_root: str | Path | None = None,
    check_new: Callable[[Sequence[GalleryItem]], None] | None = None,
) -> dict[str, Any]:
    """Embed new images with the index's own model and add them without rebuilding (resumable too); labelled by
    the index's own label rule unless told otherwise. ``duplicates``: report (default) or skip the new images that
    nearly copy an indexed one (``add_check``). A gallery that moved (``relocate``; ``gallery_root``: where to) is
    followed first. ``check_new`` sees the new images before anything is written: what it raises leaves the index
    as it was (a collection kept in step checks its columns: ``milvus_push.new_images_check``)."""
    started = time.perf_counter()
    duplicates = duplicates or DuplicateCheck()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    options = options or IngestOptions()
    engine = open_engine(options)
    with engine, layout.write_lock("add images to"), Catalogue(layout.catalogue) as catalogue:
        info = require_complete(layout, catalogue, vectors_in_milvus=True)
        if not info.has_model:
            raise NoModelError(f"{built_without_model(layout.root)}: images cannot be added to it, as nothing can "
                               "embed them into the space of its vectors; build it again from embeddings that hold "
                               "the new images too, or build an index of all the images with a model")
        info = info.with_fields(relocate(layout, catalogue, gallery_root))  # before the new images are planned
        if embedder is None and model is not None:
            embedder = load_model(model)
        elif embedder is None:
            embedder, found = recorded_model(layout, catalogue, info)
            info = info.with_fields(found)
        embedder = check_same_model(catalogue, embedder, layout.root)
        gallery, rule = labelled_images(images, split, catalogue, label_from,
                                        look_for_files=options.engine == "local")
        if check_new is not None:
            check_new(gallery.items)
        before = tally(catalogue)
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        store = ShardStore(layout.shards)
        if info.holds(VECTORS_IN):
            updated = add_into_collection(layout, catalogue, store, engine, embedder, options, info, duplicates)
            this_run = {key: value - before[key] for key, value in tally(catalogue).items()}
            return {"index_dir": str(layout.root), **updated, "labels": label_summary(gallery, rule),
                    "this_run": this_run, "near_duplicates": None, **writer_summary(catalogue, started, {})}
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        near = check_new_images(layout, catalogue, store, info, duplicates)  # before faiss holds the new images
        updated = update_faiss(layout, catalogue, store, info, gpu, policy=options.policy)
        info = info.with_fields(sync_keywords(layout, catalogue, info))
        layout.write_info(info.with_fields(updated))
        this_run = {key: value - before[key] for key, value in tally(catalogue).items()}
        return {"index_dir": str(layout.root), **updated, "labels": label_summary(gallery, rule),
                "this_run": this_run, "near_duplicates": near, **writer_summary(catalogue, started, mended)}


def remove_images(
    index_dir: str | Path,
    ids: Sequence[int] = (),
    paths: Sequence[str] = (),
    policy: faiss_keys.AutoPolicy = faiss_keys.AUTO_POLICY,
    gallery_root: str | Path | None = None,
) -> dict[str, Any]:
    """Mark images removed in the catalogue, then take them out of the faiss index (``policy``: for an index type
    that must be rebuilt from the shards). A gallery that moved (with the index, or to ``gallery_root``) is followed
    first (``relocate``), so that ``paths`` name the images where they are now."""
    started = time.perf_counter()
    layout = IndexLayout(index_dir)
    layout.require_catalogue()
    with layout.write_lock("remove images from"), Catalogue(layout.catalogue) as catalogue:
        info = require_complete(layout, catalogue, vectors_in_milvus=True)
        wanted = [int(i) for i in ids]
        if paths:
            info = info.with_fields(relocate(layout, catalogue, gallery_root))
            root = info.catalogue.gallery_root or catalogue.get_meta("gallery_root")
            found = {given: catalogue_id(catalogue, given, root) for given in paths}
            missing = [given for given, found_id in found.items() if found_id is None]
            if missing:
                where = f", or relative to the gallery {printable_path(root)}" if root else ""
                raise ValueError(f"nothing was removed: not in the catalogue: "
                                 f"{', '.join(printable_path(given) for given in missing[:5])} (a path is taken as "
                                 f"given, from the working folder{where}){_same_names(catalogue, missing, root)}")
            wanted += list(found.values())
        statuses = catalogue.status_of(wanted)
        unknown = [i for i in wanted if i not in statuses]
        if unknown:
            known = [i for i in wanted if i in statuses]
            rest = f"; to remove the others: `ids` {','.join(map(str, known))}" if known else ""
            raise ValueError(f"nothing was removed: no catalogue rows with ids {', '.join(map(str, unknown[:10]))} "
                             f"(`retrieval index stats` shows the ids in use){rest}")
        catalogue.mark_removed(wanted)
        if info.holds(VECTORS_IN):
            updated = remove_from_collection(catalogue, info, wanted)
        else:
            store = ShardStore(layout.shards)
            updated = update_faiss(layout, catalogue, store, info, policy=policy)
            info = info.with_fields(sync_keywords(layout, catalogue, info))
            layout.write_info(info.with_fields(updated))
        return {
            "index_dir": str(layout.root),
            "removed_ids": sorted(set(wanted)),
            **updated,
            **writer_summary(catalogue, started, {}),
        }


def _same_names(catalogue: Catalogue, missing: Sequence[str], gallery_root: str | None) -> str:
    """The catalogued paths with the file name of the first missing path, as the API shows them: a path copied
    without its folders is answered with the ones it may mean."""
    name = PurePosixPath(missing[0]).name
    named = catalogue.paths_named(name) if name and is_utf8(name) else []  # others are never catalogued
    if not named:
        return ""
    shown = [printable_path(public_path(path, PurePosixPath(gallery_root)) if gallery_root else path) for path in named]
    return f"; catalogued images named {printable_path(name)}: {', '.join(shown)}"


def catalogue_id(catalogue: Catalogue, given: str, gallery_root: str | None) -> int | None:
    """The id of the catalogued image ``given`` names: an absolute path, a path from the working folder, or a
    path relative to the gallery root (as the API and the app show them); None when none is catalogued."""
    candidates = [Path(given).expanduser().resolve()]
    if gallery_root and not Path(given).is_absolute():
        candidates.append((Path(gallery_root) / given).resolve())
    paths = [str(p) for p in candidates] + [given]  # as given last: a URL a build from embeddings catalogued
    paths = [p for p in paths if is_utf8(p)]  # others are never catalogued
    found = catalogue.ids_for_paths(paths)
    return next((found[p] for p in paths if p in found), None)
