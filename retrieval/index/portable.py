"""An index folder that can move: where its model and its gallery are now, from what index.json recorded.

index.json records the model and the gallery root twice: absolute (``model_path``, ``gallery_root``: where they were
when recorded) and relative to the index folder (``model_path_relative``, ``gallery_root_relative``), so that the
three folders moved or renamed together are found again.

* The model is found by its hash (``find_model``): the recorded file, the file at the relative path, then any
  ``.onnx`` in the index folder and in its parent folder. A file whose hash differs from ``model_hash`` is never
  loaded; when none has it, ``ModelNotFoundError`` (the ``model`` parameter) names the hash and every place looked.
  A file nobody named is anyone's: one larger than protobuf reads, or whose top-level fields are not an exported
  model's (``model_header_problem``: a few KiB read, whatever its size), is passed over unread, and what is read of
  the others is bounded, each file and all together.
* The gallery (``gallery_place``): ``--gallery-root`` where given, else the recorded root while it is a folder (an
  index that did not move behaves as it always did), else the relative one. A catalogued path is read at its place
  under the gallery's new root (``GalleryPlace.file``); one outside the recorded root, or climbing out with ``..``,
  has no place there and is never opened (a server sends every file it opens, docs/SECURITY.md).

Read side: no writer, no torch. The writers move the catalogue's paths to the new root (``Catalogue.rebase_paths``).
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass
from pathlib import Path, PurePath, PurePosixPath
from typing import BinaryIO

from retrieval.errors import ParameterError
from retrieval.index.sources import is_url, printable_path
from retrieval.records.index_info import IndexInfo, ModelRecord
from retrieval.utils.io import open_regular

MODEL_RELATIVE = "model_path_relative"  # index.json and catalogue meta: the model's path from the index folder
GALLERY_RELATIVE = "gallery_root_relative"  # ... and the gallery root's
MAX_CANDIDATES = 64  # .onnx files hashed per folder at most: a folder of many exports is not read whole
MAX_UNASKED_BYTES = 4 * 2**30  # bytes of .onnx files read in all that index.json does not name
# ... and in one: protobuf parses no message of 2 GiB or more, so a larger file holding its own weights is no model
MAX_UNASKED_FILE_BYTES = 2**31 - 1
MAX_HEADER_FIELDS = 100_000  # a model's top level is a few fields (and its local functions): a longer list is none
MAX_METADATA_ENTRY_BYTES = 2**20  # an export's metadata values are small (model_config: a few KiB); larger: skipped
# onnx.proto's ModelProto: an exported model has a graph and its metadata_props (retrieval's keys)
GRAPH_FIELD, METADATA_FIELD = 7, 14
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5  # protobuf's wire types (3 and 4, groups: not in ONNX)


class ModelNotFoundError(ParameterError):
    """No file with the index's model hash where index.json says, nor beside the index: the ``model`` is needed."""

    def __init__(self, problem: str) -> None:
        super().__init__("model", problem)


def relative_to_index(path: str | Path, index_root: str | Path) -> str:
    """``path`` from the index folder, as index.json records it (POSIX; may climb with ``..``)."""
    return Path(os.path.relpath(Path(path).expanduser().resolve(), Path(index_root).expanduser().resolve())).as_posix()


def file_model_hashes(path: Path, self_contained: bool = False) -> tuple[str, str] | None:
    """The ``model_hashes`` an ONNX file would be opened with (``model_hash`` first), read without running it
    (ValueError: not a model).
    ``self_contained``: read the file alone, only if its top-level fields may be an exported model's
    (``model_header_problem``) and it is at most ``MAX_UNASKED_FILE_BYTES``; None where it keeps weights in other
    files (never opened)."""
    import onnx
    from onnx.external_data_helper import uses_external_data

    from retrieval.onnx_runtime import legacy_model_hash, parse_metadata, proto_model_hash, read_onnx_model

    if self_contained:
        with open_regular(path) as handle:  # one descriptor: the bytes checked are the bytes read
            problem = model_header_problem(handle)
            if problem is not None:
                raise ValueError(f"not a readable exported model ({problem})")
            handle.seek(0)
            # read(n) holds n bytes at once: n is the file's size, checked above, never more than the bound
            data = handle.read(min(os.fstat(handle.fileno()).st_size, MAX_UNASKED_FILE_BYTES) + 1)
        if len(data) > MAX_UNASKED_FILE_BYTES:
            raise ValueError("not a readable exported model (it grew past 2 GiB while read)")
    try:
        proto = onnx.load_model_from_string(data) if self_contained else read_onnx_model(path)
        if self_contained and any(uses_external_data(tensor) for tensor in proto.graph.initializer):
            return None
        metadata = {prop.key: prop.value for prop in proto.metadata_props}
        preprocessing = parse_metadata(metadata, source=str(path))
        return proto_model_hash(proto, preprocessing), legacy_model_hash(proto, preprocessing)
    except Exception as exc:  # onnx's DecodeError and a missing metadata key derive from Exception only
        raise ValueError(f"not a readable exported model ({str(exc).splitlines()[0] if str(exc) else exc!r})") from exc


def _varint(handle: BinaryIO) -> int | None:
    """A protobuf varint read at the handle's place; None at the end of the file or past ten bytes."""
    value = 0
    for shift in range(0, 70, 7):
        byte = handle.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
    return None


def model_header_problem(handle: BinaryIO) -> str | None:
    """Why an open file cannot be a model exported by ``retrieval export``, from its top-level protobuf fields alone
    (each field's tag and length; the graph and its weights are stepped over, only the metadata is read); None where
    it may be one. Reads a few KiB whatever the file's size: junk is told apart before it is read whole."""
    from onnx import StringStringEntryProto

    from retrieval.onnx_runtime import parse_metadata

    size = os.fstat(handle.fileno()).st_size
    if size > MAX_UNASKED_FILE_BYTES:
        return f"{size / 2**30:.1f} GiB: more than protobuf reads in one model"
    metadata: dict[str, str] = {}
    graph = False
    for _ in range(MAX_HEADER_FIELDS):
        at = handle.tell()
        if at == size:
            break
        tag = _varint(handle)
        if tag is None or tag >> 3 == 0 or tag & 7 not in (VARINT, FIXED64, LENGTH_DELIMITED, FIXED32):
            return f"byte {at} is not an ONNX model's field"
        field, wire = tag >> 3, tag & 7
        if wire == VARINT:
            if _varint(handle) is None:
                return f"its field {field} at byte {at} is cut short"
            continue
        length = 8 if wire == FIXED64 else 4 if wire == FIXED32 else _varint(handle)
        if length is None or handle.tell() + length > size:
            return f"its field {field} at byte {at} runs past the end of the file"
        if field in (GRAPH_FIELD, METADATA_FIELD) and wire != LENGTH_DELIMITED:
            return f"its field {field} at byte {at} is not an ONNX model's"
        graph = graph or field == GRAPH_FIELD
        if field == METADATA_FIELD and length <= MAX_METADATA_ENTRY_BYTES:
            try:
                entry = StringStringEntryProto.FromString(handle.read(length))
            except Exception:  # noqa: BLE001  (protobuf's DecodeError derives from Exception only)
                return f"its metadata at byte {at} is not an ONNX model's"
            metadata[entry.key] = entry.value
        else:
            handle.seek(length, os.SEEK_CUR)
    else:
        return f"more than {MAX_HEADER_FIELDS} top-level fields"
    if not graph:
        return "it holds no graph"
    try:
        parse_metadata(metadata, source="it")
    except Exception as exc:  # noqa: BLE001  (a key missing, or a value that is not what an export writes)
        return str(exc).splitlines()[0]
    return None


def _recorded_places(model: ModelRecord, index_root: Path) -> list[Path]:
    """Where index.json says the model is: its absolute path, then its path from the index folder."""
    recorded, relative = model.path, model.relative
    return [Path(place).expanduser().absolute() for place in ([recorded] if recorded else [])] + (
        [index_root / relative] if relative else [])


def _model_candidates(model: ModelRecord, index_root: Path) -> list[Path]:
    """Where the model may be, in order: recorded, relative, then ``.onnx`` files in the index folder and its parent
    (each folder's file of the recorded name first)."""
    recorded = model.path
    places = _recorded_places(model, index_root)
    name = Path(recorded).name if recorded else None
    for folder in (index_root, index_root.parent):
        try:
            found = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".onnx")[:MAX_CANDIDATES]
        except OSError:
            continue
        places += sorted(found, key=lambda p: p.name != name)
    unique = {os.path.normpath(place.expanduser().absolute()): None for place in places}  # in order, once each
    return [Path(place) for place in unique]


def find_model(info: IndexInfo, index_root: str | Path, role: str = "was built by") -> Path:
    """The ONNX file whose hash is the index's ``model_hash`` (see the module docstring), or ModelNotFoundError
    (``role``: what the index is to that model, as the message says it).

    A recorded file that cannot be read as a model here, where no other file has the hash, is returned as it is: the
    loader names what is wrong with it, and the caller checks the hash of what it loaded."""
    model = info.model
    wanted = model.hash
    root = Path(index_root).expanduser().absolute()
    recorded = {os.path.normpath(place) for place in _recorded_places(model, root)}
    looked: list[str] = []
    unreadable = None
    unasked_bytes = 0  # read from files nobody named: bounded, a shared parent folder may hold anything
    for candidate in _model_candidates(model, root):
        shown = printable_path(str(candidate))
        if not candidate.is_file():
            looked.append(f"{shown} (missing)")
            continue
        unasked = os.path.normpath(candidate.absolute()) not in recorded
        if unasked:
            size = candidate.stat().st_size
            if size > MAX_UNASKED_FILE_BYTES or unasked_bytes + size > MAX_UNASKED_BYTES:
                too_large = f"{size / 2**30:.1f} GiB, more than one model holding its own weights can be; " \
                    if size > MAX_UNASKED_FILE_BYTES else ""
                looked.append(f"{shown} (not read: {too_large}give it as the model if it is the one)")
                continue
            try:  # a few KiB first: junk is passed over before it counts against what may be read
                with open_regular(candidate) as handle:
                    problem = model_header_problem(handle)
            except OSError as exc:
                problem = f"cannot be read: {exc.strerror or exc}"
            if problem is not None:
                looked.append(f"{shown} (not a readable exported model ({problem}))")
                continue
            unasked_bytes += size
        try:
            found = file_model_hashes(candidate, self_contained=unasked)
            if found is None:  # its weights lie in other files, which nobody named
                looked.append(f"{shown} (not read: give it as the model if it is the one)")
                continue
        except ValueError as exc:
            looked.append(f"{shown} ({exc})")
            if unreadable is None and os.path.normpath(candidate.absolute()) in recorded:
                unreadable = candidate
            continue
        if wanted in found:  # its hash, or the one an earlier version recorded for it
            return candidate
        looked.append(f"{shown} (model_hash {found[0]})")
    if unreadable is not None:
        return unreadable
    relative = f" ({model.relative} from the index folder)" if model.relative else ""
    raise ModelNotFoundError(
        f"is needed: the index in {printable_path(str(index_root))} {role} the model with model_hash {wanted}, "
        f"recorded as {printable_path(str(model.path or '?'))}{relative}, and no file has that hash; "
        f"looked at {'; '.join(looked) or 'no file'} (and for any .onnx in the index folder and its parent). Give "
        "that model (`model`), or put it inside the index folder or beside it")


@dataclass(frozen=True)
class GalleryPlace:
    """The gallery root the catalogue's paths were recorded under, and where the gallery is now."""

    recorded: PurePath
    root: PurePath

    @property
    def moved(self) -> bool:
        """Whether the gallery is read somewhere other than where its paths were recorded."""
        return self.recorded != self.root

    def file(self, path: str) -> str | None:
        """Where the file of a catalogued ``path`` is now; None where the moved gallery has no place for it."""
        if not self.moved or is_url(path):
            return path
        normal = PurePosixPath(posixpath.normpath(path))  # a '..' cannot climb out of the new root
        if normal.is_relative_to(self.root):  # a writer already moved this row's path
            return normal.as_posix()
        if normal.is_relative_to(self.recorded):
            return (PurePosixPath(self.root) / normal.relative_to(self.recorded)).as_posix()
        return None

    def shown_from(self, path: str) -> PurePath:
        """The root a catalogued ``path`` is shown relative to (``search.public_path``): the same relative path
        before and after a writer moved the catalogue's paths to the new root."""
        if self.moved and not is_url(path) and PurePosixPath(path).is_relative_to(self.root):
            return self.root
        return self.recorded


def gallery_place(info: IndexInfo, recorded: PurePath, index_root: str | Path,
                  gallery_root: str | Path | None = None) -> GalleryPlace:
    """Where the gallery of the index in ``index_root`` is now (``recorded``: its recorded or inferred root)."""
    if gallery_root is not None:
        folder = Path(gallery_root).expanduser()
        if not folder.is_dir():
            raise ParameterError("gallery_root", f"{printable_path(str(folder))} is not a folder; give the folder that "
                                                 "now holds the gallery's images")
        return _unnested(GalleryPlace(recorded, PurePath(folder.resolve())))
    relative = info.catalogue.gallery_relative
    if Path(recorded).is_dir() or not relative:
        return GalleryPlace(recorded, recorded)
    moved = Path(os.path.normpath(Path(index_root).expanduser().resolve() / relative))
    return _unnested(GalleryPlace(recorded, PurePath(moved) if moved.is_dir() else recorded))


def _unnested(place: GalleryPlace) -> GalleryPlace:
    """``place``, unless its new root lies inside the recorded one or holds it: a path could then be read as
    recorded or as moved, and two images would map to one file."""
    if place.moved and (place.root.is_relative_to(place.recorded) or place.recorded.is_relative_to(place.root)):
        raise ParameterError("gallery_root", f"{printable_path(str(place.root))} and the recorded gallery root "
                                             f"{printable_path(str(place.recorded))} hold one another; give the "
                                             "folder the images now lie in, beside the old one, not within it")
    return place


def file_inside(root: str | PurePath, relative: str | PurePath) -> str | None:
    """``root / relative`` where that file, symlinks followed, is inside ``root`` (also followed); None where it
    would leave it (``..``, an absolute path, a symlinked folder pointing elsewhere) or names no possible file."""
    relative = PurePosixPath(relative)
    if relative.is_absolute() or ".." in relative.parts or "\x00" in str(relative):
        return None
    real_root = os.path.realpath(root)
    candidate = os.path.join(str(root), str(relative))
    real = os.path.realpath(candidate)
    if os.path.commonpath([real_root, real]) != real_root:
        return None
    return candidate
