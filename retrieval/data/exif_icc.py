"""What an image file's metadata asks of its pixels: the EXIF orientation and the ICC colour profile.

The decoder applies both strip by strip (``read_image``): ``orientation`` says how to turn the image upright
(``TRANSPOSE``; an EXIF block too costly to parse is ignored), ``srgb_transform`` and ``apply_srgb`` convert an
ICC-tagged image (RGB, CMYK or grey) to sRGB.
"""

from __future__ import annotations

import io

from PIL import Image, ImageCms

from retrieval.data.decode_memory import MIB
from retrieval.data.tiff_tags import TagDataError, tag_memory_bytes

# an EXIF block (JPEG, PNG, WebP) whose tags would cost more than this is not read: the image stays as stored
MAX_EXIF_BYTES = 16 * MIB
_SRGB = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))


def srgb_transform(icc: bytes, mode: str) -> tuple[ImageCms.ImageCmsTransform | None, str | None]:
    """The transform from the embedded ICC profile (RGB, CMYK or grey) to sRGB for strips of ``mode``."""
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        colour = mode[:-1] if mode in ("RGBA", "LA") else mode
        return ImageCms.buildTransform(profile, _SRGB, colour, "RGB"), None
    except (ImageCms.PyCMSError, OSError, ValueError, TypeError) as exc:
        return None, f"its ICC colour profile could not be used ({exc}); colours were taken as sRGB"


def apply_srgb(image: Image.Image, transform: ImageCms.ImageCmsTransform) -> Image.Image:
    """Colours converted to sRGB; alpha carried over."""
    alpha = image.getchannel("A") if image.mode in ("RGBA", "LA") else None
    converted = ImageCms.applyTransform(image.convert(image.mode[:-1]) if alpha is not None else image, transform)
    if alpha is not None:
        converted.putalpha(alpha)
    return converted


# EXIF orientation -> the transposition that shows the image upright (as ImageOps.exif_transpose does)
TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
SWAPS_AXES = (Image.Transpose.TRANSPOSE, Image.Transpose.ROTATE_270, Image.Transpose.TRANSVERSE,
              Image.Transpose.ROTATE_90)  # a strip of rows becomes a strip of columns
REVERSES_ROWS = (Image.Transpose.ROTATE_180, Image.Transpose.FLIP_TOP_BOTTOM, Image.Transpose.ROTATE_270,
                 Image.Transpose.TRANSVERSE)  # the first rows land last


def orientation(image: Image.Image) -> int:
    """The EXIF orientation (1..8) of an opened image; 1 (upright) when absent, broken or too costly to read."""
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
