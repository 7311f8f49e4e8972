"""What the tag directories of a TIFF structure (a TIFF file, or the EXIF block of a JPEG, PNG or WebP) cost Pillow.

Pillow reads a directory's tags with no bound of its own: it copies every tag's data (distinct tags may point at the
same bytes, so a 200 KB file can ask for gigabytes) and turns every number into Python objects (a RATIONAL becomes
about 300 bytes, a strip offset one tile object each), so 10 MB of values cost over a gigabyte and a minute before any
pixel is read. ``tag_memory_bytes`` walks the directories in plain Python (12- or 20-byte entries, no value read)
before Pillow does, so that the decoder can refuse such a file or count what it will cost.
"""

from __future__ import annotations

from collections.abc import Callable

# bytes per value of each TIFF field type Pillow reads (types it does not know are skipped, as Pillow skips them)
TYPE_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 2, 9: 4, 10: 8, 11: 4, 12: 8, 13: 4, 16: 8, 17: 8, 18: 8}
BYTE_TYPES = {1, 2, 6, 7}  # BYTE, ASCII, SBYTE, UNDEFINED: Pillow keeps them as one bytes object
VALUE_OBJECT_BYTES = 300  # what Pillow holds per number it unpacks (an IFDRational and its Fraction: ~290 measured)
MAX_ENTRIES = 65_535  # entries of one directory: a classic TIFF cannot hold more; a BigTIFF claiming more is refused
CLASSIC = {b"II*\0": "little", b"MM\0*": "big"}
BIG = {b"II+\0": "little", b"MM\0+": "big"}


class TagDataError(ValueError):
    """A directory whose tags refer to more data than the structure holds, or that cannot be walked."""


def is_tiff(head: bytes) -> bool:
    """Whether ``head`` starts with a TIFF or BigTIFF signature."""
    return head[:4] in CLASSIC or head[:4] in BIG


def header(head: bytes) -> tuple[str, bool, int]:
    """(byte order, BigTIFF?, offset of the first directory) of a structure that starts with ``head`` (16 bytes);
    ``TagDataError`` when it has no TIFF signature."""
    big = head[:4] in BIG
    order = BIG.get(head[:4]) or CLASSIC.get(head[:4])
    if order is None:
        raise TagDataError("not a TIFF structure")
    return order, big, int.from_bytes(head[8:16] if big else head[4:8], order)


def tag_memory_bytes(read_at: Callable[[int, int], bytes], size: int, max_directories: int) -> int:
    """What Pillow holds for the tags of the first ``max_directories`` directories, read one after the other (the
    sum: each is read, and its numbers unpacked, as pages are counted): bytes kept as they are, numbers at
    ``VALUE_OBJECT_BYTES`` each.

    ``read_at(offset, n)`` returns up to ``n`` bytes at ``offset`` of the structure, ``size`` is its length.
    Raises ``TagDataError`` when one directory's tags refer to more bytes than the structure holds (they overlap: a
    real file never needs that) or it claims more than ``MAX_ENTRIES`` entries.
    """
    order, big, offset = header(read_at(0, 16))

    def number(raw: bytes) -> int:
        return int.from_bytes(raw, order)

    # the count field is as wide as the inline value field: 4 bytes in a classic TIFF, 8 in a BigTIFF
    count_bytes, entry_bytes, inline_bytes = (8, 20, 8) if big else (2, 12, 4)
    seen: set[int] = set()
    memory = 0
    while offset and offset < size and offset not in seen and len(seen) < max_directories:
        seen.add(offset)
        entries = number(read_at(offset, count_bytes))
        if entries > MAX_ENTRIES:
            raise TagDataError(f"a directory claims {entries} entries")
        table = read_at(offset + count_bytes, entries * entry_bytes + inline_bytes)
        referred = 0
        for start in range(0, min(entries * entry_bytes, len(table) - entry_bytes + 1), entry_bytes):
            kind = number(table[start + 2:start + 4])
            if kind not in TYPE_BYTES:
                continue
            values = number(table[start + 4:start + 4 + inline_bytes])
            length = min(values * TYPE_BYTES[kind], size)
            if length > inline_bytes:  # stored elsewhere in the structure: Pillow copies it
                referred += length
            memory += length if kind in BYTE_TYPES else min(values, size) * VALUE_OBJECT_BYTES
        if referred > size:
            raise TagDataError(f"its tags refer to {referred} bytes of data, more than the {size} bytes it holds")
        offset = number(table[entries * entry_bytes:entries * entry_bytes + inline_bytes] or b"\0")
    return memory
