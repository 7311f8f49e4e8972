"""The one list of image formats: what ``read_image`` opens, the file extensions and the media types they go by.

The data sets, the gallery listing, the API's uploads and its image route all take these and no others. A leaf:
it imports nothing, so a process can learn the extensions without loading Pillow.
"""

from __future__ import annotations

# The formats ``read_image`` opens (Pillow's names), each with the file extensions it is kept under and the media
# type it is served as.
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
PNM_MAGICS = (b"P4", b"P5", b"P6")  # binary PNM; Pillow's PPM plugin also opens P1-P3, PFM (Pf, PF) and Py* files
# The bytes each format's files begin with: the API serves a catalogued file only if it is one of these, whatever
# its name says (``sniff_image_format``). WebP is "RIFF", a size, then "WEBP"; TIFF includes BigTIFF.
IMAGE_SIGNATURES: dict[str, tuple[bytes, ...]] = {
    "JPEG": (b"\xff\xd8\xff",),
    "PNG": (b"\x89PNG\r\n\x1a\n",),
    "WEBP": (b"RIFF",),
    "BMP": (b"BM",),
    "GIF": (b"GIF87a", b"GIF89a"),
    "TIFF": (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"),
    "PPM": PNM_MAGICS,
}
SIGNATURE_BYTES = 12  # enough for every signature above (WebP's ends at byte 12)


def sniff_image_format(head: bytes) -> str | None:
    """The accepted format (a key of ``IMAGE_FORMATS``) whose signature a file's first ``SIGNATURE_BYTES`` begin
    with, else None."""
    for name, signatures in IMAGE_SIGNATURES.items():
        if head.startswith(signatures) and (name != "WEBP" or head[8:12] == b"WEBP"):
            return name
    return None
