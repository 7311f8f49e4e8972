"""The one image decoder: untrusted bytes or a file -> an 8-bit sRGB image, bounded in memory and time.

Every path that reads an image (training data sets, the index builders, ``retrieval search``, the API, the
Gradio upload, export verification) calls ``read_image``, so the gallery, the queries and the training data
are decoded alike:

- only the formats a gallery may hold are opened (JPEG, PNG, WebP, BMP, GIF): no plugin for exotic
  formats ever sees untrusted bytes;
- the pixel count is checked from the header before any pixel is decoded (decompression bombs; a large JPEG
  is decoded at 1/2, 1/4 or 1/8 scale and the limit applies to that), files that are not regular files
  (``/dev/zero``, FIFOs) are refused before they are read;
- a decoded image is reduced right away: an extreme aspect ratio is cropped around the centre to
  ``MAX_ASPECT``:1 (an evaluation centre crop never looks further out) and a very large image is shrunk by an
  integer factor while its short side stays >= ``MIN_SHORT_SIDE``, so later resizes stay small;
- 16- and 32-bit greyscale is scaled to 8 bits by its range (never clipped), CMYK and images with an ICC
  profile are converted to sRGB, the EXIF orientation is applied, an animated image gives its first frame;
- transparency is kept (RGBA) and composited onto the model's background colour by ``FlattenAlpha``, the
  first step of every preprocessing pipeline (``retrieval.data.transforms``), so that the colour is a model
  setting recorded with the model like mean and std.
"""

from __future__ import annotations

import io
import os
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageCms, ImageColor, UnidentifiedImageError

# A 40-megapixel RGBA image decodes into 160 MB: with the reductions below, one decode stays under 300 MB.
DEFAULT_MAX_PIXELS = 40_000_000
MAX_ASPECT = 8  # longer side / shorter side kept after decoding (centre crop beyond it)
MIN_SHORT_SIDE = 768  # large images are shrunk by an integer factor while the short side stays >= this
STRIP_PIXELS = 1 << 20  # pixels per strip when cropping and shrinking
ACCEPTED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF")  # JPEG includes phone MPO files
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
        return _decode(io.BytesIO(source), max_pixels)
    if isinstance(source, (str, os.PathLike)):
        with open_regular_file(source) as handle:
            return _decode(handle, max_pixels)
    return _decode(source, max_pixels)


def open_image(path: str | os.PathLike) -> Image.Image:
    """An image file decoded by ``read_image``: RGB or RGBA (transparency is flattened by the transforms)."""
    return read_image(path).image


def _decode(handle: BinaryIO, max_pixels: int) -> DecodedImage:
    start = handle.tell()
    if not handle.read(1):
        raise ImageDecodeError("empty", "the image is empty (0 bytes)")
    handle.seek(start)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(handle, formats=ACCEPTED_FORMATS) as image:
                width, height = image.size
                if image.format == "JPEG":  # decode at 1/2, 1/4 or 1/8 scale straight from the DCT when large
                    factor = min(width, height) // MIN_SHORT_SIDE
                    if factor >= 2:
                        image.draft(image.mode, (width // factor, height // factor))
                decoded_w, decoded_h = image.size  # what will be held in memory: the limit applies to it
                if decoded_w * decoded_h > max_pixels:
                    raise ImageDecodeError(
                        "too_large",
                        f"{width}x{height} = {width * height} pixels is over the limit of {max_pixels} "
                        "(possible decompression bomb); send a smaller image or raise --max-pixels",
                    )
                frames = int(getattr(image, "n_frames", 1) or 1)
                if frames > 1:
                    image.seek(0)
                image.load()
                return _normalise(image, frames)
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError("too_large", f"possible decompression bomb: {exc}") from exc
    except UnidentifiedImageError as exc:
        raise ImageDecodeError(
            "not_image", f"unrecognised format; accepted formats are {', '.join(ACCEPTED_FORMATS)}"
        ) from exc
    except (OSError, ValueError, SyntaxError, EOFError, MemoryError) as exc:
        text = f"{type(exc).__name__}: {exc}"
        kind = "truncated" if "truncated" in text.lower() or isinstance(exc, EOFError) else "unreadable"
        raise ImageDecodeError(kind, f"the image could not be decoded ({text}); the file is damaged") from exc


def _normalise(image: Image.Image, frames: int) -> DecodedImage:
    """A loaded image -> reduced, 8-bit, sRGB, upright RGB or RGBA."""
    notes = [f"animated image: the first of its {frames} frames was used"] if frames > 1 else []
    fmt, icc, orientation = image.format or "?", image.info.get("icc_profile"), _orientation(image)
    image = _to_8bit(_shrink(image))
    if image.mode in ("P", "PA", "1", "La", "RGBa") or "transparency" in image.info:
        image = _to_rgb_or_rgba(image)  # palette and colour-key transparency become an alpha channel first
    if icc:
        image, note = _to_srgb(image, icc)
        notes += [note] if note else []
    image = _to_rgb_or_rgba(image)
    if orientation in _TRANSPOSE:
        image = image.transpose(_TRANSPOSE[orientation])
    return DecodedImage(image, fmt, frames, tuple(notes))


def _region_and_factor(width: int, height: int) -> tuple[tuple[int, int, int, int], int]:
    """The part of the image kept (centre, at most MAX_ASPECT:1) and the integer factor it is shrunk by."""
    short = min(width, height)
    keep_w, keep_h = min(width, MAX_ASPECT * short), min(height, MAX_ASPECT * short)
    left, top = (width - keep_w) // 2, (height - keep_h) // 2
    return (left, top, left + keep_w, top + keep_h), max(1, short // MIN_SHORT_SIDE)


def _shrink(image: Image.Image) -> Image.Image:
    """Crop to the kept region and shrink it, strip by strip: no full-size copy of the decoded image is made
    (PIL's own ``reduce`` of RGBA makes a premultiplied copy of the whole image first)."""
    width, height = image.size
    (left, top, right, bottom), factor = _region_and_factor(width, height)
    if factor == 1 and (right - left, bottom - top) == (width, height):
        return image
    out = None
    rows = max(factor, (STRIP_PIXELS // max(1, right - left)) // factor * factor)
    for y in range(top, bottom, rows):
        strip = image.crop((left, y, right, min(bottom, y + rows)))
        if strip.mode.startswith("I;16"):
            strip = strip.convert("I")  # PIL reduces 32-bit integers, not 16-bit
        elif _has_alpha(strip) and strip.mode != "RGBA":  # palette or colour-key transparency: alpha now
            strip = strip.convert("RGBA")
        elif strip.mode in ("P", "1"):
            strip = strip.convert("RGB")
        if factor > 1:
            strip = strip.reduce(factor)
        if out is None:
            out = Image.new(strip.mode, (-(-(right - left) // factor), -(-(bottom - top) // factor)))
        out.paste(strip, (0, (y - top) // factor))
    out.info = {key: value for key, value in image.info.items() if key != "transparency"}
    return out


def _to_8bit(image: Image.Image) -> Image.Image:
    """16/32-bit integer and float modes scaled by their range to 0..255 (PIL's convert would clip)."""
    if image.mode not in ("I", "F") and not image.mode.startswith("I;16"):
        return image
    values = np.asarray(image, dtype=np.float32)
    if image.mode.startswith("I;16"):
        low, high = 0.0, 65535.0
    elif image.mode == "I" and values.size and values.min() >= 0 and values.max() <= 65535:
        low, high = 0.0, 65535.0  # 16-bit samples held in 32 bits (PNG greyscale in older Pillow)
    elif image.mode == "F" and values.size and values.min() >= 0 and values.max() <= 1:
        low, high = 0.0, 1.0
    else:  # any other range: stretch what is there
        low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    scale = 255.0 / (high - low) if high > low else 0.0
    values = np.clip((values - low) * scale + 0.5, 0, 255).astype(np.uint8)
    return Image.fromarray(values, mode="L")


def _has_alpha(image: Image.Image) -> bool:
    return image.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info


def _to_rgb_or_rgba(image: Image.Image) -> Image.Image:
    if _has_alpha(image):
        return image if image.mode == "RGBA" else image.convert("RGBA")
    return image if image.mode == "RGB" else image.convert("RGB")  # CMYK without a profile: PIL's formula


def _to_srgb(image: Image.Image, icc: bytes) -> tuple[Image.Image, str | None]:
    """Colours converted from the embedded ICC profile (RGB, CMYK or grey) to sRGB; alpha carried over."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        alpha = image.getchannel("A") if image.mode in ("RGBA", "LA") else None
        colour = image.convert(image.mode[:-1]) if alpha is not None else image
        converted = ImageCms.profileToProfile(colour, profile, _SRGB, outputMode="RGB")
        if alpha is not None:
            converted.putalpha(alpha)
        return converted, None
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError) as exc:
        return image, f"its ICC colour profile could not be used ({exc}); colours were taken as sRGB"


# EXIF orientation -> the transposition that shows the image upright (as ImageOps.exif_transpose does)
_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _orientation(image: Image.Image) -> int:
    try:
        return int(image.getexif().get(0x0112, 1))
    except Exception:  # noqa: BLE001  (broken EXIF: upright rather than no image)
        return 1


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
