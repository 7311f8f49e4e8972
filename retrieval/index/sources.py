"""Where the gallery images come from: a folder walked recursively, a manifest CSV, or a parquet file.

File names are hostile input. On Linux a name is any bytes but NUL and ``/``; Python hands names that
are not UTF-8 over as surrogate escapes, which SQLite cannot store. Such a name (and a folder that cannot
be listed, a manifest path with a NUL byte or one longer than ``MAX_PATH_BYTES``) is never catalogued: it
becomes a ``ListingError`` that the build reports with the name escaped (``printable_path``), and the
rest of the gallery is indexed. Names with newlines or other control characters are valid and indexed
as they are; only their display is escaped.

A manifest is hostile input too. Its columns beside path and label are kept per image (filters, the export's
columns), so a header whose kept columns include a name the index uses itself (``RESERVED_COLUMNS``: the export
would write two columns of one name) or a name longer than ``MAX_COLUMN_NAME_CHARS`` is refused as a whole, the
message naming the column. A label longer than ``MAX_LABEL_CHARS`` (labels are sent to every page of the app and
matched whole by filters, so they are never cut) makes its row a ``ListingError`` naming the manifest line. Its
text is bounded before it is unpacked: a parquet manifest's column chunks and dictionary-encoded batches against
what their rows' values take at their bounds (``parquet_bounds``), a CSV row by ``MAX_ROW_CHARS``.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from retrieval.data.formats import IMAGE_EXTENSIONS  # the decoder's formats: the gallery lists only these files
from retrieval.data.manifest_columns import DEFAULT_LABEL_COLUMN, missing_label_column, no_labels_hint
from retrieval.data.walk import walk_following_links
from retrieval.errors import ParameterError
from retrieval.index.parquet_bounds import Bounds, check_chunk_sizes, check_unpacked_sizes, number_bound, text_bound
from retrieval.utils.printable import DISPLAY_LIMIT, printable_path  # noqa: F401  (the listing's messages use it)

MAX_PATH_BYTES = 4096  # Linux PATH_MAX: the kernel refuses longer paths anyway
MAX_LABEL_CHARS = 256  # a folder name (255 bytes at most) always fits; a manifest's label is refused beyond it
MAX_COLUMN_NAME_CHARS = 64  # a manifest column's name: a filter names it, the app and the export show it
# Names the index's own columns have where a manifest's kept columns also go (the export's columns, the filters'
# built-in ones): a manifest column of one of these names would be a second column of that name.
RESERVED_COLUMNS = ("id", "sha256", "size", "embedding")
NOT_UTF8 = "file name is not valid UTF-8; rename it"


@dataclass(frozen=True)
class GalleryItem:
    path: str  # absolute, so that the catalogue does not depend on the working directory
    label: str | None
    # a manifest's other columns (split included): what a search's `where` filters on; strings or numbers
    extra: dict[str, str | float | int] | None = None


@dataclass(frozen=True)
class ListingError:
    """A path the listing could not take (the path escaped by ``printable_path``) and why."""

    path: str
    error: str


@dataclass
class Gallery:
    """The images of one ``--images`` source, what could not be listed, and the folder paths are under."""

    source: str  # the folder or manifest, resolved and printable: listing errors are refreshed per source
    root: str  # the --images folder, or the manifest's folder
    items: list[GalleryItem] = field(default_factory=list)
    errors: list[ListingError] = field(default_factory=list)
    kind: str = "folder"  # folder | manifest | image
    columns: list[str] = field(default_factory=list)  # a manifest's header
    label_column: str = DEFAULT_LABEL_COLUMN  # the manifest column its labels were read from


# --label-from: where an image's label comes from
LABEL_RULES = {
    "parent": "the name of the folder the image is in (a folder gallery's default)",
    "top": "the name of the first folder under the gallery folder, however deep the image is",
    "manifest": "the manifest's label column (a manifest's default)",
    "none": "no labels",
}


def default_label_rule(kind: str) -> str:
    """The rule a gallery of this kind gets when --label-from is not given."""
    return "manifest" if kind == "manifest" else "parent"


def apply_label_rule(gallery: Gallery, rule: str) -> Gallery:
    """The gallery with each image labelled by ``rule`` (``LABEL_RULES``); "manifest" keeps the manifest's labels."""
    if rule not in LABEL_RULES:
        raise ParameterError("rule", f"must be one of {', '.join(LABEL_RULES)}, got {rule!r}")
    if rule == "manifest":
        if gallery.kind != "manifest":
            raise ParameterError("rule", f"manifest takes a manifest's label column, but {gallery.source} is "
                                         f"{'one image' if gallery.kind == 'image' else 'a folder'}: use parent, top "
                                         "or none")
        return gallery
    root = Path(gallery.root)
    gallery.items = [GalleryItem(item.path, _path_label(Path(item.path), root, rule, gallery.kind), item.extra)
                     for item in gallery.items]
    return gallery


def _path_label(path: Path, root: Path, rule: str, kind: str) -> str | None:
    if rule == "none":
        return None
    if kind == "image":  # one image: its own folder names it (parent), there is no gallery folder above (top)
        return path.parent.name if rule == "parent" else None
    try:
        parts = path.relative_to(root).parts
    except ValueError:  # a manifest row outside the manifest's folder: its own folder
        parts = (path.parent.name, path.name)
    if len(parts) < 2:
        return None  # an image at the top of the gallery has no label
    return parts[-2] if rule == "parent" else parts[0]


def label_summary(gallery: Gallery, rule: str, shown: int = 10) -> dict:
    """What the build says about the labels it found: the rule, the classes, the largest ones and their counts."""
    counts: dict[str, int] = {}
    for item in gallery.items:
        if item.label is not None:
            counts[item.label] = counts.get(item.label, 0) + 1
    largest = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:shown]
    summary = {"from": rule, "rule": LABEL_RULES[rule], "classes": len(counts),
               "unlabelled": sum(item.label is None for item in gallery.items),
               "largest_classes": dict(largest)}
    if gallery.kind == "manifest" and rule == "manifest":
        if gallery.label_column != DEFAULT_LABEL_COLUMN:  # named: the build's line says which
            summary["label_column"] = gallery.label_column
        if not counts and gallery.label_column not in gallery.columns:  # no labels: the column that looks like them
            summary["hint"] = no_labels_hint(gallery.columns, (item.extra or {} for item in gallery.items))
    return summary


def is_utf8(text: str) -> bool:
    """False for strings holding surrogates (names that were not UTF-8), which SQLite cannot store."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether a catalogued path is a URL (``https://...``: a build from embeddings keeps its metadata's URLs as
    they are), not a file's path."""
    return URL.match(path) is not None


def path_problem(path: str) -> str | None:
    """Why this path cannot be catalogued, or None."""
    if not is_utf8(path):
        return NOT_UTF8
    if "\x00" in path:
        return "path contains a NUL byte (no file can have that name)"
    if len(path.encode("utf-8")) > MAX_PATH_BYTES:
        return f"path is longer than {MAX_PATH_BYTES} bytes (the system limit); move the file higher up"
    return None


def list_gallery(images: str | Path, split: str | None = None, label_column: str | None = None) -> Gallery:
    """Every image under a folder (recursive, extension in any case), one image file, or every row of a manifest
    CSV.

    In a folder, an image in a sub-folder is labelled by that sub-folder's name (ImageFolder style, the
    ``parent`` rule; ``apply_label_rule`` relabels by another); an image at the top level has no label. A
    manifest has columns ``path,label[,split]`` with paths relative to the manifest's folder; ``split`` keeps
    only the rows of that split. A parquet file with the same columns is read the same way (one row per image:
    the usual listing of a big catalogue). ``label_column``: the manifest column the labels are read from
    ('label' unless named; a named column the manifest lacks is a ParameterError naming its columns).
    """
    images = Path(images).expanduser()
    if not is_utf8(str(images.resolve())):
        raise ParameterError("images", f"{printable_path(images.resolve())}: the name is not valid UTF-8; rename it")
    if images.is_dir():
        if split is not None:
            raise ParameterError("split", "filters a manifest's rows; it does not apply to a folder of images")
        if label_column is not None:
            raise ParameterError("label_column", f"names a manifest's column; {printable_path(images)} is a folder")
        return walk_folder(images)
    if images.is_file() and images.suffix.lower() == ".csv":
        return read_manifest(images, split, label_column)
    if images.is_file() and images.suffix.lower() == ".parquet":
        return read_parquet_manifest(images, split, label_column)
    if images.is_file() and images.suffix.lower() in IMAGE_EXTENSIONS:
        return single_image(images, split)
    if images.exists():
        raise ParameterError(
            "images", f"must be a folder, one image or a manifest .csv or .parquet (path,label[,split]), got {images}"
        )
    raise ParameterError("images", f"{images} does not exist")


def single_image(image: Path, split: str | None = None) -> Gallery:
    """One image file as a gallery (``index add INDEX --images photo.jpg``): no label, its folder as the root."""
    if split is not None:
        raise ParameterError("split", "filters a manifest's rows; it does not apply to one image")
    path = image.resolve()
    gallery = Gallery(source=printable_path(path), root=str(path.parent), kind="image")
    problem = path_problem(str(path))
    if problem is not None:
        gallery.errors.append(ListingError(printable_path(path), problem))
    else:
        gallery.items.append(GalleryItem(str(path), None))
    return gallery


def walk_folder(root: Path, limit: int | None = None) -> Gallery:
    """The images under ``root``; sub-folders that cannot be listed and unusable names become errors.

    With ``limit``, the walk stops once it holds more than ``limit`` images, so that a caller that refuses a folder
    that big need not list all of it.
    """
    root = root.resolve()
    gallery = Gallery(source=printable_path(root), root=str(root))

    def unlisted(exc: OSError) -> None:
        folder = exc.filename if exc.filename is not None else root
        gallery.errors.append(
            ListingError(
                printable_path(folder),
                f"folder not listed ({exc.strerror or exc}): its images are left out; make it readable, "
                "then add them to the index",
            )
        )

    # linked folders too (a class folder is often a link), each real folder once, those inside the gallery only
    # (a server sends what is catalogued); sorted, so ids follow the order
    for folder, _dirs, files in walk_following_links(root, onerror=unlisted, within=True):
        for name in sorted(files):
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                path = Path(folder) / name
                problem = path_problem(str(path))
                if problem is not None:
                    gallery.errors.append(ListingError(printable_path(path), problem))
                    continue
                gallery.items.append(GalleryItem(str(path), _path_label(path, root, "parent", "folder")))
                if limit is not None and len(gallery.items) > limit:
                    return gallery
    return gallery


def read_manifest(manifest: Path, split: str | None = None, label_column: str | None = None) -> Gallery:
    """The rows of a manifest; a row naming an unusable path, or with a label that is not UTF-8, is an error."""
    base = manifest.resolve().parent
    gallery = Gallery(source=printable_path(manifest.resolve()), root=str(base), kind="manifest",
                      label_column=label_column or DEFAULT_LABEL_COLUMN)
    # surrogateescape: bytes that are not UTF-8 reach the row checks below instead of failing the whole file
    with open(manifest, newline="", encoding="utf-8-sig", errors="surrogateescape") as handle:
        lines = RowLines(handle, manifest)
        reader = csv.DictReader(lines)
        try:
            fields = reader.fieldnames or []
            lines.row_read()
            if "path" not in fields:
                raise ValueError(
                    f"manifest {manifest} needs a header with a 'path' column (path,label[,split])"
                )
            if split is not None and "split" not in fields:
                raise ParameterError("split", f"{split} given but manifest {manifest} has no 'split' column")
            gallery.columns = [f for f in fields if isinstance(f, str)]
            if label_column is not None and label_column not in fields:
                raise missing_label_column(label_column, gallery.columns, manifest)
            extras = extra_columns(fields, manifest)
            for row in reader:
                lines.row_read()
                if split is not None and row.get("split") != split:
                    continue
                _take_row(gallery, base, row, reader.line_num, extras)
        except csv.Error as exc:  # e.g. a field over csv's 128 KiB limit: no sane path is that long
            raise ValueError(f"manifest {manifest} line {reader.line_num}: {exc}; fix that row") from exc
    if split is not None and not gallery.items and not gallery.errors:
        raise ValueError(f"manifest {manifest} has no rows with split == {split!r}")
    return gallery


MAX_ROW_CHARS = 2**20  # one CSV row, its lines together: a path, a label and 64 kept values take far fewer


class RowLines:
    """A CSV manifest's lines for ``csv.reader``, refusing a row (its lines together: a quoted field can hold line
    breaks) longer than ``MAX_ROW_CHARS`` before more of it is read; ``row_read`` after each row."""

    def __init__(self, handle: TextIO, manifest: str | os.PathLike[str]) -> None:
        self.handle, self.manifest = handle, manifest
        self.line = self.start = self.chars = 0

    def __iter__(self) -> RowLines:
        return self

    def __next__(self) -> str:
        text = self.handle.readline(MAX_ROW_CHARS - self.chars + 1)
        if not text:
            raise StopIteration
        self.line += 1
        self.chars += len(text)
        if self.chars > MAX_ROW_CHARS:
            raise ValueError(f"manifest {printable_path(self.manifest)}: the row from line {self.start + 1:,} runs "
                             f"over {MAX_ROW_CHARS:,} characters (a path, a label and the kept columns take far "
                             "fewer): a quote left open, or a field or row that never ends; fix that row")
        return text

    def row_read(self) -> None:
        """Start counting the next row's characters."""
        self.start, self.chars = self.line, 0


def read_parquet_manifest(manifest: Path, split: str | None = None, label_column: str | None = None) -> Gallery:
    """The rows of a parquet manifest (columns path[, label][, split]), with the CSV manifest's row rules."""
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError as exc:
        raise RuntimeError(f'a parquet manifest needs pyarrow: pip install "ray[data]>=2.40" ({exc})') from exc
    base = manifest.resolve().parent
    gallery = Gallery(source=printable_path(manifest.resolve()), root=str(base), kind="manifest",
                      label_column=label_column or DEFAULT_LABEL_COLUMN)
    try:
        handle = pq.ParquetFile(manifest)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own errors for a damaged file)
        raise ValueError(f"manifest {manifest} is not a readable parquet file: {exc}") from exc
    fields = set(handle.schema_arrow.names)
    if "path" not in fields:
        raise ValueError(f"manifest {manifest} needs a 'path' column (path[, label][, split])")
    if split is not None and "split" not in fields:
        raise ParameterError("split", f"{split} given but manifest {manifest} has no 'split' column")
    gallery.columns = list(handle.schema_arrow.names)
    if label_column is not None and label_column not in fields:
        raise missing_label_column(label_column, gallery.columns, manifest)
    import pyarrow as pa

    # strings and numbers only: a column of image bytes or nested records is neither read nor kept
    scalar = [f.name for f in handle.schema_arrow if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)
              or pa.types.is_integer(f.type) or pa.types.is_floating(f.type)]
    extras = extra_columns(scalar, manifest)
    columns = list(dict.fromkeys([c for c in ("path", gallery.label_column) if c in fields] + extras))
    shown = f"manifest {printable_path(manifest)}"
    bounds = _parquet_bounds(handle.schema_arrow, columns, shown, gallery.label_column)
    handle.close()
    # read once more, the text kept dictionary-encoded as it is read: the chunks' sizes are checked on the handle
    # that is read, and a batch's unpacked size before any value is unpacked
    try:
        handle = pq.ParquetFile(manifest, read_dictionary=columns)
    except Exception as exc:  # noqa: BLE001  (pyarrow raises its own errors for a damaged file)
        raise ValueError(f"manifest {manifest} is not a readable parquet file: {exc}") from exc
    with handle:
        check_chunk_sizes(handle, bounds, shown, "the manifest")
        line = 0
        for batch in handle.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
            check_unpacked_sizes(batch, bounds, shown, line, "the manifest")
            for row in batch.to_pylist():
                line += 1
                if split is not None and row.get("split") != split:
                    continue
                row = {k: v if v is None or isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
                       for k, v in row.items()}
                _take_row(gallery, base, row, line, extras)
    if split is not None and not gallery.items and not gallery.errors:
        raise ValueError(f"manifest {manifest} has no rows with split == {split!r}")
    return gallery


MAX_EXTRA_COLUMNS = 64  # a manifest's columns kept for filters, beyond path and label
MAX_EXTRA_CHARS = 1024  # one value, as text
PARQUET_BATCH_ROWS = 1024  # a parquet manifest's rows unpacked at once: at most a few MB of text per kept column


def _parquet_bounds(schema: object, columns: Sequence[str], shown: str, label_column: str = DEFAULT_LABEL_COLUMN
                    ) -> Bounds:
    """The most bytes one value of each of a parquet manifest's ``columns`` takes (``parquet_bounds``); ValueError
    for a path or label column of nested values (lists, records), which neither bound nor the rows would take."""
    import pyarrow as pa

    kinds = {f.name: f.type for f in schema}
    bounds = {}
    for name in columns:
        kind = kinds[name]
        if pa.types.is_nested(kind):
            raise ValueError(f"{shown}: column {name!r} holds {kind}, not text; write it as strings (one value a row)")
        bounds[name] = (number_bound() if pa.types.is_integer(kind) or pa.types.is_floating(kind)
                        else (MAX_PATH_BYTES, f"{MAX_PATH_BYTES} bytes") if name == "path"
                        else text_bound(MAX_LABEL_CHARS if name == label_column else MAX_EXTRA_CHARS))
    return bounds


def extra_columns(fields: Sequence[str], manifest: str | os.PathLike[str] = "the manifest") -> list[str]:
    """The manifest's columns beside path and label that are kept for a `where` (split among them): names a filter
    can write (ASCII identifiers), the first ``MAX_EXTRA_COLUMNS`` of the header, chosen once per manifest.

    Raises ValueError for a kept name that is reserved (``RESERVED_COLUMNS``) or longer than
    ``MAX_COLUMN_NAME_CHARS``, naming the column and the fix."""
    kept = [f for f in fields if isinstance(f, str) and f not in ("path", "label") and f.isidentifier() and f.isascii()]
    kept = kept[:MAX_EXTRA_COLUMNS]
    shown = printable_path(manifest)
    for name in kept:
        if len(name) > MAX_COLUMN_NAME_CHARS:
            raise ValueError(f"manifest {shown}: column {name[:40]}... has a name of {len(name)} characters, longer "
                             f"than {MAX_COLUMN_NAME_CHARS}; rename it (at most {MAX_COLUMN_NAME_CHARS} characters)")
        if name in RESERVED_COLUMNS:
            raise ValueError(f"manifest {shown}: column {name!r} has a name the index uses for its own column "
                             f"({', '.join(RESERVED_COLUMNS)} are reserved); rename it, e.g. to source_{name}, or "
                             "drop it from the manifest")
    return kept


def extra_values(row: dict[str, object], columns: Sequence[str]) -> dict[str, str | float | int] | None:
    """A manifest row's values of the kept ``columns`` (missing and NaN values left out; text bounded)."""
    extra: dict[str, str | float | int] = {}
    for key in columns:
        value = row.get(key)
        if value is None or value == "" or (isinstance(value, float) and value != value):  # NaN: missing
            continue
        extra[key] = value if isinstance(value, (int, float)) else str(value)[:MAX_EXTRA_CHARS]
    return extra or None


def _take_row(gallery: Gallery, base: Path, row: dict[str, object], line: int, extras: Sequence[str] = ()) -> None:
    raw = str(row.get("path") or "")
    if not raw.strip():
        gallery.errors.append(ListingError(f"(manifest line {line})", "the row has no path"))
        return
    path = Path(raw).expanduser()
    path = str(path if path.is_absolute() else base / path)
    problem = path_problem(path)
    label = row.get(gallery.label_column)
    label = str(label) if label not in (None, "") and label == label else None  # NaN: none
    if problem is None and label is not None and not is_utf8(label):
        problem = f"label {printable_path(label)} is not valid UTF-8; fix it in the manifest"
    if problem is None and label is not None and len(label) > MAX_LABEL_CHARS:
        problem = (f"label {printable_path(label, 60)} has {len(label)} characters, more than {MAX_LABEL_CHARS}; "
                   f"shorten it in the manifest (labels are kept whole, never cut)")
    if problem is not None:
        gallery.errors.append(ListingError(printable_path(path), f"{problem} (manifest line {line})"))
        return
    extra = extra_values(row, extras)
    garbled = [k for k, v in (extra or {}).items() if isinstance(v, str) and not is_utf8(v)]
    if garbled:
        gallery.errors.append(ListingError(printable_path(path), f"column {garbled[0]!r} is not valid UTF-8 (manifest "
                                                                 f"line {line}); save the manifest as UTF-8"))
        return
    gallery.items.append(GalleryItem(path, label, extra))


def kept_columns(manifest: Path) -> list[str]:
    """The columns a manifest (.csv or .parquet) keeps beside path and label, as its rows' ``extra`` holds them
    (``extra_columns`` of its header): what a column that is empty in every row is told apart by."""
    if manifest.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return extra_columns(pq.read_schema(manifest).names, manifest)
    with open(manifest, newline="", encoding="utf-8-sig", errors="surrogateescape") as handle:
        return extra_columns(next(csv.reader(RowLines(handle, manifest)), []), manifest)  # the header, bounded
