"""Synthetic images: a small labelled gallery that needs no download, and images at the decoder's limits.

``write_digits`` writes scikit-learn's digits as a class-per-folder gallery (to try indexing and search, or to time
them). The byte builders make the costliest images a decoder meets: formats Pillow cannot write (16-bit RGBA PNG,
RLE8 BMP), a decompression bomb's header, EXIF turns with ICC profiles; the decoder's memory tests and
``benchmarks/decode_memory.py`` measure ``retrieval.data.decode`` on them.
"""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageCms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_digits(folder: Path, count: int = 40, start: int = 0) -> list[Path]:
    """``count`` distinct scikit-learn digits (from the ``start``-th) as 32x32 PNGs in per-class sub-folders."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    paths, seen = [], set()
    for i in range(start, len(digits.images)):
        pixels = (digits.images[i] * 255 / 16).astype(np.uint8)
        if pixels.tobytes() in seen:
            continue
        seen.add(pixels.tobytes())
        path = folder / str(digits.target[i]) / f"digit_{i:04d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).resize((32, 32), Image.NEAREST).convert("RGB").save(path)
        paths.append(path)
        if len(paths) == count:
            break
    return paths


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    """``image`` saved as ``fmt`` (Pillow's save parameters), in memory."""
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def flat(mode: str, fmt: str = "PNG", colour=None, **params) -> Callable[[tuple[int, int]], bytes]:
    """A function size -> the bytes of a one-colour image in ``mode`` saved as ``fmt``."""
    return lambda size: encode(Image.new(mode, size, colour), fmt, **params)


def png_chunk(kind: bytes, body: bytes) -> bytes:
    """One PNG chunk: length, type, body and CRC."""
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def bomb_png(width: int = 200_000, height: int = 200_000) -> bytes:
    """A tiny PNG whose header declares ``width`` x ``height`` pixels (a decompression bomb's header)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", zlib.compress(b"")) + png_chunk(
        b"IEND", b""
    )


def png_rgba16(size: tuple[int, int]) -> bytes:
    """A 16-bit RGBA PNG (Pillow cannot write one): rows of zeros."""
    width, height = size
    packer, row = zlib.compressobj(1), bytes(1 + width * 8)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return PNG_SIGNATURE + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


def bmp_rle8(size: tuple[int, int]) -> bytes:
    """An RLE8 BMP (Pillow cannot write one): runs of 255 pixels, decoded by Pillow's Python RLE decoder."""
    width, height = size
    row = bytes((255, 1)) * (width // 255) + (bytes((width % 255, 1)) if width % 255 else b"") + b"\0\0"
    data = row * height + b"\0\1"
    palette = b"".join(bytes((i, i, 0, 0)) for i in range(256))
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(data), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + palette + data


def turned_with_profile() -> dict:
    """Save parameters: EXIF orientation 6 (turn 90 degrees) and an sRGB ICC profile, the decoder's costliest
    conversions."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return {"exif": exif.tobytes(), "icc_profile": ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()}
