"""The index writer's commands: ``build_index``, ``add_images``, ``remove_images``, ``repair_index``, and
``build_from_embeddings`` (an index of vectors someone already has: no images, no model; its steps are the same, the
ingest a copy of the input's vectors, ``embedding_input``).

Each plans the catalogue, mends what a crash left (``mend``), embeds the pending rows with the engine the options
choose (``engines``, ``ingest``) and builds or updates faiss (``faiss_build``).

Resumability, step by step (a kill -9 at any point loses nothing and duplicates nothing):
1. plan: every gallery path gets a ``pending`` catalogue row in one transaction (idempotent: a path
   already catalogued keeps its row and id);
2. ingest (``ingest``): pending images are decoded in worker processes (``decode.decoded_batches``) and embedded
   in batches; a shard file (ids, vectors and the outcomes of its images) is written atomically, then its rows
   are marked done/error/duplicate in one transaction;
3. reconcile (``mend``, at the start of every run): a shard written but not yet recorded (a kill between the
   two steps of 2) has its outcomes recorded from the file itself;
4. faiss (``faiss_build``): the index is rebuilt from the shards (rows ``done``) and written atomically, then
   ``index.json``; ``add``/``remove`` update it in place by set difference between the ids the index
   holds and the ``done`` rows, which is idempotent too.

One writer at a time: every command here holds the folder's writer lock (``IndexLayout.write_lock``)
for its whole run. ``repair_index`` finishes or mends whatever a crash (or, before the lock, two writers
at once) left: it reconciles the shards, points each ``done`` row at a shard that holds its vector
(re-embedding only rows no shard holds), embeds the pending rows, brings faiss in line and checks that
faiss holds exactly the ``done`` ids. Every "unfinished" or "inconsistent" message names it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path, PurePath, PurePosixPath
from typing import TYPE_CHECKING, Any, NoReturn

import faiss

from retrieval.errors import ParameterError, parameters_named
from retrieval.index import faiss_files, faiss_gpu, faiss_keys
from retrieval.index.add_check import check_new_images
from retrieval.index.catalogue import UPGRADE_MODEL_PATH, Catalogue, Outcome, Status
from retrieval.index.embedding_input import EmbeddingsInput, open_embeddings
from retrieval.index.engine import AddVectors, IngestOptions
from retrieval.index.engines import open_engine
from retrieval.index.faiss_build import build_faiss, update_faiss
from retrieval.index.ingest import ingest
from retrieval.index.layout import VECTORS_IN, IndexLayout, IndexLockedError, repair_command
from retrieval.index.mend import mend, missing_vectors
from retrieval.index.portable import GALLERY_RELATIVE, MODEL_RELATIVE, find_model, gallery_place, relative_to_index
from retrieval.index.query_embedder import (
    EMBEDDINGS_SOURCE,
    ImageEmbedder,
    ModelMismatchError,
    NoModelError,
    built_without_model,
    has_model,
    load_model,
    output_fields,
    with_output,
)
from retrieval.index.search import gallery_root, public_path
from retrieval.index.shards import ShardStore
from retrieval.index.sources import (
    IMAGE_EXTENSIONS,
    Gallery,
    GalleryItem,
    apply_label_rule,
    default_label_rule,
    is_utf8,
    label_summary,
    list_gallery,
    printable_path,
)
from retrieval.index.vectors import faiss_mismatch
from retrieval.near_duplicates import DuplicateCheck

if TYPE_CHECKING:
    from retrieval.index.milvus_collection import MilvusPlace

log = logging.getLogger(__name__)


class FinishedIndexError(FileExistsError):
    """A build into a folder that holds a finished index: add images to it instead, or build elsewhere."""


class NothingToRepairError(FileNotFoundError):
    """A repair of a folder where no build was started: build it first."""


class LabelRuleMismatch(ParameterError):
    """``label_from`` differs from the rule the index records; the index can be relabelled by it first."""

    def __init__(self, given: str, recorded: str) -> None:
        super().__init__("label_from", f"{given} is not the rule this index labels its images by, {recorded}; give "
                                       "that rule (or leave it out), or relabel the whole index first (nothing is "
                                       "re-embedded)")
        self.given, self.recorded = given, recorded


def _summary(catalogue: Catalogue, started: float, mended: Mapping[str, int]) -> dict[str, Any]:
    counts = catalogue.counts()
    return {
        "indexed": counts[Status.DONE.value],
        "errors": catalogue.error_count(),
        "duplicates": counts[Status.DUPLICATE.value],
        "removed": counts[Status.REMOVED.value],
        "pending": counts[Status.PENDING.value],
        "reconciled_rows": mended.get("reconciled", 0),
        "repointed_rows": mended.get("repointed", 0),
        "requeued_rows": mended.get("requeued", 0),
        "not_listed": counts["not_listed"],
        "error_examples": catalogue.error_examples(10),
        "duplicate_examples": catalogue.problems(Status.DUPLICATE, 10),
        "seconds": round(time.perf_counter() - started, 2),
    }


def _tally(catalogue: Catalogue) -> dict[str, int]:
    """The counts ``index add`` reports as what it did: their change over the call."""
    counts = catalogue.counts()
    return {"added": counts[Status.DONE.value], "errors": catalogue.error_count(),
            "duplicates": counts[Status.DUPLICATE.value]}


SIMILARITY = "inner product of L2-normalised vectors (cosine)"


def _model_fields(embedder: ImageEmbedder, model_path: str | None, index_root: Path | None = None) -> dict[str, Any]:
    """index.json's record of the model (``index_root``: the index folder, which its path is recorded from too)."""
    return {
        "model_path": str(Path(model_path).resolve()) if model_path else None,
        # found again after the index folder and the model moved together (``portable.find_model``)
        MODEL_RELATIVE: relative_to_index(model_path, index_root) if model_path and index_root else None,
        "model_hash": embedder.model_hash,
        # the PyTorch weights it was exported from: a model trained compatible with a checkpoint names these
        "source_model_hash": (getattr(embedder, "metadata", None) or {}).get("source_model_hash"),
        "embedding_dim": int(embedder.embedding_dim),
        "model_normalized": bool(embedder.normalized),
        "similarity": SIMILARITY,
        **output_fields(embedder),  # which output made the vectors (a compatible one: into an old model's space)
    }


def meta_values(fields: Mapping[str, Any]) -> dict[str, str]:
    """Model fields as catalogue meta values (strings; a list as JSON), those that are None left out."""
    return {key: json.dumps(value) if isinstance(value, list) else str(value)
            for key, value in fields.items() if value is not None}


def _info_from_meta(catalogue: Catalogue) -> dict[str, Any]:
    """The model and gallery fields of ``index.json``, from what the build recorded when it started."""
    get = catalogue.get_meta
    info = {
        "model_path": get("model_path"),
        **({MODEL_RELATIVE: get(MODEL_RELATIVE)} if get(MODEL_RELATIVE) is not None else {}),
        "model_hash": get("model_hash"),
        "embedding_dim": int(get("embedding_dim") or 0),
        "model_normalized": get("model_normalized") == "True",
        "similarity": get("similarity"),
    }
    if get("gallery_root") is not None:
        info["gallery_root"] = get("gallery_root")
    if get(GALLERY_RELATIVE) is not None:
        info[GALLERY_RELATIVE] = get(GALLERY_RELATIVE)
    if get("source_model_hash") is not None:
        info["source_model_hash"] = get("source_model_hash")
    if get("model_output") is not None:
        info["model_output"] = get("model_output")
    if get("model_output_space") is not None:
        info["model_output_space"] = json.loads(get("model_output_space"))
    for key in ("source", "embeddings_dir"):  # built from embeddings: no model, and where its vectors came from
        if get(key) is not None:
            info[key] = get(key)
    return info


def _check_same_model(catalogue: Catalogue, embedder: ImageEmbedder, root: Path) -> ImageEmbedder:
    """The index's own model, embedding with the output its vectors came from; another model is refused."""
    built_by = catalogue.get_meta("model_hash")
    if built_by is not None and built_by != embedder.model_hash:
        raise ModelMismatchError(
            f"{root} was started with model {catalogue.get_meta('model_path')} (model_hash {built_by}) "
            f"but this "
            f"model has model_hash {embedder.model_hash}; use the same model, or upgrade the index to this one "
            f"(retrieval index upgrade {root}), which re-embeds its gallery while it keeps answering"
        )
    # vectors a compatible output made (an old model's space) are added to with that output
    return with_output(embedder, catalogue.get_meta("model_output")) if built_by is not None else embedder


def _rerecord(layout: IndexLayout, catalogue: Catalogue, fields: Mapping[str, str]) -> dict[str, str]:
    """``fields`` recorded in the catalogue's meta and in index.json (where it is readable); returns them."""
    catalogue.set_meta(**fields)
    info = _readable_info(layout)
    if info is not None:
        layout.write_info(info | dict(fields))
    return dict(fields)


def relocate(layout: IndexLayout, catalogue: Catalogue, gallery_root: str | Path | None = None) -> dict[str, str]:
    """Follow a moved gallery (``portable.gallery_place``: moved with the index folder, or to ``gallery_root``):
    the catalogue's paths under the recorded root are put under the new one, and the record names it. Returns the
    index.json fields that changed (none: it did not move). Caller holds the writer lock."""
    info = _readable_info(layout) or {}
    recorded = {key: catalogue.get_meta(key) or info.get(key) for key in ("gallery_root", GALLERY_RELATIVE)}
    place = gallery_place(recorded, _gallery_root_of(recorded, catalogue), layout.root, gallery_root)
    if not place.moved:
        return {}
    moved = catalogue.rebase_paths(str(place.recorded), str(place.root))
    fields = {"gallery_root": str(place.root), GALLERY_RELATIVE: relative_to_index(place.root, layout.root)}
    listed = catalogue.get_meta("gallery_images")  # what repair --label-from lists again
    if listed is not None and place.file(listed) is not None:
        catalogue.set_meta(gallery_images=place.file(listed))
    log.info("%s: its gallery moved from %s to %s (%d catalogued paths follow)", layout.root, place.recorded,
             place.root, moved)
    return _rerecord(layout, catalogue, fields)


def _gallery_root_of(record: Mapping[str, Any], catalogue: Catalogue) -> PurePath:
    """The gallery root ``record`` names, else the one its catalogue's paths share (``search.gallery_root``)."""
    return gallery_root({key: value for key, value in record.items() if value is not None}, catalogue)


def _recorded_model(layout: IndexLayout, catalogue: Catalogue, record: Mapping[str, Any]) -> tuple[
        ImageEmbedder, dict[str, str]]:
    """The index's own model, found by its hash (``portable.find_model``: the folders may have moved), and the
    fields that now record where it was found (none: where it was recorded)."""
    if not record.get("model_path"):
        raise ParameterError("model", "is needed: this index records no model path")
    path = find_model(record, layout.root)
    embedder = load_model(path)
    if embedder.model_hash != record.get("model_hash"):  # replaced since it was hashed: never embed with another model
        raise ParameterError("model", f"is needed: the file {path} has model_hash {embedder.model_hash}, not "
                                      f"{record.get('model_hash')}, the index's; give that one")
    found = str(path.resolve())
    if found == record.get("model_path") and record.get(MODEL_RELATIVE) is not None:
        return embedder, {}
    return embedder, _rerecord(layout, catalogue, {"model_path": found,
                                                   MODEL_RELATIVE: relative_to_index(found, layout.root)})


def _labelled(images: str | Path, split: str | None, catalogue: Catalogue, label_from: str | None,
              ) -> tuple[Gallery, str]:
    """The gallery and the label rule it was labelled with: ``label_from``, else the one the index recorded (where
    it applies to this kind of source), else the kind's default; an index keeps the rule of its first listing."""
    gallery = list_gallery(images, split)
    recorded = catalogue.get_meta("label_from")
    rule = label_from or recorded
    if rule is None or (label_from is None and rule == "manifest" and gallery.kind != "manifest"):
        rule = default_label_rule(gallery.kind)
    if recorded is not None and label_from is not None and label_from != recorded:
        raise LabelRuleMismatch(label_from, recorded)
    with parameters_named(rule="label_from"):
        apply_label_rule(gallery, rule)
    if recorded is None:
        catalogue.set_meta(label_from=rule)
    return gallery, rule


def _list(images: str | Path, split: str | None, catalogue: Catalogue, label_from: str | None = None,
          ) -> tuple[Gallery, str]:
    gallery, rule = _labelled(images, split, catalogue, label_from)
    if not gallery.items:
        example = f"; e.g. {gallery.errors[0].path}: {gallery.errors[0].error}" if gallery.errors else ""
        raise ValueError(
            f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found in {images}"
            f"{f' ({len(gallery.errors)} paths could not be listed{example})' if gallery.errors else ''}"
        )
    return gallery, rule


def _inconsistency(layout: IndexLayout, catalogue: Catalogue, store: ShardStore) -> str | None:
    """Why a finished index is not whole (unembedded rows, lost vectors, faiss off the catalogue), or None."""
    if not layout.faiss.is_file() or not layout.info.is_file():
        return "its faiss part or index.json is missing"
    pending = catalogue.counts()[Status.PENDING.value]
    if pending:
        return f"{pending} catalogued images were never embedded"
    missing = missing_vectors(catalogue, store)
    if missing:
        return f"{len(missing)} indexed images have no vector in their shard"
    try:
        index = faiss_files.read_index(layout.faiss)
    except RuntimeError as exc:
        return f"its faiss part cannot be read ({str(exc).splitlines()[0]})"
    return faiss_mismatch(index, catalogue.done_shards())


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
) -> dict[str, Any]:
    """Build (or finish an interrupted build of) an index of the images in ``out``; returns a summary.

    ``label_from`` (``sources.LABEL_RULES``): where an image's label comes from; default: its folder's name (a
    folder) or the label column (a manifest). The summary says which classes it found.

    ``options.engine`` chooses who decodes and embeds (``local``, or ``ray`` on a Ray cluster); every
    engine writes the same folder layout, so an index is resumed, searched and updated the same way.

    ``milvus`` (with ``options.engine`` ray and a Milvus server): the Ray actors write the vectors straight into
    that collection (``milvus_build``; ``milvus_index_type``: its vector index, default AUTOINDEX) and ``out``
    keeps the catalogue and the model's record, no shards and no faiss index.
    """
    started = time.perf_counter()
    options = options or IngestOptions()
    if milvus is not None:
        from retrieval.index.milvus_build import check_build_place

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
            _refuse_finished(layout, catalogue, store)
        if state is not None:
            if catalogue.get_meta("source") == EMBEDDINGS_SOURCE:
                raise FileExistsError(
                    f"{layout.root} holds an interrupted build from the embeddings in "
                    f"{catalogue.get_meta('embeddings_dir')}; finish that one (run it again, or "
                    f"`{repair_command(layout.root)}`), or build from images into another folder")
            embedder = _check_same_model(catalogue, embedder, layout.root)
            _check_same_place(catalogue, milvus, layout.root)
            if milvus is None:
                _check_same_key(catalogue, index_key, layout.root)
        gallery, rule = _list(images, split, catalogue, label_from)
        if state is None:
            fields = _model_fields(embedder, str(model) if model else None, layout.root)
            catalogue.set_meta(state="building", index_key=index_key, **meta_values(fields),
                               **_collection_meta(milvus, embedder))
        if catalogue.get_meta("gallery_root") is None:  # what repair re-lists if planning never finished
            catalogue.set_meta(
                gallery_root=gallery.root, gallery_images=str(Path(images).expanduser().resolve()),
                **{GALLERY_RELATIVE: relative_to_index(gallery.root, layout.root)},
                **({"gallery_split": split} if split is not None else {}),
            )
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        if milvus is not None:
            built = _build_into_collection(layout, catalogue, store, engine, embedder, options, milvus,
                                           milvus_index_type)
            return {"index_dir": str(layout.root), **built, "labels": label_summary(gallery, rule),
                    **_summary(catalogue, started, {})}
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        built = _publish_faiss(layout, catalogue, store, index_key, int(embedder.embedding_dim), gpu, options,
                               engine.add_vectors)
        return {
            "index_dir": str(layout.root),
            "index_key": built["index_key"],
            "params": built["params"],
            **({"budget": built["budget"]} if "budget" in built else {}),
            "labels": label_summary(gallery, rule),
            **_summary(catalogue, started, mended),
        }


def _check_same_place(catalogue: Catalogue, milvus: MilvusPlace | None, root: Path) -> None:
    """A resumed build writes its vectors where it started: into shards here, or into its Milvus collection."""
    if milvus is not None or catalogue.get_meta(VECTORS_IN) is not None:
        from retrieval.index.milvus_build import check_same_place

        check_same_place(catalogue, milvus, root)


def _collection_meta(milvus: MilvusPlace | None, embedder: ImageEmbedder) -> dict[str, str]:
    """The catalogue's record of the collection a build writes into, made before the collection is: a collection
    this folder did not record is someone else's (``milvus_build.start``)."""
    if milvus is None:
        return {}
    from retrieval.index.milvus_build import recorded_place
    from retrieval.index.milvus_push import physical_name

    return {VECTORS_IN: json.dumps(recorded_place(milvus, physical_name(milvus.collection, embedder.model_hash)))}


MAX_RESENDS = 2  # passes over rows the collection lost between the writers and the final count (none expected)


def _build_into_collection(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, engine: Any,
                           embedder: ImageEmbedder, options: IngestOptions, milvus: MilvusPlace,
                           index_type: str | None) -> dict[str, Any]:
    """The Ray actors embed the pending rows into the collection, which is then named; index.json (no faiss part)
    and the catalogue's state record it."""
    info = _info_from_meta(catalogue)
    build = _ingest_into_collection(catalogue, store, engine, embedder, options, milvus, index_type, info)
    built = {"index_key": f"Milvus {build.record.index_type}", "params": {}, VECTORS_IN: build.where}
    layout.write_info(info | built)
    catalogue.set_meta(state="complete")
    return built


def _ingest_into_collection(catalogue: Catalogue, store: ShardStore, engine: Any, embedder: ImageEmbedder,
                            options: IngestOptions, milvus: MilvusPlace, index_type: str | None,
                            info: Mapping[str, Any]) -> Any:
    """Embed the pending rows into the collection (created, or the one this folder started); once it holds exactly
    the done rows it is marked complete and named (``milvus_build``). Returns the ``CollectionBuild``."""
    from retrieval.index import milvus_build
    from retrieval.index.milvus_collection import connect
    from retrieval.index.milvus_push import preprocessing_of
    from retrieval.index.ray_collection import write_into

    client = connect(milvus)
    try:
        build = milvus_build.start(client, milvus, catalogue, dict(info) | {"index_key": "Milvus"}, index_type,
                                   preprocessing_of(embedder.model_config))
        write_into(engine, build, client)
        for _ in range(MAX_RESENDS + 1):
            ingest(engine, catalogue, store, embedder, options)
            lost = milvus_build.reconcile(client, build.physical, catalogue)
            if not lost:
                break
            log.warning("%d indexed images are not in %s; sending them again", len(lost), build.physical)
            catalogue.record([Outcome(i, Status.PENDING) for i in lost])
        else:
            raise RuntimeError(f"{build.physical} at {milvus.uri} keeps losing rows after they were written; check "
                               "the Milvus server, then run the command again")
        milvus_build.finish(client, build, catalogue.counts()[Status.DONE.value])
    finally:
        client.close()
    return build


def _recorded_collection(info: Mapping[str, Any]) -> MilvusPlace:
    """The collection an index built into Milvus keeps its vectors in (index.json's ``VECTORS_IN``)."""
    from retrieval.index.milvus_collection import MilvusPlace

    where = info[VECTORS_IN]
    return MilvusPlace(str(where["milvus"]), str(where["collection"]))


def _add_into_collection(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, engine: Any,
                         embedder: ImageEmbedder, options: IngestOptions, info: dict[str, Any],
                         duplicates: DuplicateCheck) -> dict[str, Any]:
    """``add_images`` of an index whose vectors are in Milvus: the Ray actors write the new rows into its
    collection, which serves them as they come; the near-duplicate check, which reads the folder's vectors, is
    not made."""
    if options.engine != "ray":
        raise ParameterError("engine", f"is {options.engine}, but {layout.root} keeps its vectors in Milvus, where "
                                       "only the ray engine's actors write them: add with the ray engine")
    if duplicates.duplicates == "skip":
        raise ParameterError("duplicates", "skip compares the new images with the vectors in the folder, and this "
                                           "index keeps its vectors in Milvus: add with report or off")
    build = _ingest_into_collection(catalogue, store, engine, embedder, options, _recorded_collection(info), None,
                                    info)
    layout.write_info(info)
    return {"index_key": info.get("index_key"), VECTORS_IN: build.where}


def _refuse_collection_repair(layout: IndexLayout, catalogue: Catalogue) -> None:
    """Repair mends shards and faiss, which an index built into Milvus has none of: its build command resumes it
    (an unfinished one), and its writers check its collection's rows against the catalogue (a finished one)."""
    recorded = catalogue.get_meta(VECTORS_IN)
    if recorded is None:
        return
    where = json.loads(recorded)
    if catalogue.get_meta("state") == "complete":
        from retrieval.index.layout import VectorsInMilvusError

        raise VectorsInMilvusError(layout.root, where)
    raise FileExistsError(f"{layout.root} holds an interrupted build into the Milvus collection "
                          f"{where['collection']} at {where['milvus']}, which has no shards to mend: finish it by "
                          "running its build command again (the ray engine, into the same collection)")


def _remove_from_collection(catalogue: Catalogue, info: Mapping[str, Any], ids: Sequence[int]) -> dict[str, Any]:
    """``remove_images`` of an index whose vectors are in Milvus: the rows leave its collection, and every server
    stops finding them at its next request."""
    from retrieval.index import milvus_build
    from retrieval.index.milvus_collection import connect

    place = _recorded_collection(info)
    client = connect(place)
    try:
        physical = str(info[VECTORS_IN]["physical"])
        milvus_build.delete_ids(client, physical, sorted(set(ids)))
        milvus_build.reconcile(client, physical, catalogue)  # and what a removal killed midway left
    finally:
        client.close()
    return {"index_key": info.get("index_key"), VECTORS_IN: info[VECTORS_IN]}


def _refuse_finished(layout: IndexLayout, catalogue: Catalogue, store: ShardStore,
                     advice: str = "add images to it, or build into another folder") -> NoReturn:
    """A build into a folder that holds a finished index: refused, pointing at repair when it is not whole."""
    problem = _inconsistency(layout, catalogue, store)
    if problem is not None:
        raise FileExistsError(
            f"{layout.root} already holds a finished index, but {problem}; run "
            f"`{repair_command(layout.root)}` to mend it"
        )
    raise FinishedIndexError(f"{layout.root} already holds a finished index; {advice}")


def _check_same_key(catalogue: Catalogue, index_key: str, root: Path) -> None:
    """A resumed build keeps the index key it started with."""
    if catalogue.get_meta("index_key") != index_key:
        raise ParameterError(
            "index_key", f"{index_key} differs from {catalogue.get_meta('index_key')}, the key the "
            f"interrupted build in {root} used; rerun with that key, or build into another folder"
        )


def _publish_faiss(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, index_key: str, dim: int,
                   gpu: bool, options: IngestOptions, add_vectors: AddVectors | None = None) -> dict[str, Any]:
    """A build's last step: faiss built from the shards, then index.json, then the catalogue marks it complete."""
    log.info("building the faiss index of %s", layout.root)
    with parameters_named(key_request="index_key"):
        built = build_faiss(layout, catalogue, store, index_key, dim, gpu, policy=options.policy,
                            add_vectors=add_vectors)
    layout.write_info(_info_from_meta(catalogue) | built)
    catalogue.set_meta(state="complete")
    return built


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
            _refuse_finished(layout, catalogue, store, "build into another folder (an index built from embeddings "
                                                       "takes no additions: build it again from the whole set)")
        if state is not None:
            _check_same_input(catalogue, source, layout.root)
            _check_same_key(catalogue, index_key, layout.root)
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
        built = _publish_faiss(layout, catalogue, store, index_key, source.dim, gpu, options)
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
            **_summary(catalogue, started, mended),
        }


def _check_same_input(catalogue: Catalogue, source: EmbeddingsInput, root: Path) -> None:
    """A resumed build from embeddings reads the input it started with, unchanged."""
    if catalogue.get_meta("source") != EMBEDDINGS_SOURCE:
        raise FileExistsError(f"{root} holds an interrupted build from images; finish it (`{repair_command(root)}`), "
                              "or build from embeddings into another folder")
    if catalogue.get_meta("embeddings_fingerprint") != source.fingerprint:
        raise FileExistsError(
            f"the embeddings in {source.root} are not those the interrupted build in {root} started from (it read "
            f"{catalogue.get_meta('embeddings_dir')}; parts were added, removed or rewritten since); give that input "
            "as it was, or build into another folder")


def _reopen_input(catalogue: Catalogue, root: Path) -> EmbeddingsInput:
    """The embeddings an unfinished build from embeddings started from, for the rows that still need their vectors."""
    recorded = catalogue.get_meta("embeddings_dir")
    pending = catalogue.counts()[Status.PENDING.value]
    try:
        source = open_embeddings(recorded)
    except ValueError as exc:
        raise ValueError(f"{pending} images of {root} still need their vectors, read from the embeddings its build "
                         f"started from ({recorded}), which cannot be read now: {exc}") from exc
    _check_same_input(catalogue, source, root)
    return source


def _require_complete(layout: IndexLayout, catalogue: Catalogue, upgrading: bool = False,
                      vectors_in_milvus: bool = False) -> dict[str, Any]:
    """index.json of a finished index (``add``/``remove`` work only on one, and not during an upgrade unless
    ``upgrading``: the upgrade itself; ``vectors_in_milvus``: one whose vectors are in a Milvus collection too),
    else the error naming the command that finishes it."""
    layout.require_finished(vectors_in_milvus)
    if catalogue.get_meta("state") != "complete":
        raise layout.unfinished()
    under_way = catalogue.get_meta(UPGRADE_MODEL_PATH)
    if under_way is not None and not upgrading:
        raise IndexLockedError(
            f"{layout.root} is being upgraded to the model {under_way}; finish that first (retrieval index upgrade "
            f"{layout.root}, which resumes it), then run your command again")
    return layout.read_info()


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
        info = _require_complete(layout, catalogue, vectors_in_milvus=True)
        if not has_model(info):
            raise NoModelError(f"{built_without_model(layout.root)}: images cannot be added to it, as nothing can "
                               "embed them into the space of its vectors; build it again from embeddings that hold "
                               "the new images too, or build an index of all the images with a model")
        info |= relocate(layout, catalogue, gallery_root)  # before the new images are planned beside the old
        if embedder is None and model is not None:
            embedder = load_model(model)
        elif embedder is None:
            embedder, found = _recorded_model(layout, catalogue, info)
            info |= found
        embedder = _check_same_model(catalogue, embedder, layout.root)
        gallery, rule = _labelled(images, split, catalogue, label_from)
        if check_new is not None:
            check_new(gallery.items)
        before = _tally(catalogue)
        catalogue.plan(gallery.items, gallery.source, gallery.errors)
        store = ShardStore(layout.shards)
        if VECTORS_IN in info:
            updated = _add_into_collection(layout, catalogue, store, engine, embedder, options, info, duplicates)
            this_run = {key: value - before[key] for key, value in _tally(catalogue).items()}
            return {"index_dir": str(layout.root), **updated, "labels": label_summary(gallery, rule),
                    "this_run": this_run, "near_duplicates": None, **_summary(catalogue, started, {})}
        mended = mend(catalogue, store)
        ingest(engine, catalogue, store, embedder, options)
        near = check_new_images(layout, catalogue, store, info, duplicates)  # before faiss holds the new images
        updated = update_faiss(layout, catalogue, store, info, gpu, policy=options.policy)
        layout.write_info(info | updated)
        this_run = {key: value - before[key] for key, value in _tally(catalogue).items()}
        return {"index_dir": str(layout.root), **updated, "labels": label_summary(gallery, rule),
                "this_run": this_run, "near_duplicates": near, **_summary(catalogue, started, mended)}


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
        info = _require_complete(layout, catalogue, vectors_in_milvus=True)
        wanted = [int(i) for i in ids]
        if paths:
            info |= relocate(layout, catalogue, gallery_root)
            root = info.get("gallery_root") or catalogue.get_meta("gallery_root")
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
        if VECTORS_IN in info:
            updated = _remove_from_collection(catalogue, info, wanted)
        else:
            store = ShardStore(layout.shards)
            updated = update_faiss(layout, catalogue, store, info, policy=policy)
            layout.write_info(info | updated)
        return {
            "index_dir": str(layout.root),
            "removed_ids": sorted(set(wanted)),
            **updated,
            **_summary(catalogue, started, {}),
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


def relabel(catalogue: Catalogue, rule: str) -> dict[str, Any]:
    """Label the images of the index's recorded gallery by ``rule`` (labels only: nothing is re-embedded). Images
    that ``index add`` took from other folders keep their labels."""
    source = catalogue.get_meta("gallery_images")
    if source is None:
        raise ValueError("this index records no gallery folder or manifest to relabel from; build it again, "
                         "labelled by the rule you want")
    gallery = apply_label_rule(list_gallery(source, catalogue.get_meta("gallery_split")), rule)
    changed = catalogue.set_labels([(item.path, item.label) for item in gallery.items])
    catalogue.set_meta(label_from=rule)
    return {**label_summary(gallery, rule), "relabelled": changed}


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
        _refuse_collection_repair(layout, catalogue)
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
            gallery, _ = _list(source, catalogue.get_meta("gallery_split"), catalogue)
            catalogue.plan(gallery.items, gallery.source, gallery.errors)
        if catalogue.counts()[Status.PENDING.value] and from_embeddings:
            _reopen_input(catalogue, layout.root).copy_pending(catalogue, store, options.shard_size, options.progress)
        elif catalogue.counts()[Status.PENDING.value]:
            if embedder is None and model is not None:
                embedder = load_model(model)
            elif embedder is None:
                if catalogue.get_meta("model_path") is None:
                    raise ParameterError(
                        "model", f"is needed: {catalogue.counts()[Status.PENDING.value]} images of {layout.root} "
                        "need embedding and the index records no model path"
                    )
                record = {key: catalogue.get_meta(key) for key in ("model_path", MODEL_RELATIVE, "model_hash")}
                embedder, _ = _recorded_model(layout, catalogue, record)
            embedder = _check_same_model(catalogue, embedder, layout.root)
            ingest(engine, catalogue, store, embedder, options)
        info = _info_from_meta(catalogue)
        old = _readable_info(layout) if state == "complete" else None
        index = _readable_faiss(layout) if old is not None and not rebuild else None
        if old is not None and index is not None:
            updated = update_faiss(layout, catalogue, store, old, gpu, index=index, policy=options.policy)
            info = old | updated
        else:
            key = old["index_key"] if old is not None else catalogue.get_meta("index_key") or "auto"
            built = build_faiss(
                layout, catalogue, store, key, info["embedding_dim"], gpu,
                policy=options.policy, add_vectors=engine.add_vectors,
            )
            if old is not None:
                built["index_key_requested"] = old.get("index_key_requested", key)
            info = (old or {}) | info | built
        layout.write_info(info)
        catalogue.set_meta(state="complete")
        return {
            "index_dir": str(layout.root),
            "index_key": info["index_key"],
            "faiss": info.get("updated_by", "rebuilt from the shards"),
            "vectors": info["count"],
            **({"labels": labels} if labels is not None else {}),
            **_summary(catalogue, started, mended),
        }


def _readable_info(layout: IndexLayout) -> dict[str, Any] | None:
    try:
        info = layout.read_info()
    except (OSError, ValueError):
        return None
    return info if "index_key" in info and "embedding_dim" in info else None


def _readable_faiss(layout: IndexLayout) -> faiss.Index | None:
    try:
        return faiss_files.read_index(layout.faiss)
    except RuntimeError:  # missing or damaged: rebuilt from the shards
        return None
