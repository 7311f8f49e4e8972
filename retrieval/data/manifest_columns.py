"""A manifest's own columns and files, said the same way wherever a manifest is read (the index's listing, the csv
data set, text training): which column holds the labels (``label_column``, 'label' unless named), the one column
that looks like labels where a manifest has none (``label_candidate``), and which rows' images are there with one
line on those that are not (``present_rows``, ``missing_images_line``: a manifest moved away from its images),
said once by whoever holds a ``SaidOnce``. No NumPy, no torch.

The candidate is decided on the rows the caller has already read, at most ``MAX_ROWS_LOOKED_AT`` of them, each value
cut to ``MAX_VALUE_CHARS``: a hostile manifest costs no more than reading it did.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from retrieval.errors import ParameterError
from retrieval.utils.printable import printable_path

DEFAULT_LABEL_COLUMN = "label"
MAX_ROWS_LOOKED_AT = 10_000  # rows a label candidate is decided on (the first ones read)
MAX_VALUE_CHARS = 1024  # a value as the listing keeps it (sources.MAX_EXTRA_CHARS)
MAX_COLUMNS_SHOWN = 20  # a manifest's columns a message lists
NAMES_SHOWN = 3  # missing images a line names
# a label is a short name: a category, not a sentence
MAX_LABEL_MEAN_CHARS = 32
MAX_LABEL_VALUE_CHARS = 64
MAX_LABEL_MEAN_WORDS = 3.0
MIN_FILLED_SHARE = 0.5  # of the rows: a column empty in most rows labels few images
MIN_ROWS_PER_VALUE = 2.0  # rows per distinct value on average: labels repeat, identifiers and titles do not
# columns whose text describes or locates an image, never its class, whatever their values look like
NOT_LABELS = frozenset({"path", "split", "id", "sku", "url", "file", "filename", "image", "title", "name",
                        "product_name", "caption", "description", "text", "alt", "alt_text", "summary", "details",
                        "notes", "comment"})
# names that say "label", in the order one is preferred where several columns look like labels
LABEL_NAMES = ("category", "class", "class_name", "label_name", "categories", "product_type", "type", "kind",
               "group", "department", "genre", "species")


def columns_text(columns: Sequence[str]) -> str:
    """A manifest's columns for a message: the first ``MAX_COLUMNS_SHOWN``, escaped, and how many more."""
    shown = [printable_path(str(c), 64) for c in columns[:MAX_COLUMNS_SHOWN]]
    more = f" and {len(columns) - MAX_COLUMNS_SHOWN} more" if len(columns) > MAX_COLUMNS_SHOWN else ""
    return (", ".join(shown) + more) or "none"


def missing_label_column(name: str, columns: Sequence[str], manifest: str | os.PathLike[str]) -> ParameterError:
    """The error for a ``label_column`` the manifest does not have: its columns named."""
    return ParameterError("label_column", f"names {printable_path(name, 64)!r}, which is no column of manifest "
                                          f"{printable_path(manifest)}; its columns are: {columns_text(columns)}")


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return True
    try:
        float(str(value))
    except ValueError:
        return False
    return True


def _looks_like_path(value: str) -> bool:
    return "/" in value or "\\" in value or os.path.splitext(value)[1].lower() in (".jpg", ".jpeg", ".png", ".webp")


def _labels_like(values: list[object], rows: int) -> bool:
    """Whether a column's non-empty ``values`` (of ``rows`` rows) are short repeated names: a category."""
    if not rows or len(values) < max(2, MIN_FILLED_SHARE * rows):
        return False
    if all(_is_number(v) for v in values):  # a price, a count, an identifier
        return False
    texts = [str(v)[:MAX_VALUE_CHARS].strip() for v in values]
    if sum(map(_looks_like_path, texts)) * 2 > len(texts):
        return False
    if max(map(len, texts)) > MAX_LABEL_VALUE_CHARS or sum(map(len, texts)) > MAX_LABEL_MEAN_CHARS * len(texts):
        return False
    if sum(len(t.split()) for t in texts) > MAX_LABEL_MEAN_WORDS * len(texts):  # free text
        return False
    distinct = len(Counter(texts))
    return 2 <= distinct and len(texts) >= MIN_ROWS_PER_VALUE * distinct


def label_candidate(columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> str | None:
    """The one column of a manifest without labels that looks like its labels (short names repeated over the rows,
    few distinct ones: ``category``), decided on the first ``MAX_ROWS_LOOKED_AT`` of ``rows`` (those read already);
    never a path, title, caption or numeric column. Where several look like labels, the one named like labels
    (``LABEL_NAMES``' order); None where none does, or where several do and no name says which."""
    names = [c for c in columns if isinstance(c, str) and c.lower() not in NOT_LABELS and c != DEFAULT_LABEL_COLUMN]
    if not names:
        return None
    values: dict[str, list[object]] = {name: [] for name in names}
    count = 0
    for row in rows:
        if count >= MAX_ROWS_LOOKED_AT:
            break
        count += 1
        for name in names:
            value = row.get(name)
            if value is None or value == "" or (isinstance(value, float) and value != value):
                continue
            values[name].append(value)
    found = [name for name in names if _labels_like(values[name], count)]
    named = sorted((n for n in found if n.lower() in LABEL_NAMES), key=lambda n: LABEL_NAMES.index(n.lower()))
    if named:
        return named[0]
    return found[0] if len(found) == 1 else None


def no_labels_hint(columns: Sequence[str], rows: Iterable[Mapping[str, object]]) -> str:
    """Why a manifest gives no labels, and the fix: the column that looks like them (``label_candidate``), named
    with ``label_column`` (a caller shows its own name for that)."""
    candidate = label_candidate(columns, rows)
    if candidate is None:
        return (f"the manifest has no '{DEFAULT_LABEL_COLUMN}' column; name the column that holds each image's class "
                f"with `label_column` (its columns: {columns_text(columns)})")
    return (f"the manifest has no '{DEFAULT_LABEL_COLUMN}' column; its {printable_path(candidate, 64)!r} column looks "
            f"like one: use `label_column` {printable_path(candidate, 64)}")


def missing_paths(paths: Sequence[str]) -> list[str]:
    """The ``paths`` that are no file (one stat each; a URL is never looked for here)."""
    return [p for p in paths if "://" not in p and not os.path.isfile(p)]


def missing_images_line(missing: Sequence[str], total: int, manifest: str | os.PathLike[str] | None = None) -> str:
    """One line on the images a manifest names that are not there: how many of how many, the first few, the folder
    they were looked for in, and the fix (a manifest moved away from its images, or paths relative to another
    folder)."""
    folders = [os.path.dirname(os.path.abspath(p)) for p in missing]
    try:
        folder = os.path.commonpath(folders) if folders else ""
    except ValueError:  # different drives
        folder = folders[0]
    names = [printable_path(os.path.relpath(os.path.abspath(p), folder) if folder else p, 120)
             for p in missing[:NAMES_SHOWN]]
    more = f" and {len(missing) - NAMES_SHOWN} more" if len(missing) > NAMES_SHOWN else ""
    named = f"manifest {printable_path(manifest)}" if manifest is not None else "the manifest"
    base = (printable_path(os.path.dirname(os.path.abspath(manifest))) if manifest is not None
            else "the manifest's folder")
    return (f"{len(missing)} of the {total} images listed in {named} are missing: {', '.join(names)}{more} (looked "
            f"for in {printable_path(folder)}); paths in a manifest are relative to its folder ({base}): move the "
            "manifest back beside its images, or give paths relative to the manifest's folder (or absolute ones)")


@dataclass(frozen=True)
class PresentRows:
    """Which rows of a manifest name an image that is there: ``kept``, their positions in order; ``missing``, the
    distinct paths that are no file; ``line``, one line on those (``missing_images_line``), "" where none is."""

    kept: list[int]
    missing: frozenset[str]
    line: str


def present_rows(paths: Sequence[str], manifest: str | os.PathLike[str] | None = None) -> PresentRows:
    """The rows of ``paths`` (one per manifest row) whose image is there and the one line on the rest; each
    distinct path is looked for once (``missing_paths``), however many rows name it."""
    missing = frozenset(missing_paths(list(dict.fromkeys(paths))))
    if not missing:
        return PresentRows(list(range(len(paths))), missing, "")
    kept = [n for n, path in enumerate(paths) if path not in missing]
    return PresentRows(kept, missing, missing_images_line([p for p in paths if p in missing], len(paths), manifest))


class SaidOnce:
    """Lines said once per key by whoever holds this object (``say(key, line)``); it remembers the last
    ``MAX_KEYS`` keys, so a long-lived holder stays bounded."""

    MAX_KEYS = 1024

    def __init__(self, say: Callable[[str], None]) -> None:
        self._say = say
        self._said: dict[Hashable, None] = {}

    def __call__(self, key: Hashable, line: str) -> bool:
        """Say ``line`` unless ``key`` was said before; returns whether it was said now."""
        if key in self._said:
            return False
        if len(self._said) >= self.MAX_KEYS:
            del self._said[next(iter(self._said))]
        self._said[key] = None
        self._say(line)
        return True
