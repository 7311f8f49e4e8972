"""One readable line for any path (``printable_path``): what every message that names a hostile file name uses.
A leaf: no NumPy, no faiss, so the data sets and the index's listing share it."""

from __future__ import annotations

import os

DISPLAY_LIMIT = 512  # characters of an escaped path shown in a message


def printable_path(path: str | os.PathLike[str], limit: int | None = DISPLAY_LIMIT) -> str:
    r"""One readable line for any path: bytes that are not UTF-8 as ``\xNN``, control and format
    characters (newline, right-to-left override...) and backslashes escaped; cut to ``limit`` characters
    (None: never cut).

    The result is valid UTF-8 (no surrogates), so it can be stored and printed anywhere.
    """
    out = []
    for char in os.fspath(path):
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:  # a surrogate escape: one raw byte of a name that is not UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char == "\\":
            out.append("\\\\")
        elif not char.isprintable():
            out.append(char.encode("unicode_escape").decode("ascii"))
        else:
            out.append(char)
    text = "".join(out)
    return text if limit is None or len(text) <= limit else f"{text[: limit - 40]}...({len(text)} characters in all)"
