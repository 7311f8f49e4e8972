"""Memory bounds on reading a hostile parquet file's text columns (a manifest, a build-from-embeddings metadata part),
checked before its values are unpacked: a few KB of zstd, or one dictionary value that every row points at, can
unpack to gigabytes.

Two checks, each against what a column's values take at their bounds (``bounds``: column -> the most bytes one
value may take, and that bound as people read it): ``check_chunk_sizes``, from the file's metadata before anything
is read, each column chunk's uncompressed size; ``check_unpacked_sizes``, per batch read with its text columns kept
dictionary-encoded (``read_dictionary``), the bytes its values would take once unpacked.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# A column chunk's uncompressed bytes: per row, its value at its bound with a 4-byte length, up to VALUE_COPIES
# times, and PAGE_BYTES; per chunk, COLUMN_CHUNK_BYTES more. pyarrow's worst layout (a page per value) writes each
# value 3 times (itself, its page's min and max) and about 40 bytes of header and levels per page.
BYTES_PER_CHAR = 4  # UTF-8's longest character
NUMBER_BYTES = 8  # an integer or float column's value, at its widest
VALUE_COPIES = 5  # the value, its page's min and max, and the deprecated min and max some writers fill too
PAGE_BYTES = 128  # a data page's header and levels, or a dictionary page's header and the value's index
COLUMN_CHUNK_BYTES = 4096  # the chunk's own headers and statistics

Bounds = Mapping[str, tuple[int, str]]  # column -> (the most bytes one value takes, that bound in words)


def text_bound(chars: int) -> tuple[int, str]:
    """The bound of a text value of at most ``chars`` characters."""
    return BYTES_PER_CHAR * chars, f"{chars} characters"


def number_bound() -> tuple[int, str]:
    """The bound of an integer or float value."""
    return NUMBER_BYTES, "a number"


def chunk_bound(rows: int, value_bytes: int) -> int:
    """The most uncompressed bytes a column chunk of ``rows`` values of at most ``value_bytes`` each takes."""
    return rows * (VALUE_COPIES * (value_bytes + 4) + PAGE_BYTES) + COLUMN_CHUNK_BYTES


def check_chunk_sizes(handle: Any, bounds: Bounds, shown: str, rewrite: str = "the file") -> None:
    """Refuse a parquet file (an opened ``pyarrow.parquet.ParquetFile``) whose column chunks of the columns in
    ``bounds`` hold more bytes uncompressed than their rows' values can take, from its metadata alone: no value is
    read. ``rewrite`` names what the message asks to write again."""
    metadata = handle.metadata
    place = {metadata.schema.column(j).path: j for j in range(metadata.num_columns)}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        rows = row_group.num_rows
        for name, (value_bytes, said) in bounds.items():
            if name not in place:
                continue
            size = row_group.column(place[name]).total_uncompressed_size
            bound = chunk_bound(rows, value_bytes)
            if size > bound:
                raise ValueError(
                    f"{shown}: column {name!r} of row group {group} ({rows:,} rows) holds {size:,} bytes, more than "
                    f"the {bound:,} that {rows:,} values of at most {said} take however they are laid out: a "
                    f"compressed bomb, or values over their bound; write {rewrite} again with every {name!r} value "
                    f"within {said} (nothing of it was read)")


def check_unpacked_sizes(batch: Any, bounds: Bounds, shown: str, first_row: int, rewrite: str = "the file") -> None:
    """Refuse a batch (a ``pyarrow.RecordBatch`` read with its text columns dictionary-encoded) whose column of
    ``bounds`` would take more bytes unpacked than its rows' values can take; ``first_row``: the batch's first row
    in the file (0-based), for the message."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = batch.num_rows
    for name, (value_bytes, said) in bounds.items():
        index = batch.schema.get_field_index(name)
        if index < 0:
            continue
        column = batch.column(index)
        if not pa.types.is_dictionary(column.type) or not (
                pa.types.is_string(column.type.value_type) or pa.types.is_large_string(column.type.value_type)
                or pa.types.is_binary(column.type.value_type) or pa.types.is_large_binary(column.type.value_type)):
            continue  # a plain column is unpacked already, within its chunk's bound
        lengths = pc.binary_length(column.dictionary).cast(pa.int64())
        size = pc.sum(pc.take(lengths, column.indices)).as_py() or 0
        bound = rows * value_bytes
        if size > bound:
            raise ValueError(
                f"{shown}: column {name!r} of rows {first_row + 1:,} to {first_row + rows:,} would unpack to "
                f"{size:,} bytes, more than the {bound:,} that {rows:,} values of at most {said} take: a dictionary "
                f"value repeated row after row (a compressed bomb), or values over their bound; write {rewrite} "
                f"again with every {name!r} value within {said} (none of these rows was unpacked)")
