"""How much tag data a TIFF structure (a TIFF file, or the EXIF block of a JPEG, PNG or WebP) makes Pillow copy.

Pillow copies the data of every tag of a directory into memory when it reads the directory, with no bound of its
own; distinct tags may point at the same bytes, so a 200 KB file can ask for gigabytes. ``tag_data_bytes`` walks
the directories in plain Python (12- or 20-byte entries, no data read) before Pillow does, so that the decoder can
refuse such a file and count the rest in its memory estimate.
"""

from __future__ import annotations

from collections.abc import Callable

# bytes per value of each TIFF field type Pillow reads (types it does not know are skipped, as Pillow skips them)
TYPE_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
MAX_ENTRIES = 65_535  # entries of one directory: a classic TIFF cannot hold more; a BigTIFF claiming more is refused
CLASSIC = {b"II*\0": "little", b"MM\0*": "big"}
BIG = {b"II+\0": "little", b"MM\0+": "big"}


class TagDataError(ValueError):
    """A directory whose tags refer to more data than the structure holds, or that cannot be walked."""


def is_tiff(head: bytes) -> bool:
    """Whether ``head`` starts with a TIFF or BigTIFF signature."""
    return head[:4] in CLASSIC or head[:4] in BIG


def tag_data_bytes(read_at: Callable[[int, int], bytes], size: int, max_directories: int) -> int:
    """The most bytes of out-of-line tag data one of the first ``max_directories`` directories refers to.

    ``read_at(offset, n)`` returns up to ``n`` bytes at ``offset`` of the structure, ``size`` is its length.
    Raises ``TagDataError`` when one directory refers to more bytes than the structure holds (its tags overlap: a
    real file never needs that) or claims more than ``MAX_ENTRIES`` entries.
    """
    head = read_at(0, 16)
    big = head[:4] in BIG
    order = BIG.get(head[:4]) or CLASSIC.get(head[:4])
    if order is None:
        raise TagDataError("not a TIFF structure")

    def number(raw: bytes) -> int:
        return int.from_bytes(raw, order)

    count_bytes, entry_bytes, inline_bytes = (8, 20, 8) if big else (2, 12, 4)
    offset = number(head[8:16] if big else head[4:8])
    seen: set[int] = set()
    most = 0
    while offset and offset < size and offset not in seen and len(seen) < max_directories:
        seen.add(offset)
        entries = number(read_at(offset, count_bytes))
        if entries > MAX_ENTRIES:
            raise TagDataError(f"a directory claims {entries} entries")
        table = read_at(offset + count_bytes, entries * entry_bytes + inline_bytes)
        total = 0
        for start in range(0, min(entries * entry_bytes, len(table) - entry_bytes + 1), entry_bytes):
            unit = TYPE_BYTES.get(number(table[start + 2:start + 4]))
            if unit is None:
                continue
            length = number(table[start + 4:start + 4 + inline_bytes]) * unit
            if length > inline_bytes:  # stored elsewhere in the structure: Pillow copies it
                total += min(length, size)
        if total > size:
            raise TagDataError(f"its tags refer to {total} bytes of data, more than the {size} bytes it holds")
        most = max(most, total)
        offset = number(table[entries * entry_bytes:entries * entry_bytes + inline_bytes] or b"\0")
    return most
