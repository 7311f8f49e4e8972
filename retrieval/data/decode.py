"""The one image decoder: untrusted bytes or a file -> an 8-bit sRGB image, bounded in memory and time.

Every path that reads an image (training data sets, the index builders, ``retrieval search``, the API, the
Gradio upload, export verification) calls ``read_image``, so the gallery, the queries and the training data
are decoded alike:

- only the formats a gallery may hold are opened (``IMAGE_FORMATS``: JPEG, PNG, WebP, BMP, GIF, TIFF, binary
  PNM): no plugin for exotic formats ever sees untrusted bytes, and the data sets, the gallery listing and the
  API take the file extensions of these formats (``IMAGE_EXTENSIONS``) and no others;
- the pixel count is checked from the header before any pixel is decoded (decompression bombs; a large JPEG
  is decoded at 1/2, 1/4 or 1/8 scale and the limit applies to that), files that are not regular files
  (``/dev/zero``, FIFOs) are refused before they are read;
- so is the memory the decode will hold (``estimate_decode_bytes``: bytes per pixel measured for each format,
  libwebp's canvases, every coefficient of a progressive JPEG): an image over ``MAX_DECODE_BYTES`` is refused,
  so one decode stays under 300 MB; the decodes running at once share ``DECODE_BUDGET`` (twice that), and the
  heap a large decode freed is given back to the system (``trim_heap``);
- a decoded image is reduced right away: an extreme aspect ratio is cropped around the centre to
  ``MAX_ASPECT``:1 (an evaluation centre crop never looks further out) and a very large image is shrunk by an
  integer factor while its short side stays >= ``MIN_SHORT_SIDE``, so later resizes stay small; the reduced
  image is built strip by strip, each strip converted (bit depth, colours, orientation) on the way, so no
  full-size copy of the decoded image is ever made;
- 16- and 32-bit greyscale is scaled to 8 bits by its range (never clipped), CMYK and images with an ICC
  profile are converted to sRGB, the EXIF orientation is applied, an animated image gives its first frame (a
  multi-page TIFF its first page);
- transparency is kept (RGBA) and composited onto the model's background colour by ``FlattenAlpha``, the
  first step of every preprocessing pipeline (``retrieval.data.transforms``), so that the colour is a model
  setting recorded with the model like mean and std.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import io
import os
import re
import stat
import struct
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageCms, ImageColor, UnidentifiedImageError

from retrieval.data.tiff_tags import TagDataError, header, is_tiff, tag_memory_bytes

# A 40-megapixel RGBA image decodes into 160 MB; what a decode holds beside the image is estimated below.
DEFAULT_MAX_PIXELS = 40_000_000
MIB = 2**20
MAX_DECODE_BYTES = 280 * MIB  # one decode's estimated peak; the documented promise is < 300 MB above idle
DECODE_BUDGET_BYTES = 2 * MAX_DECODE_BYTES  # what the decodes running at once in a process may hold together
TRIM_BYTES = 32 * MIB  # after a decode estimated at this or more, freed heap is given back to the system
# What a decode holds beside the decoded image (Pillow: 1 byte a pixel for 1, L, P; 2 for 16-bit grey; 4 else),
# measured with benchmarks/decode_memory.py (docs/BENCHMARKS.md, "Decoder memory per format"; Pillow 12.3):
WEBP_DECODER_BYTES = 12  # per pixel: libwebp's two RGBA canvases and the frame's copy as Python bytes (16 in all)
BMP_RLE_DECODER_BYTES = 2  # per pixel: Pillow's RLE decoder (Python) builds the pixels in a bytearray, then copies
# per pixel of one strip or tile of a compressed TIFF, at least (libtiff's RGBA path; its samples as stored when
# more): a one-strip 40-megapixel RGB deflate TIFF peaked 267 MB above idle (estimate 313), a one-strip float
# one 305 MB (313), measured as tests/test_decode.py's ESTIMATE_PROBE does; an uncompressed TIFF or a binary PNM
# is read by Pillow's raw decoder straight into the image (160 MB for 40 megapixels of RGB)
TIFF_DECODER_BYTES = 4
JPEG_COEFFICIENT_BYTES = 128  # per 8x8 block: libjpeg keeps every coefficient of a progressive or multi-scan JPEG
STRIP_BYTES_PER_PIXEL = 24  # per pixel of a strip being reduced: its crop and conversions (17 measured at most)
DECODER_BYTES = 8 * MIB  # the decoders' own buffers (rows, zlib window, Huffman tables) and allocator slack
MAX_ASPECT = 8  # longer side / shorter side kept after decoding (centre crop beyond it)
MIN_SHORT_SIDE = 768  # large images are shrunk by an integer factor while the short side stays >= this
STRIP_PIXELS = 1 << 20  # pixels per strip when cropping and shrinking
# The formats ``read_image`` opens (Pillow's names), each with the file extensions it is kept under and the media
# type it is served as: the project's one list of image files (data sets, gallery listing, uploads, image route).
# Not opened: TGA (no signature, so any unrecognised file would parse as one), ICO/CUR (the sizes in their
# directory are not those decoded), and every other Pillow plugin.
IMAGE_FORMATS: dict[str, dict[str, str]] = {
    "JPEG": {".jpg": "image/jpeg", ".jpeg": "image/jpeg"},  # includes phone MPO files
    "PNG": {".png": "image/png"},
    "WEBP": {".webp": "image/webp"},
    "BMP": {".bmp": "image/bmp"},
    "GIF": {".gif": "image/gif"},
    "TIFF": {".tif": "image/tiff", ".tiff": "image/tiff"},
    "PPM": {  # binary PNM only (see ``SLOW_DECODERS``)
        ".pbm": "image/x-portable-bitmap", ".pgm": "image/x-portable-graymap", ".ppm": "image/x-portable-pixmap",
        ".pnm": "image/x-portable-anymap",
    },
}
ACCEPTED_FORMATS = tuple(IMAGE_FORMATS)
# the formats as messages name them (Pillow's names are what ``Image.open`` takes)
ACCEPTED_FORMATS_TEXT = ", ".join({"WEBP": "WebP", "PPM": "binary PNM"}.get(name, name)
                                  for name in ACCEPTED_FORMATS)
IMAGE_MEDIA_TYPES = {extension: media for types in IMAGE_FORMATS.values() for extension, media in types.items()}
IMAGE_EXTENSIONS = frozenset(IMAGE_MEDIA_TYPES)
# Pillow decoders written in Python, about 3 s a megapixel (minutes for an image under the pixel limit): binary
# PNM whose maxval is not 255 (nor 65535 for greyscale). Refused, with the fix (plain PNM never reaches Pillow).
SLOW_DECODERS = ("ppm",)
MAX_COUNTED_PAGES = 16  # a TIFF's pages are counted up to this: each costs a parse (a file may hold 100,000)
# What Pillow holds for a TIFF's tags (``tiff_tags.tag_memory_bytes``: its pages' tag data and unpacked numbers,
# walked before Pillow reads them) counts this many times: the first page is read again for its EXIF
TIFF_TAG_COPIES = 2
# an EXIF block (JPEG, PNG, WebP) whose tags would cost more than this is not read: the image stays as stored
MAX_EXIF_BYTES = 16 * MIB
# Pillow reads a PNM header (magic, size, maxval, comments) a byte at a time: one that does not end within this
# is refused before Pillow sees it (a 10 MB comment takes seconds)
MAX_PNM_HEADER_BYTES = 4096
PNM_MAGICS = (b"P4", b"P5", b"P6")  # binary PNM; Pillow's PPM plugin also opens P1-P3, PFM (Pf, PF) and Py* files
_PNM_NUMBER = re.compile(rb"(?:\s|#[^\r\n]*[\r\n])*(\d+)")
DEFAULT_BACKGROUND = (255, 255, 255)  # transparent pixels become white unless a model says otherwise
_SRGB = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))


class ImageDecodeError(ValueError):
    """An image that cannot be used; ``kind`` is one of KINDS, the message says what to do."""

    KINDS = ("empty", "not_file", "not_image", "too_large", "truncated", "unreadable")

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


ERROR_LABELS = {
    "empty": "empty file", "not_file": "not a regular file", "not_image": "not an image", "too_large": "too large",
    "truncated": "truncated image", "unreadable": "unreadable",
}


def describe_decode_error(exc: BaseException) -> str:
    """Why an image file could not be used, in the words the index's error list and training reports share."""
    if isinstance(exc, ImageDecodeError):
        return "empty file (0 bytes)" if exc.kind == "empty" else f"{ERROR_LABELS[exc.kind]}: {exc}"
    if isinstance(exc, FileNotFoundError):
        return "missing file"
    if isinstance(exc, PermissionError):
        return f"unreadable: permission denied ({exc.strerror})"
    return f"unreadable: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class DecodedImage:
    """``image`` is RGB or RGBA (8 bits, sRGB); ``notes`` say what the decoder changed that a user should know."""

    image: Image.Image
    format: str
    frames: int = 1
    notes: tuple[str, ...] = ()
    estimated_bytes: int = 0  # the peak memory its decode was estimated to hold (``estimate_decode_bytes``)


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for reading, refusing anything that is not a regular file (devices, FIFOs, sockets)."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageDecodeError("not_file", f"{os.fsdecode(path)!r} is not a regular file; give an image file")
    return os.fdopen(fd, "rb")


class DecodeBudget:
    """Bytes the decodes running at once may hold together: ``reserve`` waits, in arrival order, until one fits.

    A reservation larger than the whole budget is clamped to it (it then runs alone), so none waits forever.
    """

    def __init__(self, total_bytes: int) -> None:
        self.total, self.held = int(total_bytes), 0
        self._changed = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()

    @contextlib.contextmanager
    def reserve(self, nbytes: int) -> Iterator[int]:
        """Hold ``nbytes`` of the budget (clamped to 0..total) for the ``with`` block; waits until they fit."""
        nbytes, ticket = min(max(int(nbytes), 0), self.total), object()
        with self._changed:
            self._queue.append(ticket)
            try:  # first come, first served: a large decode is not starved by a stream of small ones
                self._changed.wait_for(lambda: self._queue[0] is ticket and self.held + nbytes <= self.total)
                self.held += nbytes
            finally:
                self._queue.remove(ticket)
                self._changed.notify_all()  # the next in line may fit too
        try:
            yield nbytes
        finally:
            with self._changed:
                self.held -= nbytes
                self._changed.notify_all()


DECODE_BUDGET = DecodeBudget(DECODE_BUDGET_BYTES)
if hasattr(os, "register_at_fork"):  # a forked worker (DataLoader) has memory of its own, and no lock held in it
    os.register_at_fork(after_in_child=lambda: DECODE_BUDGET.__init__(DECODE_BUDGET.total))


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:  # glibc only (Linux); musl, macOS and Windows have no malloc_trim and return memory on their own terms
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _load_malloc_trim()


def trim_heap() -> None:
    """Give the heap memory freed so far back to the system (glibc's ``malloc_trim``); a no-op elsewhere.

    glibc keeps the freed blocks of a large decode: it raises its mmap threshold once a big block is freed, so
    the next 16 MB blocks of Pillow's images come from the heap, and every thread has a heap (arena) of its own.
    Decoding the worst images in a server's 16 threads, the process stayed 0.9 to 1.5 GB above idle afterwards
    (and peaked at 3x the decode budget); ``read_image`` calls this after every large decode (``TRIM_BYTES``).
    """
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def read_image(
    source: bytes | bytearray | memoryview | str | os.PathLike | BinaryIO,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> DecodedImage:
    """Decode the first frame of an image (bytes, a path or a binary file) fully, within the limits above.

    Raises ``ImageDecodeError`` for anything unusable; never returns a half-decoded image.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        decoded = _decode(io.BytesIO(source), max_pixels)
    elif isinstance(source, (str, os.PathLike)):
        with open_regular_file(source) as handle:
            decoded = _decode(handle, max_pixels)
    else:
        decoded = _decode(source, max_pixels)
    if decoded.estimated_bytes >= TRIM_BYTES:  # the file's full-size pixels and decoder are gone by now
        trim_heap()
    return decoded


def _pixels(limit: int) -> str:
    """A pixel limit as people read it: ``40,000,000 pixels (about 6324 x 6324)``."""
    side = int(limit ** 0.5)
    return f"{limit:,} pixels (about {side} x {side})"


def open_image(path: str | os.PathLike) -> Image.Image:
    """An image file decoded by ``read_image``: RGB or RGBA (transparency is flattened by the transforms)."""
    return read_image(path).image


def _decode(handle: BinaryIO, max_pixels: int) -> DecodedImage:
    start = handle.tell()
    if not handle.read(1):
        raise ImageDecodeError("empty", "the image is empty (0 bytes)")
    handle.seek(start)
    tag_bytes = _check_before_opening(handle, start)
    canvas = _webp_canvas(handle, start)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as held:
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if canvas is not None:  # Pillow's WebP plugin has libwebp allocate its canvases as it opens the file
                held.enter_context(DECODE_BUDGET.reserve(_check_memory("WEBP", canvas, _webp_bytes(canvas))))
            image = held.enter_context(Image.open(handle, formats=ACCEPTED_FORMATS))
            frames, estimate = _plan(image, handle, start, max_pixels, TIFF_TAG_COPIES * tag_bytes)
            if canvas is None:
                held.enter_context(DECODE_BUDGET.reserve(estimate))
            image.load()
            return _normalise(image, frames, estimate)
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        limit = min(max_pixels, Image.MAX_IMAGE_PIXELS or max_pixels)  # Pillow's own limit applies first
        raise ImageDecodeError("too_large", f"the image declares more pixels than the limit of {_pixels(limit)} "
                                            "(a possible decompression bomb); resize it below that and send it "
                                            "again") from exc
    except UnidentifiedImageError as exc:
        if (tiff_error := _unopened_tiff(handle, start)) is not None:
            raise tiff_error from exc
        message = f"unrecognised format; accepted formats are {ACCEPTED_FORMATS_TEXT}"
        raise ImageDecodeError("not_image", message) from exc
    # what Pillow's plugins raise on damaged files (its TIFF plugin also TypeError, KeyError, struct.error, ...)
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError, ImageCms.PyCMSError, TypeError, KeyError,
            IndexError, ZeroDivisionError, struct.error) as exc:
        text = f"{type(exc).__name__}: {exc}"
        kind = "truncated" if "truncated" in text.lower() or isinstance(exc, EOFError) else "unreadable"
        raise ImageDecodeError(kind, f"the image could not be decoded ({text}); the file is damaged") from exc


def _check_before_opening(handle: BinaryIO, start: int) -> int:
    """What Pillow would do before its own checks run: a TIFF's tag data (returned, in bytes: refused when its
    tags overlap or it is over what one decode may hold) and a PNM's header (refused unless binary and short)."""
    head = handle.read(MAX_PNM_HEADER_BYTES)
    handle.seek(start)
    if head[:1] == b"P" and head[1:2] in b"0123456fFy":  # what Pillow's PPM plugin takes for its own
        _check_pnm_header(head)
        return 0
    if not is_tiff(head):
        return 0
    size = handle.seek(0, os.SEEK_END) - start

    def read_at(offset: int, count: int) -> bytes:
        handle.seek(start + offset)
        return handle.read(count)

    try:
        tag_bytes = tag_memory_bytes(read_at, size, MAX_COUNTED_PAGES)
    except TagDataError as exc:
        raise ImageDecodeError("unreadable", f"a TIFF page that cannot be used: {exc}; the file is damaged") from exc
    finally:
        handle.seek(start)
    if TIFF_TAG_COPIES * tag_bytes > MAX_DECODE_BYTES:
        raise ImageDecodeError(
            "too_large", f"a TIFF whose tags (metadata, strip and tile lists) would hold about "
            f"{TIFF_TAG_COPIES * tag_bytes / MIB:.0f} MB before any pixel, over the {MAX_DECODE_BYTES / MIB:.0f} MB "
            "one decode may use; save the image without its extra metadata, in fewer strips or pages",
        )
    return tag_bytes


def _check_pnm_header(head: bytes) -> None:
    """Refuse a PNM that is not binary PNM (P4, P5, P6) or whose header does not end within ``head``."""
    if head[:2] not in PNM_MAGICS:
        raise ImageDecodeError(
            "unreadable",
            "this PNM variant (plain text P1-P3, floating-point PFM, or another of Pillow's own) is not read (Pillow "
            "decodes some in Python, minutes for a large image); convert it to binary PNM (P4, P5, P6) or PNG",
        )
    position = 2
    for _ in range(2 if head[:2] == b"P4" else 3):  # width, height and (but for P4) maxval
        match = _PNM_NUMBER.match(head, position)
        if match is None:
            break
        position = match.end()
    else:
        if position < len(head) and head[position:position + 1].isspace():
            return
    raise ImageDecodeError(
        "unreadable", f"a PNM header (size, maxval, comments) that does not end within {MAX_PNM_HEADER_BYTES} bytes "
        "as binary PNM's does; the file is damaged, or convert it to PNG",
    )


def _unopened_tiff(handle: BinaryIO, start: int) -> ImageDecodeError | None:
    """Why a file with a TIFF (or BigTIFF) signature did not open, or None when it has none."""
    handle.seek(start)
    try:
        _, _, first_page = header(handle.read(16))
    except TagDataError:
        return None
    size = handle.seek(0, os.SEEK_END) - start
    if first_page >= size:  # writers often put the page's tags after its pixels, at the very end
        return ImageDecodeError("truncated", "a TIFF cut short before its first page's tags; the file is truncated")
    return ImageDecodeError(
        "unreadable", "a TIFF whose first page cannot be read (damaged tags, or a layout Pillow does not read, such "
        "as floating-point RGB); convert it to PNG or an 8- or 16-bit TIFF",
    )


def _plan(image: Image.Image, handle: BinaryIO, start: int, max_pixels: int, held: int = 0) -> tuple[int, int]:
    """Frames and estimated peak bytes of an opened image (``held``: bytes its header made Pillow hold already),
    refused over the limits before any pixel is decoded."""
    width, height = image.size
    jpeg = image.format in ("JPEG", "MPO")  # MPO: a phone's JPEG with a second picture after it
    if jpeg:  # decode at 1/2, 1/4 or 1/8 scale straight from the DCT when large
        factor = min(width, height) // MIN_SHORT_SIDE
        if factor >= 2:
            image.draft(image.mode, (width // factor, height // factor))
    decoded_w, decoded_h = image.size  # what will be held in memory: the limit applies to it
    if decoded_w * decoded_h > max_pixels:
        raise ImageDecodeError(
            "too_large",
            f"{width} x {height} = {width * height:,} pixels is over the limit of {_pixels(max_pixels)} (a possible "
            "decompression bomb); resize it below that and send it again (where you run the server or the index, "
            "--max-pixels raises the limit)",
        )
    if any(tile.codec_name in SLOW_DECODERS for tile in image.tile):
        raise ImageDecodeError(
            "unreadable",
            "a PNM with a maxval other than 255 (or 65535 for greyscale) is decoded by Pillow "
            "in Python, minutes for a large image; convert it to binary PNM with 8-bit samples (P4, P5, P6) or PNG",
        )
    frames = _count_frames(image)
    buffered = jpeg and _jpeg_buffers_coefficients(image, handle, start)
    estimate = estimate_decode_bytes(image, (width, height), buffered) + held
    return frames, _check_memory(image.format or "image", (width, height), estimate, buffered)


def _count_frames(image: Image.Image) -> int:
    """Frames of an animation, or a TIFF's pages up to ``MAX_COUNTED_PAGES``; the image is left on its first."""
    if image.format != "TIFF":
        frames = int(getattr(image, "n_frames", 1) or 1)
        if frames > 1:
            image.seek(0)
        return frames
    pages = 1  # Pillow's n_frames parses every page: 2 minutes for an 11 MB file of 100,000 one-pixel pages
    try:
        while getattr(image, "is_animated", False) and pages < MAX_COUNTED_PAGES:
            image.seek(pages)
            pages += 1
    except Exception:  # noqa: BLE001  (no further page, or a damaged one, whatever Pillow raises: the first is used)
        pass
    finally:
        if image.tell() != 0:
            image.seek(0)
    return pages


# --- memory ---------------------------------------------------------------------------------------------
def estimate_decode_bytes(image: Image.Image, source_size: tuple[int, int], buffered_jpeg: bool = False) -> int:
    """Peak bytes ``read_image`` holds for an opened, not yet decoded image (after ``draft``), from its header.

    The decoded image, what its decoder holds beside it, and the reduced RGB(A) image built from it strip by
    strip; per-format factors measured (docs/BENCHMARKS.md, "Decoder memory per format"). An upper bound.
    """
    if image.format == "WEBP":
        return _webp_bytes(image.size)
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


def _webp_bytes(size: tuple[int, int]) -> int:
    """Every WebP (still or animated, lossy or lossless, RGB or RGBA) is decoded by libwebp's WebPAnimDecoder,
    whose canvases live as long as the image: they are still there while the reduced image is built."""
    return size[0] * size[1] * (4 + WEBP_DECODER_BYTES) + _reduced_bytes(size) + DECODER_BYTES


def _reduced_bytes(size: tuple[int, int]) -> int:
    """The reduced RGB(A) image built from a decoded one of ``size`` (4 bytes a pixel in Pillow), and a strip."""
    (left, top, right, bottom), factor = _region_and_factor(*size)
    pixels = -(-(right - left) // factor) * -(-(bottom - top) // factor)
    return pixels * 4 + min(size[0] * size[1], STRIP_PIXELS) * STRIP_BYTES_PER_PIXEL


def _webp_canvas(handle: BinaryIO, start: int) -> tuple[int, int] | None:
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


def _check_memory(fmt: str, size: tuple[int, int], estimate: int, buffered_jpeg: bool = False) -> int:
    """``estimate``, or ``ImageDecodeError("too_large")`` when it is over ``MAX_DECODE_BYTES``."""
    if estimate > MAX_DECODE_BYTES:
        raise ImageDecodeError("too_large", _too_much_memory(fmt, size, estimate, buffered_jpeg))
    return estimate


def _bytes_per_pixel(mode: str) -> int:
    """What Pillow holds per pixel: 1 byte for 1, L and P, 2 for 16-bit grey, 4 for every other mode."""
    return 1 if mode in ("1", "L", "P") else 2 if mode.startswith("I;16") else 4


def _jpeg_blocks(layers: Sequence[tuple[int, int, int, int]], width: int, height: int) -> int:
    """8x8 blocks in all components of a JPEG of ``width`` x ``height`` with these (id, h, v, table) samplings."""
    h_max = max([h for _, h, _, _ in layers] + [1])
    v_max = max([v for _, _, v, _ in layers] + [1])
    return sum(-(-width * h // (8 * h_max)) * -(-height * v // (8 * v_max)) for _, h, v, _ in layers)


def _jpeg_buffers_coefficients(image: Image.Image, handle: BinaryIO, start: int) -> bool:
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


def _too_much_memory(fmt: str, size: tuple[int, int], estimate: int, buffered_jpeg: bool) -> str:
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
            f"{MAX_DECODE_BYTES / MIB:.0f} MB one decode may use; {how}; --max-pixels does not raise this limit")


# --- normalisation -------------------------------------------------------------------------------------
def _normalise(image: Image.Image, frames: int, estimate: int = 0) -> DecodedImage:
    """A loaded image -> reduced, 8-bit, sRGB, upright RGB or RGBA, built strip by strip into one new image.

    Each strip of the kept region is cropped, reduced and converted (bit depth, palette, colour profile, RGB(A),
    orientation) before the next: beside the decoded image only the result and one strip are held.
    """
    fmt, icc, orientation = image.format or "?", image.info.get("icc_profile"), _orientation(image)
    if fmt == "TIFF":
        pages = f"{frames} or more" if frames >= MAX_COUNTED_PAGES else f"{frames}"
        notes = [f"multi-page TIFF: the first of its {pages} pages was used"] if frames > 1 else []
    else:
        notes = [f"animated image: the first of its {frames} frames was used"] if frames > 1 else []
    width, height = image.size
    (left, top, right, bottom), factor = _region_and_factor(width, height)
    transpose = _TRANSPOSE.get(orientation)
    if (
        image.mode in ("RGB", "RGBA") and "transparency" not in image.info and not icc and transpose is None
        and factor == 1 and (right - left, bottom - top) == (width, height)
        and fmt != "WEBP"  # a WebP image holds libwebp's two canvases (8 bytes a pixel) as long as it lives
    ):
        return DecodedImage(image, fmt, frames, tuple(notes), estimate)
    samples = _sample_range(image)
    to_srgb, note = _srgb_transform(icc, _prepare(image.crop((0, 0, 1, 1)), samples).mode) if icc else (None, None)
    notes += [note] if note else []
    out_w, out_h = -(-(right - left) // factor), -(-(bottom - top) // factor)
    swap = transpose in _SWAPS_AXES
    out: Image.Image | None = None
    rows = max(factor, (STRIP_PIXELS // max(1, right - left)) // factor * factor)
    for y in range(top, bottom, rows):
        strip = _prepare(image.crop((left, y, right, min(bottom, y + rows))), samples, factor)
        if to_srgb is not None:
            strip = _apply_srgb(strip, to_srgb)
        strip = _to_rgb_or_rgba(strip)
        if out is None:
            out = Image.new(strip.mode, (out_h, out_w) if swap else (out_w, out_h))
        row, count = (y - top) // factor, strip.height
        if transpose is not None:  # where the strip lands in the upright image
            strip = strip.transpose(transpose)
            row = out_h - row - count if transpose in _REVERSES_ROWS else row
        out.paste(strip, (row, 0) if swap else (0, row))
    assert out is not None
    return DecodedImage(out, fmt, frames, tuple(notes), estimate)


def _region_and_factor(width: int, height: int) -> tuple[tuple[int, int, int, int], int]:
    """The part of the image kept (centre, at most MAX_ASPECT:1) and the integer factor it is shrunk by."""
    short = min(width, height)
    keep_w, keep_h = min(width, MAX_ASPECT * short), min(height, MAX_ASPECT * short)
    left, top = (width - keep_w) // 2, (height - keep_h) // 2
    return (left, top, left + keep_w, top + keep_h), max(1, short // MIN_SHORT_SIDE)


def _prepare(strip: Image.Image, samples: tuple[float, float] | None, factor: int = 1) -> Image.Image:
    """A strip reduced by ``factor``, in 8 bits; palette and colour-key transparency become RGB(A) first."""
    if strip.mode.startswith("I;16"):
        strip = strip.convert("I")  # PIL reduces 32-bit integers, not 16-bit
    elif strip.mode in ("P", "PA", "1", "La", "RGBa") or (samples is None and "transparency" in strip.info):
        strip = _to_rgb_or_rgba(strip)
    if factor > 1:
        strip = strip.reduce(factor)
    return strip if samples is None else _to_8bit(strip, *samples)


def _sample_range(image: Image.Image) -> tuple[float, float] | None:
    """The range 16/32-bit integer and float samples are scaled from to 0..255 (PIL's convert would clip)."""
    if image.mode.startswith("I;16"):
        return 0.0, 65535.0
    if image.mode not in ("I", "F"):
        return None
    low, high = image.getextrema()
    if image.mode == "I" and low >= 0 and high <= 65535:
        return 0.0, 65535.0  # 16-bit samples held in 32 bits (PNG greyscale in older Pillow)
    if image.mode == "F" and low >= 0 and high <= 1:
        return 0.0, 1.0
    return float(low), float(high)  # any other range: stretch what is there


def _to_8bit(image: Image.Image, low: float, high: float) -> Image.Image:
    """A 16/32-bit integer or float image scaled from low..high to an 8-bit greyscale one."""
    values = np.array(image, dtype=np.float32)  # a copy: scaled in place, without temporaries
    values -= low
    values *= 255.0 / (high - low) if high > low else 0.0
    values += 0.5
    return Image.fromarray(np.clip(values, 0, 255, out=values).astype(np.uint8), mode="L")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _to_rgb_or_rgba(image: Image.Image) -> Image.Image:
    if _has_alpha(image):
        return image if image.mode == "RGBA" else image.convert("RGBA")
    return image if image.mode == "RGB" else image.convert("RGB")  # CMYK without a profile: PIL's formula


def _srgb_transform(icc: bytes, mode: str) -> tuple[ImageCms.ImageCmsTransform | None, str | None]:
    """The transform from the embedded ICC profile (RGB, CMYK or grey) to sRGB for strips of ``mode``."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        colour = mode[:-1] if mode in ("RGBA", "LA") else mode
        return ImageCms.buildTransform(profile, _SRGB, colour, "RGB"), None
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError) as exc:
        return None, f"its ICC colour profile could not be used ({exc}); colours were taken as sRGB"


def _apply_srgb(image: Image.Image, transform: ImageCms.ImageCmsTransform) -> Image.Image:
    """Colours converted to sRGB; alpha carried over."""
    alpha = image.getchannel("A") if image.mode in ("RGBA", "LA") else None
    converted = ImageCms.applyTransform(image.convert(image.mode[:-1]) if alpha is not None else image, transform)
    if alpha is not None:
        converted.putalpha(alpha)
    return converted


# EXIF orientation -> the transposition that shows the image upright (as ImageOps.exif_transpose does)
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_SWAPS_AXES = (Image.Transpose.TRANSPOSE, Image.Transpose.ROTATE_270, Image.Transpose.TRANSVERSE,
               Image.Transpose.ROTATE_90)  # a strip of rows becomes a strip of columns
_REVERSES_ROWS = (Image.Transpose.ROTATE_180, Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.ROTATE_270,
                  Image.Transpose.TRANSVERSE)  # the first rows land last


def _orientation(image: Image.Image) -> int:
    if not _exif_tags_fit(image):
        return 1
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001  (broken EXIF: upright rather than no image)
        return 1


def _exif_tags_fit(image: Image.Image) -> bool:
    """Whether the EXIF block Pillow would parse refers to no more tag data than it holds (its tags may overlap:
    a small block could ask for gigabytes) and costs at most ``MAX_EXIF_BYTES`` once its numbers are unpacked.
    A TIFF's own pages were checked before it was opened."""
    if image.format == "TIFF":
        return True
    exif = image.info.get("exif")
    if exif is None and "Raw profile type exif" in image.info:  # how Pillow reads a PNG's hex EXIF text
        try:
            exif = bytes.fromhex("".join(image.info["Raw profile type exif"].split("\n")[3:]))
        except ValueError:
            return False
    if not exif:
        return True
    data = exif[6:] if exif.startswith(b"Exif\0\0") else exif
    try:
        return tag_memory_bytes(lambda offset, count: data[offset:offset + count], len(data), 1) <= MAX_EXIF_BYTES
    except TagDataError:
        return False


# --- transparency ------------------------------------------------------------------------------------
def parse_background(value: str | Sequence[int] | None) -> tuple[int, int, int]:
    """A background colour as RGB: a name (``white``), ``#RRGGBB``, ``R,G,B``, or a 3-sequence of 0..255."""
    if value is None:
        return DEFAULT_BACKGROUND
    if isinstance(value, str):
        text = value.strip()
        try:
            if "," in text:
                parts = tuple(int(p) for p in text.split(","))
            else:
                parts = tuple(ImageColor.getrgb(text))[:3]
        except ValueError as exc:
            raise ValueError(
                f"background colour {value!r} is not a colour; use a name (white), #RRGGBB or R,G,B"
            ) from exc
    else:
        parts = tuple(int(p) for p in value)
    if len(parts) != 3 or not all(0 <= p <= 255 for p in parts):
        raise ValueError(f"background colour must be 3 numbers in 0..255, got {value!r}")
    return parts  # type: ignore[return-value]


def flatten_alpha(image: Image.Image, background: Sequence[int] = DEFAULT_BACKGROUND) -> Image.Image:
    """An RGB image: transparent pixels composited onto ``background`` (an RGB image is returned as it is)."""
    if image.mode == "RGB":
        return image
    if not _has_alpha(image):
        return image.convert("RGB")
    rgba = image if image.mode == "RGBA" else image.convert("RGBA")
    canvas = Image.new("RGB", rgba.size, tuple(int(c) for c in background))
    canvas.paste(rgba, mask=rgba.getchannel("A"))
    return canvas


class FlattenAlpha:
    """Transform step: ``flatten_alpha`` with a fixed background (picklable for DataLoader workers)."""

    def __init__(self, background: Sequence[int] = DEFAULT_BACKGROUND) -> None:
        self.background = parse_background(background)

    def __call__(self, image: Image.Image) -> Image.Image:
        return flatten_alpha(image, self.background) if isinstance(image, Image.Image) else image

    def __repr__(self) -> str:
        return f"FlattenAlpha(background={self.background})"
