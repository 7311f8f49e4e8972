"""The text model an index is searched by text with: recorded in the index folder's index.json by `retrieval index
text`, found again after the folders move, and checked against the index's image model.

index.json records it as it records the image model (``retrieval.index.portable``): its absolute path
(``text_model_path``), its path from the index folder (``text_model_path_relative``: the folders moved together are
found again) and its identity (``text_model_hash``: ``TextEmbedder.model_hash``, or the file's sha256 an earlier
version recorded, which still names it: ``TextEmbedder.model_hashes``). A file named by neither is never loaded.

A tower fits an index whose vectors are in the space of the image model it was trained for
(``retrieval.text.text_onnx.check_text_model``): the index's own model, the space its compatible output embeds into,
or a model the index's model is declared compatible with, so that an upgrade to a compatible model keeps the text
model (``checked_text_model`` reads those declarations from the index's model only when they are needed). No torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from retrieval.errors import ParameterError
from retrieval.index.layout import IndexLayout
from retrieval.index.portable import find_model, relative_to_index
from retrieval.index.query_embedder import (
    ImageEmbedder,
    declared_compatible,
    hash_matches,
    load_model,
    model_hashes,
    with_output,
)
from retrieval.index.sources import printable_path
from retrieval.records.index_info import IndexInfo
from retrieval.text.no_match import TEXT_NO_MATCH, calibrate_no_match
from retrieval.text.no_match_texts import CALIBRATION_TEXTS
from retrieval.text.text_onnx import (
    MAX_TEXT_MODEL_BYTES,
    TextEmbedder,
    TextModelError,
    TowerFile,
    check_text_model,
    read_tower,
)

TEXT_MODEL_PATH = "text_model_path"  # index.json: where the text model was when recorded
TEXT_MODEL_RELATIVE = "text_model_path_relative"  # ... its path from the index folder
TEXT_MODEL_HASH = "text_model_hash"  # ... and its identity (``TextEmbedder.model_hash``)
TEXT_FIELDS = (TEXT_MODEL_PATH, TEXT_MODEL_RELATIVE, TEXT_MODEL_HASH)
# ... or, once an upgrade moved the vectors out of its text model's space, that model's hash and why it is off
TEXT_MODEL_OFF = "text_model_off"

# the index's image model, or a way to load it when it is needed (None: found from index.json)
ImageModel = ImageEmbedder | Callable[[], ImageEmbedder] | None


class NoTextModelError(TextModelError):
    """A text query to an index that records no text model, and none was given."""

    def __init__(self, index_root: str | Path, info: IndexInfo | None = None) -> None:
        folder = printable_path(str(index_root))
        record = info if info is not None else IndexInfo()
        off = text_off_problem(record.text.off, folder, printable_path(str(record.model.path or "MODEL.onnx")))
        if off is not None:
            super().__init__(f"is needed: the index in {folder} records no text model: {off}")
            return
        super().__init__(f"is needed: the index in {folder} records no text model to search it by text with; give "
                         "`text_model` (the text.onnx that `retrieval text train` writes), or record one in the "
                         f"index once: `retrieval index text {folder} --text-model FILE`")


def text_off_problem(off: object, index_shown: str, model_shown: str) -> str | None:
    """Why an upgrade turned the index's text search off (``off``: index.json's ``TEXT_MODEL_OFF``, as read) and the
    two commands that re-fit a text model (``model_shown``: the index's image model, ``index_shown``: the index, as
    the reader may see them); None where no upgrade did."""
    if not isinstance(off, Mapping):
        return None
    reason = " ".join(str(off.get("reason") or "its text model no longer fits").split())[:1000]
    return (f"an upgrade turned text search off: {reason}. Train a text model for the index's image model "
            f"(`retrieval text train --model {model_shown} --images MANIFEST --caption-column COLUMN --out RUN`), "
            f"then record it: `retrieval index text {index_shown} --text-model RUN/text.onnx`")


def has_text_model(info: IndexInfo) -> bool:
    """Whether index.json (``info``) records a text model."""
    return bool(info.text.hash)


def text_model_fields(text: TextEmbedder, index_root: str | Path) -> dict[str, str]:
    """index.json's record of ``text`` for the index in ``index_root``."""
    return {TEXT_MODEL_PATH: str(text.path.resolve()), TEXT_MODEL_RELATIVE: relative_to_index(text.path, index_root),
            TEXT_MODEL_HASH: text.model_hash}


def find_text_model(info: IndexInfo, index_root: str | Path) -> TowerFile:
    """The file the recorded ``text_model_hash`` names (its hash or its legacy one), as read and hashed
    (``text_onnx.read_tower``; ``TextEmbedder`` runs those bytes): at the recorded path, else at the path recorded
    from the index folder (the folders moved together); else a ``TextModelError`` naming the hash and where it
    looked."""
    text = info.text
    wanted = text.hash
    root = Path(index_root).expanduser().absolute()
    recorded, relative = text.path, text.relative
    places = [Path(recorded).expanduser().absolute()] if recorded else []
    places += [root / relative] if relative else []
    looked, unique = [], {}
    for place in places:  # in order, each file once, as first named
        unique.setdefault(os.path.normpath(place), place)
    for place in unique.values():
        shown = printable_path(str(place))
        if not place.is_file():
            looked.append(f"{shown} (missing)")
            continue
        if place.stat().st_size > MAX_TEXT_MODEL_BYTES:  # not read whole: no text tower is this large
            looked.append(f"{shown} (over 2 GiB: not a text tower)")
            continue
        try:
            found = read_tower(place)
        except OSError as exc:
            looked.append(f"{shown} (cannot be read: {exc.strerror or exc})")
            continue
        if wanted in found.hashes:
            return found
        looked.append(f"{shown} (text_model_hash {found.hashes[0]})")
    folder = printable_path(str(index_root))
    raise TextModelError(
        f"is needed: the index in {folder} records the text model with text_model_hash {wanted}, and no file has "
        f"that hash where it was recorded; looked at {'; '.join(looked) or 'no file'}. Give that text model "
        f"(`text_model`), or record the one to use: `retrieval index text {folder} --text-model FILE`")


def index_declared(info: IndexInfo, index_root: str | Path,
                   image_model: ImageModel = None) -> frozenset[str]:
    """The model hashes the index's image model goes by (``model_hashes``: a text model and an index written by
    different versions may name it by different ones) and is declared compatible with (``image_model``: that model,
    or how to load it; None: found from index.json); empty where it cannot be loaded here."""
    if not info.has_model:
        return frozenset()
    try:
        if image_model is None:
            image_model = load_model(find_model(info, index_root))
        elif not hasattr(image_model, "embed"):  # a way to load it
            image_model = image_model()
    except (ParameterError, OSError, ValueError, RuntimeError):  # no model to read: no declaration to honour
        return frozenset()
    model = with_output(image_model, None)
    return declared_compatible(model) | frozenset(model_hashes(model))


def checked_text_model(text: TextEmbedder, info: IndexInfo, index_root: str | Path,
                       image_model: ImageModel = None) -> TextEmbedder:
    """``text``, once it fits the index whose index.json is ``info`` (``check_text_model``; the index's model's
    declared-compatible hashes are read only for a tower trained for another model); else a ``TextModelError``
    naming both models."""
    where = f"the index in {printable_path(str(index_root))}"
    model = printable_path(str(info.model.path or ""))  # index.json's text: shown, never run by a terminal
    try:
        check_text_model(text, info, where=where, model_file=model)
    except TextModelError:
        dim = info.model.embedding_dim
        if not info.has_model or (-1 if dim is None else int(dim)) != text.dim:
            raise
        declared = index_declared(info, index_root, image_model)
        if not declared:
            raise
        check_text_model(text, info, declared, where=where, model_file=model)
    return text


def open_text_model(info: IndexInfo, index_root: str | Path, path: str | os.PathLike | None = None,
                    image_model: ImageModel = None) -> TextEmbedder:
    """The text model that searches the index in ``index_root`` by text: ``path``, else the one index.json records
    (``find_text_model``), checked against the index (``checked_text_model``)."""
    if path is None and not has_text_model(info):
        raise NoTextModelError(index_root, info)
    text = TextEmbedder(path if path is not None else find_text_model(info, index_root))
    recorded = info.text.hash
    if path is None and not hash_matches(recorded, text):  # replaced since it was hashed
        raise TextModelError(f"is needed: the file {printable_path(str(text.path))} has text_model_hash "
                             f"{text.model_hash}, not {recorded}, the one the index records; give "
                             "that one")
    return checked_text_model(text, info, index_root, image_model)


def record_text_model(index_dir: str | Path, text_model: str | os.PathLike | TowerFile) -> dict[str, Any]:
    """`retrieval index text`: record ``text_model`` in the index's index.json, under the folder's writer lock, once it
    fits the index (a tower trained for another image model is refused, naming both), with the floor of its "no good
    match" measured on the index (``retrieval.text.no_match``). Returns what it recorded."""
    layout = IndexLayout(index_dir)
    layout.require_finished(vectors_in_milvus=True)  # index.json is in the folder either way
    text = TextEmbedder(text_model)  # loaded before the lock: no writer waits for it
    calibration_texts = text.embed(list(CALIBRATION_TEXTS)) if layout.vectors_in() is None else None
    with layout.write_lock("record a text model in"):
        info = layout.read_record()
        checked_text_model(text, info, layout.root)
        fields = text_model_fields(text, layout.root)
        replaced = info.text.hash
        no_match = _calibrated(layout, info, text, calibration_texts)
        layout.write_info(info.without(TEXT_MODEL_OFF, TEXT_NO_MATCH).with_fields(
            fields | ({TEXT_NO_MATCH: no_match} if no_match is not None else {})))
    return {"index_dir": str(layout.root), **fields, "image_model_hash": text.image_model_hash,
            "index_model_hash": info.model.hash, "embedding_dim": text.dim,
            "replaced_text_model_hash": None if hash_matches(replaced, text) else replaced, TEXT_NO_MATCH: no_match}


def _calibrated(layout: IndexLayout, info: IndexInfo, text: TextEmbedder,
                vectors: Any) -> dict[str, Any] | None:
    """The no-match floor of the index with ``text`` (``calibrate_no_match``; ``vectors``: the calibration texts
    embedded by it), measured with the index's own search; None where its vectors are not in the folder (Milvus)
    or it holds under 2 images."""
    if vectors is None:
        return None
    from retrieval.index.search import Index  # the read side's search, as queries get it

    with Index.open(layout.root) as index:
        return calibrate_no_match(index, text, info.model.hash, vectors)
