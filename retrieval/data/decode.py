"""The one image decoder: untrusted bytes or a file -> an 8-bit sRGB image, bounded in memory and time.

Every path that reads an image (training data sets, the index builders, ``retrieval search``, the API, the
Gradio upload, export verification) calls ``read_image``, so the gallery, the queries and the training data
are decoded alike:

- only the formats a gallery may hold are opened (``retrieval.data.formats.IMAGE_FORMATS``: JPEG, PNG, WebP,
  BMP, GIF, TIFF, binary PNM): no plugin for exotic formats ever sees untrusted bytes, and the data sets, the
  gallery listing and the API take the file extensions of these formats (``IMAGE_EXTENSIONS``) and no others;
- the pixel count is checked from the header before any pixel is decoded (decompression bombs; a large JPEG
  is decoded at 1/2, 1/4 or 1/8 scale and the limit applies to that), files that are not regular files
  (``/dev/zero``, FIFOs) are refused before they are read;
- so is the memory the decode will hold (``decode_memory.estimate_decode_bytes``: bytes per pixel measured for
  each format, libwebp's canvases, every coefficient of a progressive JPEG): an image over ``MAX_DECODE_BYTES``
  is refused, so one decode stays under 300 MB; the decodes running at once share ``decode_budget.DECODE_BUDGET``
  (twice that), and the heap a large decode freed is given back to the system (``trim_heap``);
- a decoded image is reduced right away: an extreme aspect ratio is cropped around the centre to
  ``MAX_ASPECT``:1 (an evaluation centre crop never looks further out) and a very large image is shrunk by an
  integer factor while its short side stays >= ``MIN_SHORT_SIDE``, so later resizes stay small; the reduced
  image is built strip by strip, each strip converted (bit depth, colours, orientation) on the way, so no
  full-size copy of the decoded image is ever made;
- 16- and 32-bit greyscale is scaled to 8 bits by its range (never clipped), CMYK and images with an ICC
  profile are converted to sRGB, the EXIF orientation is applied, an animated image gives its first frame (a
  multi-page TIFF its first page);
- transparency is kept (RGBA) and composited onto the model's background colour by
  ``retrieval.data.colour.FlattenAlpha``, the first step of every preprocessing pipeline
  (``retrieval.data.transforms``), so that the colour is a model setting recorded with the model like mean and
  std.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import stat
import struct
import warnings
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageCms, UnidentifiedImageError

from retrieval.data import decode_memory as memory
from retrieval.data.colour import has_alpha
from retrieval.data.decode_budget import DECODE_BUDGET, TRIM_BYTES
from retrieval.data.exif_icc import REVERSES_ROWS, SWAPS_AXES, TRANSPOSE, apply_srgb, orientation, srgb_transform
from retrieval.data.formats import ACCEPTED_FORMATS, ACCEPTED_FORMATS_TEXT, PNM_MAGICS, SLOW_DECODERS
from retrieval.data.tiff_tags import TagDataError, header, is_tiff, tag_memory_bytes
from retrieval.utils.heap import trim_heap

# A 40-megapixel RGBA image decodes into 160 MB; what a decode holds beside it is ``decode_memory``'s estimate.
DEFAULT_MAX_PIXELS = 40_000_000
MAX_COUNTED_PAGES = 16  # a TIFF's pages are counted up to this: each costs a parse (a file may hold 100,000)
# Pillow reads a PNM header (magic, size, maxval, comments) a byte at a time: one that does not end within this
# is refused before Pillow sees it (a 10 MB comment takes seconds)
MAX_PNM_HEADER_BYTES = 4096
_PNM_NUMBER = re.compile(rb"(?:\s|#[^\r\n]*[\r\n])*(\d+)")


class ImageDecodeError(ValueError):
    """An image that cannot be used; ``kind`` is one of ``ERROR_LABELS``' keys, the message says what to do."""

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
    estimated_bytes: int = 0  # the peak memory its decode was estimated to hold (``decode_memory``)


def open_regular_file(path: str | os.PathLike) -> BinaryIO:
    """Open ``path`` for reading, refusing anything that is not a regular file (devices, FIFOs, sockets)."""
    # O_NONBLOCK: opening a FIFO must not wait for a writer; it changes nothing for a regular file
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ImageDecodeError("not_file", f"{os.fsdecode(path)!r} is not a regular file; give an image file")
    return os.fdopen(fd, "rb")


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
    canvas = memory.webp_canvas(handle, start)
    try:
        with warnings.catch_warnings(), contextlib.ExitStack() as held:
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            if canvas is not None:  # Pillow's WebP plugin has libwebp allocate its canvases as it opens the file
                held.enter_context(DECODE_BUDGET.reserve(_check_memory("WEBP", canvas, memory.webp_bytes(canvas))))
            image = held.enter_context(Image.open(handle, formats=ACCEPTED_FORMATS))
            frames, estimate = _plan(image, handle, start, max_pixels, memory.TIFF_TAG_COPIES * tag_bytes)
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
    if memory.TIFF_TAG_COPIES * tag_bytes > memory.MAX_DECODE_BYTES:
        raise ImageDecodeError(
            "too_large", f"a TIFF whose tags (metadata, strip and tile lists) would hold about "
            f"{memory.TIFF_TAG_COPIES * tag_bytes / memory.MIB:.0f} MB before any pixel, over the "
            f"{memory.MAX_DECODE_BYTES / memory.MIB:.0f} MB "
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
        factor = min(width, height) // memory.MIN_SHORT_SIDE
        if factor >= 2:
            image.draft(image.mode, (width // factor, height // factor))
    decoded_w, decoded_h = image.size  # what will be held in memory: the limit applies to it
    if decoded_w * decoded_h > max_pixels:
        raise ImageDecodeError(
            "too_large",
            f"{width} x {height} = {width * height:,} pixels is over the limit of {_pixels(max_pixels)} (a possible "
            "decompression bomb); resize it below that and send it again (whoever runs the server or the index can "
            "raise their pixel limit)",
        )
    if any(tile.codec_name in SLOW_DECODERS for tile in image.tile):
        raise ImageDecodeError(
            "unreadable",
            "a PNM with a maxval other than 255 (or 65535 for greyscale) is decoded by Pillow "
            "in Python, minutes for a large image; convert it to binary PNM with 8-bit samples (P4, P5, P6) or PNG",
        )
    frames = _count_frames(image)
    buffered = jpeg and memory.jpeg_buffers_coefficients(image, handle, start)
    estimate = memory.estimate_decode_bytes(image, (width, height), buffered) + held
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


def _check_memory(fmt: str, size: tuple[int, int], estimate: int, buffered_jpeg: bool = False) -> int:
    """``estimate``, or ``ImageDecodeError("too_large")`` when it is over ``MAX_DECODE_BYTES``."""
    if estimate > memory.MAX_DECODE_BYTES:
        raise ImageDecodeError("too_large", memory.too_much_memory(fmt, size, estimate, buffered_jpeg))
    return estimate


# --- normalisation -------------------------------------------------------------------------------------
def _normalise(image: Image.Image, frames: int, estimate: int = 0) -> DecodedImage:
    """A loaded image -> reduced, 8-bit, sRGB, upright RGB or RGBA, built strip by strip into one new image.

    Each strip of the kept region is cropped, reduced and converted (bit depth, palette, colour profile, RGB(A),
    orientation) before the next: beside the decoded image only the result and one strip are held.
    """
    fmt, icc, upright = image.format or "?", image.info.get("icc_profile"), orientation(image)
    if fmt == "TIFF":
        pages = f"{frames} or more" if frames >= MAX_COUNTED_PAGES else f"{frames}"
        notes = [f"multi-page TIFF: the first of its {pages} pages was used"] if frames > 1 else []
    else:
        notes = [f"animated image: the first of its {frames} frames was used"] if frames > 1 else []
    width, height = image.size
    (left, top, right, bottom), factor = memory.region_and_factor(width, height)
    transpose = TRANSPOSE.get(upright)
    if (
        image.mode in ("RGB", "RGBA") and "transparency" not in image.info and not icc and transpose is None
        and factor == 1 and (right - left, bottom - top) == (width, height)
        and fmt != "WEBP"  # a WebP image holds libwebp's two canvases (8 bytes a pixel) as long as it lives
    ):
        return DecodedImage(image, fmt, frames, tuple(notes), estimate)
    samples = _sample_range(image)
    to_srgb, note = srgb_transform(icc, _prepare(image.crop((0, 0, 1, 1)), samples).mode) if icc else (None, None)
    notes += [note] if note else []
    out_w, out_h = -(-(right - left) // factor), -(-(bottom - top) // factor)
    swap = transpose in SWAPS_AXES
    out: Image.Image | None = None
    rows = max(factor, (memory.STRIP_PIXELS // max(1, right - left)) // factor * factor)
    for y in range(top, bottom, rows):
        strip = _prepare(image.crop((left, y, right, min(bottom, y + rows))), samples, factor)
        if to_srgb is not None:
            strip = apply_srgb(strip, to_srgb)
        strip = _to_rgb_or_rgba(strip)
        if out is None:
            out = Image.new(strip.mode, (out_h, out_w) if swap else (out_w, out_h))
        row, count = (y - top) // factor, strip.height
        if transpose is not None:  # where the strip lands in the upright image
            strip = strip.transpose(transpose)
            row = out_h - row - count if transpose in REVERSES_ROWS else row
        out.paste(strip, (row, 0) if swap else (0, row))
    assert out is not None
    return DecodedImage(out, fmt, frames, tuple(notes), estimate)


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


def _to_rgb_or_rgba(image: Image.Image) -> Image.Image:
    if has_alpha(image):
        return image if image.mode == "RGBA" else image.convert("RGBA")
    return image if image.mode == "RGB" else image.convert("RGB")  # CMYK without a profile: PIL's formula
