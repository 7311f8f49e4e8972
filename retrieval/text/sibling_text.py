"""The text tower an image model names in its own metadata: `retrieval export --pretrained` writes a zero-shot
tower beside the model (``model.text.onnx``) and records its file name and hash in the model (``text_model``,
``text_model_hash``: annotations, which never change the model's hash); `retrieval index build` finds it there and
records it in the index as `retrieval index text` does, so an index of that model is searched by text with no other
step. No torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from retrieval.index.sources import printable_path
from retrieval.text.text_onnx import MAX_TEXT_MODEL_BYTES, TextModelError, TowerFile, read_tower

log = logging.getLogger(__name__)

# an image model's metadata: the text tower beside it (a file name in the model's folder) and that file's hash
IMAGE_TEXT_MODEL, IMAGE_TEXT_MODEL_HASH = "text_model", "text_model_hash"
# a text.onnx's metadata: where the tower comes from, and a zero-shot tower's classes (JSON, the head's row order)
TEXT_ORIGIN, ZERO_SHOT_CLASSES = "text_origin", "zero_shot_classes"
TRAINED, ZERO_SHOT, ADAPTED = "trained", "zero-shot", "adapted"
TEXT_SUFFIX = ".text.onnx"
MAX_NAME = 255  # a file name, as file systems bound it


def sibling_path(image_model: str | os.PathLike) -> Path:
    """Where the export writes an image model's text tower: beside it, ``model.onnx`` -> ``model.text.onnx``."""
    path = Path(image_model)
    return path.with_name(path.stem + TEXT_SUFFIX)


def read_model_metadata(image_model: str | os.PathLike) -> dict[str, str]:
    """An ONNX file's metadata_props, read without its external weights."""
    import onnx

    proto = onnx.load(str(image_model), load_external_data=False)
    return {entry.key: entry.value for entry in proto.metadata_props}


def named_text_model(image_model: str | os.PathLike,
                     metadata: Mapping[str, str]) -> tuple[TowerFile | None, str | None]:
    """The text tower ``image_model``'s metadata names, found beside it with the hash it names: ``(tower, None)``,
    the file as read and hashed (its bytes are what is run); ``(None, why)`` where it is named but not usable
    (missing, another hash, a name that is not a plain file name); ``(None, None)`` where the model names none."""
    name, wanted = metadata.get(IMAGE_TEXT_MODEL), metadata.get(IMAGE_TEXT_MODEL_HASH)
    if not name and not wanted:
        return None, None
    model = Path(image_model)
    shown = printable_path(str(model))
    if not name or not wanted or len(name) > MAX_NAME or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name:
        return None, (f"{shown} names a text model {printable_path(str(name or ''), 80)!r} (hash {wanted!r}) that "
                      "is not a file name beside it; its metadata was edited: export it again")
    path = model.parent / name
    if not path.is_file():
        return None, (f"{shown} names the text model {printable_path(name)} beside it, which is missing (it was "
                      "not copied with the model?): copy it beside the model")
    if path.stat().st_size > MAX_TEXT_MODEL_BYTES:
        return None, f"{printable_path(str(path))} is over 2 GiB: not the text tower {shown} names"
    try:
        tower = read_tower(path)  # a model exported before names it by its legacy hash
    except OSError as exc:
        return None, f"{printable_path(str(path))} cannot be read: {exc.strerror or exc}"
    if wanted not in tower.hashes:
        return None, (f"{printable_path(str(path))} has text_model_hash {tower.hashes[0]}, not {wanted}, the one "
                      f"{shown} names: it was replaced; export the model again, or record a text model with "
                      "`retrieval index text`")
    return tower, None


def record_named_text_model(index_dir: str | os.PathLike, image_model: str | os.PathLike) -> dict[str, Any] | None:
    """Record in the index the text tower its image model names (``named_text_model``), as `retrieval index text`
    does; None where the model names none, where the index records a text model already (kept), or where the
    tower cannot be used: then one warning says why, and the index stays as it is, searchable by image."""
    from retrieval.index.layout import IndexLayout
    from retrieval.text.text_index import record_text_model

    try:
        tower, problem = named_text_model(image_model, read_model_metadata(image_model))
    except Exception as exc:  # onnx's own kinds: a damaged file the build has read anyway
        tower, problem = None, f"the metadata of {printable_path(str(image_model))} cannot be read ({exc})"
    if tower is None:
        if problem:
            log.warning("no text model recorded: %s", problem)
        return None
    recorded = IndexLayout(index_dir).read_record().text.hash
    if recorded and recorded not in tower.hashes:
        log.info("the index records text model %s already: kept (not the one beside its model)", recorded)
        return None
    try:
        return record_text_model(index_dir, tower)
    except TextModelError as exc:
        log.warning("no text model recorded: %s", exc.problem)
        return None
