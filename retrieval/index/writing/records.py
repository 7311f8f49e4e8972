"""What the index writers share: what an index folder records (its model's fields, the catalogue's meta, the
summary a writer returns), the checks every writer makes before it writes (the same model, key and input; a
finished or unfinished folder), the gallery listed and labelled, and the faiss part published."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import faiss

from retrieval.data.manifest_columns import DEFAULT_LABEL_COLUMN, present_rows
from retrieval.errors import ParameterError, parameters_named
from retrieval.index.catalogue import UPGRADE_MODEL_PATH, Catalogue, Status
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.faiss_backend import faiss_files
from retrieval.index.faiss_backend.faiss_build import AddVectors, build_faiss
from retrieval.index.faiss_backend.faiss_params import faiss_mismatch
from retrieval.index.formats.embedding_input import EmbeddingsInput, open_embeddings
from retrieval.index.layout import IndexLayout, IndexLockedError, repair_command
from retrieval.index.portable import GALLERY_RELATIVE, MODEL_RELATIVE, find_model, gallery_place, relative_to_index
from retrieval.index.query_embedder import (
    EMBEDDINGS_SOURCE,
    LEGACY_MODEL_KEY,
    PARENT_MODEL_KEY,
    ImageEmbedder,
    ModelMismatchError,
    hash_matches,
    legacy_hash,
    load_model,
    output_fields,
    with_output,
)
from retrieval.index.search import gallery_root as recorded_gallery_root  # ``relocate``'s parameter hides the name
from retrieval.index.shards import ShardStore
from retrieval.index.sources import (
    IMAGE_EXTENSIONS,
    Gallery,
    apply_label_rule,
    default_label_rule,
    label_summary,
    list_gallery,
)
from retrieval.index.writing.mend import missing_vectors
from retrieval.records.index_info import IndexInfo

log = logging.getLogger(__name__)

LABEL_COLUMN = "label_column"  # the catalogue's meta and index.json: the manifest column the labels come from




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


def writer_summary(catalogue: Catalogue, started: float, mended: Mapping[str, int]) -> dict[str, Any]:
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


def tally(catalogue: Catalogue) -> dict[str, int]:
    """The counts ``index add`` reports as what it did: their change over the call."""
    counts = catalogue.counts()
    return {"added": counts[Status.DONE.value], "errors": catalogue.error_count(),
            "duplicates": counts[Status.DUPLICATE.value]}


SIMILARITY = "inner product of L2-normalised vectors (cosine)"


def model_fields(embedder: ImageEmbedder, model_path: str | None, index_root: Path | None = None) -> dict[str, Any]:
    """index.json's record of the model (``index_root``: the index folder, which its path is recorded from too)."""
    return {
        "model_path": str(Path(model_path).resolve()) if model_path else None,
        # found again after the index folder and the model moved together (``portable.find_model``)
        MODEL_RELATIVE: relative_to_index(model_path, index_root) if model_path and index_root else None,
        "model_hash": embedder.model_hash,
        # what a declaration written by an earlier version names the model by (``is_compatible``)
        LEGACY_MODEL_KEY: legacy_hash(embedder),
        # the PyTorch weights it was exported from: a model trained compatible with a checkpoint names these
        "source_model_hash": (getattr(embedder, "metadata", None) or {}).get("source_model_hash"),
        # an int8 model's fp32 parent, which may search what it built (measured when it was quantized)
        PARENT_MODEL_KEY: (getattr(embedder, "metadata", None) or {}).get(PARENT_MODEL_KEY),
        "embedding_dim": int(embedder.embedding_dim),
        "model_normalized": bool(embedder.normalized),
        "similarity": SIMILARITY,
        **output_fields(embedder),  # which output made the vectors (a compatible one: into an old model's space)
    }


def meta_values(fields: Mapping[str, Any]) -> dict[str, str]:
    """Model fields as catalogue meta values (strings; a list as JSON), those that are None left out."""
    return {key: json.dumps(value) if isinstance(value, list) else str(value)
            for key, value in fields.items() if value is not None}


def info_from_meta(catalogue: Catalogue) -> IndexInfo:
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
    for key in ("source_model_hash", LEGACY_MODEL_KEY, PARENT_MODEL_KEY):
        if get(key) is not None:
            info[key] = get(key)
    if get("model_output") is not None:
        info["model_output"] = get("model_output")
    if get("model_output_space") is not None:
        info["model_output_space"] = json.loads(get("model_output_space"))
    for key in ("source", "embeddings_dir"):  # built from embeddings: no model, and where its vectors came from
        if get(key) is not None:
            info[key] = get(key)
    if get(LABEL_COLUMN) is not None:  # the manifest column its labels come from: what `index add` reads them by
        info[LABEL_COLUMN] = get(LABEL_COLUMN)
    if get("text_columns") is not None and get("keyword_index") is not None:  # keyword_build's record
        info["text_columns"] = json.loads(get("text_columns"))
        info["keyword_index"] = get("keyword_index")
    return IndexInfo.from_json(info)


def check_same_model(catalogue: Catalogue, embedder: ImageEmbedder, root: Path) -> ImageEmbedder:
    """The index's own model, embedding with the output its vectors came from; another model is refused."""
    built_by = catalogue.get_meta("model_hash")
    if built_by is not None and not hash_matches(built_by, embedder):
        raise ModelMismatchError(
            f"{root} was started with model {catalogue.get_meta('model_path')} (model_hash {built_by}) "
            f"but this "
            f"model has model_hash {embedder.model_hash}; use the same model, or upgrade the index to this one "
            f"(retrieval index upgrade {root}), which re-embeds its gallery while it keeps answering"
        )
    # vectors a compatible output made (an old model's space) are added to with that output
    return with_output(embedder, catalogue.get_meta("model_output")) if built_by is not None else embedder


def rerecord(layout: IndexLayout, catalogue: Catalogue, fields: Mapping[str, str]) -> dict[str, str]:
    """``fields`` recorded in the catalogue's meta and in index.json (where it is readable); returns them."""
    catalogue.set_meta(**fields)
    info = readable_info(layout)
    if info is not None:
        layout.write_info(info.with_fields(fields))
    return dict(fields)


def relocate(layout: IndexLayout, catalogue: Catalogue, gallery_root: str | Path | None = None) -> dict[str, str]:
    """Follow a moved gallery (``portable.gallery_place``: moved with the index folder, or to ``gallery_root``):
    the catalogue's paths under the recorded root are put under the new one, and the record names it. Returns the
    index.json fields that changed (none: it did not move). Caller holds the writer lock."""
    info = (readable_info(layout) or IndexInfo()).catalogue
    recorded = IndexInfo.from_json({"gallery_root": catalogue.get_meta("gallery_root") or info.gallery_root,
                                    GALLERY_RELATIVE: catalogue.get_meta(GALLERY_RELATIVE) or info.gallery_relative})
    place = gallery_place(recorded, recorded_gallery_root(recorded, catalogue), layout.root, gallery_root)
    if not place.moved:
        return {}
    moved = catalogue.rebase_paths(str(place.recorded), str(place.root))
    fields = {"gallery_root": str(place.root), GALLERY_RELATIVE: relative_to_index(place.root, layout.root)}
    listed = catalogue.get_meta("gallery_images")  # what repair --label-from lists again
    if listed is not None and place.file(listed) is not None:
        catalogue.set_meta(gallery_images=place.file(listed))
    log.info("%s: its gallery moved from %s to %s (%d catalogued paths follow)", layout.root, place.recorded,
             place.root, moved)
    return rerecord(layout, catalogue, fields)


def recorded_model(layout: IndexLayout, catalogue: Catalogue, record: IndexInfo) -> tuple[
        ImageEmbedder, dict[str, str]]:
    """The index's own model, found by its hash (``portable.find_model``: the folders may have moved), and the
    fields that now record where it was found (none: where it was recorded)."""
    model = record.model
    if not model.path:
        raise ParameterError("model", "is needed: this index records no model path")
    path = find_model(record, layout.root)
    embedder = load_model(path)
    if not hash_matches(model.hash, embedder):  # replaced since hashed: never embed with another model
        raise ParameterError("model", f"is needed: the file {path} has model_hash {embedder.model_hash}, not "
                                      f"{model.hash}, the index's; give that one")
    found = str(path.resolve())
    if found == model.path and model.relative is not None:
        return embedder, {}
    return embedder, rerecord(layout, catalogue, {"model_path": found,
                                                   MODEL_RELATIVE: relative_to_index(found, layout.root)})


def is_manifest(images: str | Path) -> bool:
    """Whether ``images`` names a manifest file (.csv or .parquet), as ``list_gallery`` reads one."""
    path = Path(images).expanduser()
    return path.suffix.lower() in (".csv", ".parquet") and path.is_file()


def labelled_images(images: str | Path, split: str | None, catalogue: Catalogue, label_from: str | None,
                    label_column: str | None = None, look_for_files: bool = True) -> tuple[Gallery, str]:
    """The gallery and the label rule it was labelled with: ``label_from``, else the one the index recorded (where
    it applies to this kind of source), else the kind's default; an index keeps the rule of its first listing, and
    the manifest column its labels come from (``label_column``, else the recorded one, else 'label'). With
    ``look_for_files``, a manifest's images are looked for before anything is recorded (``check_files``)."""
    recorded_column = catalogue.get_meta(LABEL_COLUMN)
    if label_column is not None and recorded_column is not None and label_column != recorded_column:
        raise ParameterError("label_column", f"is {label_column!r}, but this index reads its labels from the "
                                             f"manifest column {recorded_column!r}; give that one, or build a new "
                                             "index")
    try:
        gallery = list_gallery(images, split, label_column or named_label_column(catalogue, images))
    except ParameterError as exc:
        if exc.param != "label_column" or label_column is not None:
            raise
        raise ValueError(f"this index reads its labels from the manifest column {recorded_column!r} (index.json's "
                         f"{LABEL_COLUMN}), and {exc.problem.removeprefix('names ')}") from exc
    recorded = catalogue.get_meta("label_from")
    rule = label_from or recorded
    if rule is None or (label_from is None and rule == "manifest" and gallery.kind != "manifest"):
        rule = default_label_rule(gallery.kind)
    if recorded is not None and label_from is not None and label_from != recorded:
        raise LabelRuleMismatch(label_from, recorded)
    if label_column is not None and rule != "manifest":
        raise ParameterError("label_column", f"reads the labels from a manifest column, and the labels come from "
                                             f"the rule {rule} (`label_from`): leave one out")
    with parameters_named(rule="label_from"):
        apply_label_rule(gallery, rule)
    if look_for_files:
        check_files(gallery, Path(images).expanduser().resolve())
    if recorded is None:
        catalogue.set_meta(label_from=rule)
    if (recorded_column is None and gallery.kind == "manifest" and rule == "manifest"
            and gallery.label_column != DEFAULT_LABEL_COLUMN):  # the default is not recorded: index.json as before
        catalogue.set_meta(**{LABEL_COLUMN: gallery.label_column})
    return gallery, rule


def named_label_column(catalogue: Catalogue, images: str | Path) -> str | None:
    """The manifest column the index reads ``images``' labels from where one other than the default was named at
    build (``label_column``); None for a folder, or where the default applies."""
    recorded = catalogue.get_meta(LABEL_COLUMN)
    return recorded if recorded not in (None, DEFAULT_LABEL_COLUMN) and is_manifest(images) else None


def check_files(gallery: Gallery, manifest: Path) -> None:
    """A manifest (``manifest``, the file ``gallery`` was listed from) whose images are not where it says (moved
    away from them): none there is refused in one line before anything is embedded; some missing make one warning
    (each is recorded as it is read)."""
    if gallery.kind != "manifest" or not gallery.items:
        return
    present = present_rows([item.path for item in gallery.items], manifest)  # the path: the line escapes it once
    if not present.missing:
        return
    if not present.kept:
        raise FileNotFoundError(f"no image to index: {present.line}")
    log.warning("%s", present.line)


def list_images(images: str | Path, split: str | None, catalogue: Catalogue, label_from: str | None = None,
                label_column: str | None = None, look_for_files: bool = True) -> tuple[Gallery, str]:
    """The gallery to build from, labelled (``labelled_images``), refused where it lists no image."""
    gallery, rule = labelled_images(images, split, catalogue, label_from, label_column, look_for_files)
    if not gallery.items:
        example = f"; e.g. {gallery.errors[0].path}: {gallery.errors[0].error}" if gallery.errors else ""
        raise ValueError(
            f"no images ({', '.join(sorted(IMAGE_EXTENSIONS))}) found in {images}"
            f"{f' ({len(gallery.errors)} paths could not be listed{example})' if gallery.errors else ''}"
        )
    return gallery, rule


def inconsistency(layout: IndexLayout, catalogue: Catalogue, store: ShardStore) -> str | None:
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


def refuse_finished(layout: IndexLayout, catalogue: Catalogue, store: ShardStore,
                     advice: str = "add images to it, or build into another folder") -> NoReturn:
    """A build into a folder that holds a finished index: refused, pointing at repair when it is not whole."""
    problem = inconsistency(layout, catalogue, store)
    if problem is not None:
        raise FileExistsError(
            f"{layout.root} already holds a finished index, but {problem}; run "
            f"`{repair_command(layout.root)}` to mend it"
        )
    raise FinishedIndexError(f"{layout.root} already holds a finished index; {advice}")


def check_same_key(catalogue: Catalogue, index_key: str, root: Path) -> None:
    """A resumed build keeps the index key it started with."""
    if catalogue.get_meta("index_key") != index_key:
        raise ParameterError(
            "index_key", f"{index_key} differs from {catalogue.get_meta('index_key')}, the key the "
            f"interrupted build in {root} used; rerun with that key, or build into another folder"
        )


def publish_faiss(layout: IndexLayout, catalogue: Catalogue, store: ShardStore, index_key: str, dim: int,
                   gpu: bool, options: IngestOptions, add_vectors: AddVectors | None = None) -> dict[str, Any]:
    """A build's last step: faiss built from the shards, then index.json, then the catalogue marks it complete."""
    log.info("building the faiss index of %s", layout.root)
    with parameters_named(key_request="index_key"):
        built = build_faiss(layout, catalogue, store, index_key, dim, gpu, policy=options.policy,
                            add_vectors=add_vectors)
    layout.write_info(info_from_meta(catalogue).with_fields(built))
    catalogue.set_meta(state="complete")
    return built


def require_complete(layout: IndexLayout, catalogue: Catalogue, upgrading: bool = False,
                      vectors_in_milvus: bool = False) -> IndexInfo:
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
    return layout.read_record()



def check_same_input(catalogue: Catalogue, source: EmbeddingsInput, root: Path) -> None:
    """A resumed build from embeddings reads the input it started with, unchanged."""
    if catalogue.get_meta("source") != EMBEDDINGS_SOURCE:
        raise FileExistsError(f"{root} holds an interrupted build from images; finish it (`{repair_command(root)}`), "
                              "or build from embeddings into another folder")
    if catalogue.get_meta("embeddings_fingerprint") != source.fingerprint:
        raise FileExistsError(
            f"the embeddings in {source.root} are not those the interrupted build in {root} started from (it read "
            f"{catalogue.get_meta('embeddings_dir')}; parts were added, removed or rewritten since); give that input "
            "as it was, or build into another folder")


def reopen_input(catalogue: Catalogue, root: Path) -> EmbeddingsInput:
    """The embeddings an unfinished build from embeddings started from, for the rows that still need their vectors."""
    recorded = catalogue.get_meta("embeddings_dir")
    pending = catalogue.counts()[Status.PENDING.value]
    try:
        source = open_embeddings(recorded)
    except ValueError as exc:
        raise ValueError(f"{pending} images of {root} still need their vectors, read from the embeddings its build "
                         f"started from ({recorded}), which cannot be read now: {exc}") from exc
    check_same_input(catalogue, source, root)
    return source


def readable_info(layout: IndexLayout) -> IndexInfo | None:
    """index.json's record where it is one of a built index (it holds the key and the size), else None."""
    try:
        info = layout.read_record()
    except (OSError, ValueError):
        return None
    return info if info.holds("index_key") and info.holds("embedding_dim") else None


def readable_faiss(layout: IndexLayout) -> faiss.Index | None:
    try:
        return faiss_files.read_index(layout.faiss)
    except RuntimeError:  # missing or damaged: rebuilt from the shards
        return None



def relabel(catalogue: Catalogue, rule: str) -> dict[str, Any]:
    """Label the images of the index's recorded gallery by ``rule`` (labels only: nothing is re-embedded). Images
    that ``index add`` took from other folders keep their labels."""
    source = catalogue.get_meta("gallery_images")
    if source is None:
        raise ValueError("this index records no gallery folder or manifest to relabel from; build it again, "
                         "labelled by the rule you want")
    gallery = apply_label_rule(list_gallery(source, catalogue.get_meta("gallery_split"),
                                            named_label_column(catalogue, source)), rule)
    changed = catalogue.set_labels([(item.path, item.label) for item in gallery.items])
    catalogue.set_meta(label_from=rule)
    return {**label_summary(gallery, rule), "relabelled": changed}
