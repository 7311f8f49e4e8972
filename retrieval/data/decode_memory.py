"""What one decode holds, per format, estimated from the header before any pixel is decoded.

``read_image`` refuses an image whose estimate is over ``MAX_DECODE_BYTES``, so one decode stays under 300 MB;
the estimate is also what it reserves of the process-wide ``retrieval.data.decode_budget.DECODE_BUDGET``. The
decoded image is reduced right away (``region_and_factor``: an extreme aspect ratio cropped around the centre, a
large image shrunk by an integer factor, strip by strip), and the estimate counts that reduced copy and a strip.
The per-format factors are measured with benchmarks/decode_memory.py (docs/BENCHMARKS.md, "Decoder memory per
format"; Pillow 12.3).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    from PIL import Image

MIB = 2**20
MAX_DECODE_BYTES = 280 * MIB  # one decode's estimated peak; the documented promise is < 300 MB above idle
# What a decode holds beside the decoded image (Pillow: 1 byte a pixel for 1, L, P; 2 for 16-bit grey; 4 else):
WEBP_DECODER_BYTES = 12  # per pixel: libwebp's two RGBA canvases and the frame's copy as Python bytes (16 in all)
BMP_RLE_DECODER_BYTES = 2  # per pixel: Pillow's RLE decoder (Python) builds the pixels in a bytearray, then copies
# per pixel of one strip or tile of a compressed TIFF, at least (libtiff's RGBA path; its samples as stored when
# more): a one-strip 40-megapixel RGB deflate TIFF peaked 267 MB above idle (estimate 313), a one-strip float
# one 305 MB (313), measured as tests/data/test_decode.py's ESTIMATE_PROBE does; an uncompressed TIFF or a binary PNM
# is read by Pillow's raw decoder straight into the image (160 MB for 40 megapixels of RGB)
TIFF_DECODER_BYTES = 4
JPEG_COEFFICIENT_BYTES = 128  # per 8x8 block: libjpeg keeps every coefficient of a progressive or multi-scan JPEG
STRIP_BYTES_PER_PIXEL = 24  # per pixel of a strip being reduced: its crop and conversions (17 measured at most)
DECODER_BYTES = 8 * MIB  # the decoders' own buffers (rows, zlib window, Huffman tables) and allocator slack
# What Pillow holds for a TIFF's tags (``tiff_tags.tag_memory_bytes``: its pages' tag data and unpacked numbers,
# walked before Pillow reads them) counts this many times: the first page is read again for its EXIF
TIFF_TAG_COPIES = 2
MAX_ASPECT = 8  # longer side / shorter side kept after decoding (centre crop beyond it)
MIN_SHORT_SIDE = 768  # large images are shrunk by an integer factor while the short side stays >= this
STRIP_PIXELS = 1 << 20  # pixels per strip when cropping and shrinking


def region_and_factor(width: int, height: int) -> tuple[tuple[int, int, int, int], int]:
    """The part of the image kept (centre, at most MAX_ASPECT:1) and the integer factor it is shrunk by."""
    short = min(width, height)
    keep_w, keep_h = min(width, MAX_ASPECT * short), min(height, MAX_ASPECT * short)
    left, top = (width - keep_w) // 2, (height - keep_h) // 2
    return (left, top, left + keep_w, top + keep_h), max(1, short // MIN_SHORT_SIDE)


def estimate_decode_bytes(image: Image.Image, source_size: tuple[int, int], buffered_jpeg: bool = False) -> int:
    """Peak bytes ``read_image`` holds for an opened, not yet decoded image (after ``draft``), from its header.

    The decoded image, what its decoder holds beside it, and the reduced RGB(A) image built from it strip by
    strip; per-format factors measured (docs/BENCHMARKS.md, "Decoder memory per format"). An upper bound.
    """
    if image.format == "WEBP":
        return webp_bytes(image.size)
    pixels = image.width * image.height
    if any(tile.codec_name == "bmp_rle" for tile in image.tile):
        decoder = pixels * BMP_RLE_DECODER_BYTES
    elif any(tile.codec_name == "libtiff" for tile in image.tile):  # compressed TIFF (uncompressed: Pillow's own)
        decoder = _tiff_buffer_bytes(image)
    elif buffered_jpeg:  # every DCT coefficient of the file at its full size, whatever the draft scale
        decoder = _jpeg_blocks(image.layer, *source_size) * JPEG_COEFFICIENT_BYTES
    else:
        decoder = 0
    # these decoders free their buffers when they finish, before the reduced image is built
    return pixels * _bytes_per_pixel(image.mode) + max(decoder, _reduced_bytes(image.size)) + DECODER_BYTES


def _tiff_buffer_bytes(image: Image.Image) -> int:
    """libtiff's buffer for one strip or tile of a TIFF (a compressed TIFF is often one strip: the whole image),
    with its samples as stored; at least 4 bytes a pixel, as YCbCr and old-style JPEG are decoded through RGBA."""
    tags, (width, height) = image.tag_v2, image.size
    if 322 in tags and 323 in tags:  # TileWidth, TileLength
        pixels = int(tags[322]) * int(tags[323])
    else:  # RowsPerStrip, absent: one strip
        pixels = width * min(height, int(tags.get(278, height)))
    bits = tags.get(258, (1,))  # BitsPerSample: one value per sample, or one for all of SamplesPerPixel
    bits = bits if isinstance(bits, tuple) else (int(bits),)
    bits = max(sum(bits), max(bits) * int(tags.get(277, 1)))
    return pixels * max(TIFF_DECODER_BYTES, -(-bits // 8))


def webp_bytes(size: tuple[int, int]) -> int:
    """Every WebP (still or animated, lossy or lossless, RGB or RGBA) is decoded by libwebp's WebPAnimDecoder,
    whose canvases live as long as the image: they are still there while the reduced image is built."""
    return size[0] * size[1] * (4 + WEBP_DECODER_BYTES) + _reduced_bytes(size) + DECODER_BYTES


def _reduced_bytes(size: tuple[int, int]) -> int:
    """The reduced RGB(A) image built from a decoded one of ``size`` (4 bytes a pixel in Pillow), and a strip."""
    (left, top, right, bottom), factor = region_and_factor(*size)
    pixels = -(-(right - left) // factor) * -(-(bottom - top) // factor)
    return pixels * 4 + min(size[0] * size[1], STRIP_PIXELS) * STRIP_BYTES_PER_PIXEL


def webp_canvas(handle: BinaryIO, start: int) -> tuple[int, int] | None:
    """The canvas size a WebP file declares (its first chunk), or None for other files; read from its first bytes."""
    head = handle.read(30)
    handle.seek(start)
    if len(head) < 30 or head[:4] != b"RIFF" or head[8:12] != b"WEBP":
        return None
    if head[12:16] == b"VP8X":  # extended: 24-bit canvas width - 1 and height - 1
        return 1 + int.from_bytes(head[24:27], "little"), 1 + int.from_bytes(head[27:30], "little")
    if head[12:16] == b"VP8L" and head[20] == 0x2F:  # lossless: 14-bit width - 1 and height - 1
        bits = int.from_bytes(head[21:25], "little")
        return 1 + (bits & 0x3FFF), 1 + (bits >> 14 & 0x3FFF)
    if head[12:16] == b"VP8 ":  # lossy: a key frame's 14-bit width and height after its start code
        return int.from_bytes(head[26:28], "little") & 0x3FFF, int.from_bytes(head[28:30], "little") & 0x3FFF
    return None


def _bytes_per_pixel(mode: str) -> int:
    """What Pillow holds per pixel: 1 byte for 1, L and P, 2 for 16-bit grey, 4 for every other mode."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def _jpeg_blocks(layers: Sequence[tuple[int, int, int, int]], width: int, height: int) -> int:
    """8x8 blocks in all components of a JPEG of ``width`` x ``height`` with these (id, h, v, table) samplings."""
    h_max = max([h for _, h, _, _ in layers] + [1])
    v_max = max([v for _, _, v, _ in layers] + [1])
    return sum(-(-width * h // (8 * h_max)) * -(-height * v // (8 * v_max)) for _, h, v, _ in layers)


def jpeg_buffers_coefficients(image: Image.Image, handle: BinaryIO, start: int) -> bool:
    """Whether libjpeg keeps the whole image's coefficients: progressive, or a first scan without every component
    (libjpeg's ``has_multiple_scans``); then a reduced-scale decode still holds 2 bytes a sample at full size."""
    if image.info.get("progressive") or image.info.get("progression"):
        return True
    if len(image.layer) == 1:
        return False
    position = handle.tell()
    try:
        handle.seek(start + 2)  # after SOI: every segment before the first scan says its length
        while len(marker := handle.read(2)) == 2 and marker[0] == 0xFF:
            if marker[1] == 0xFF:  # a fill byte
                handle.seek(-1, os.SEEK_CUR)
                continue
            length = int.from_bytes(handle.read(2), "big")
            if marker[1] == 0xDA:  # start of scan: its first byte is the number of components in it
                return handle.read(1) != bytes([len(image.layer)])
            handle.seek(length - 2, os.SEEK_CUR)
        return True  # no scan header where one belongs: assume the worst
    finally:
        handle.seek(position)


def too_much_memory(fmt: str, size: tuple[int, int], estimate: int, buffered_jpeg: bool) -> str:
    """Why an image is refused for its memory, and what to send instead."""
    width, height = size
    fixed = DECODER_BYTES + STRIP_PIXELS * STRIP_BYTES_PER_PIXEL  # the part of the estimate that does not scale
    fits = max(1, int(width * height * (MAX_DECODE_BYTES - fixed) / max(1, estimate - fixed) / 1e6))
    if fmt == "WEBP":
        how = (f"re-encode it as PNG or JPEG (libwebp holds {4 + WEBP_DECODER_BYTES} bytes a pixel while decoding, "
               f"PNG 4) or send one of at most about {fits} megapixels")
    elif buffered_jpeg:
        how = (f"save it as a baseline (not progressive) JPEG, which is decoded at reduced scale in little memory, "
               f"or send one of at most about {fits} megapixels")
    else:
        how = f"send one of at most about {fits} megapixels"
    return (f"a {fmt} of {width}x{height} would hold about {estimate / MIB:.0f} MB while decoding, over the "
            f"{MAX_DECODE_BYTES / MIB:.0f} MB one decode may use; {how}; a higher pixel limit does not raise this one")
