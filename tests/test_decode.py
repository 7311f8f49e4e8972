"""The one image decoder (``retrieval.data.decode``): modes, colour, orientation, bounds and hostile files."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from retrieval.data import build_transforms, open_image
from retrieval.data.decode import (
    DEFAULT_MAX_PIXELS,
    MAX_ASPECT,
    ImageDecodeError,
    flatten_alpha,
    parse_background,
    read_image,
)

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {"input_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3}


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **params)
    return buffer.getvalue()


def sticker(size: int = 48) -> Image.Image:
    """A red disc on a fully transparent background whose hidden RGB is black (as most exporters leave it)."""
    yy, xx = np.mgrid[:size, :size]
    inside = (yy - size / 2) ** 2 + (xx - size / 2) ** 2 < (size / 3) ** 2
    pixels = np.zeros((size, size, 4), np.uint8)
    pixels[inside] = (220, 30, 30, 255)
    return Image.fromarray(pixels, "RGBA")


# --- transparency ----------------------------------------------------------------------------------
def transparent_variants() -> dict[str, bytes]:
    rgba = sticker()
    la = Image.fromarray(np.stack([np.asarray(rgba)[..., 0], np.asarray(rgba)[..., 3]], -1), "LA")
    palette = rgba.convert("RGB").quantize(4)
    clear = palette.getpixel((0, 0))
    rgb_key = rgba.convert("RGB")
    return {
        "RGBA": encode(rgba),
        "LA": encode(la),
        "P+tRNS": encode(palette, transparency=clear),
        "RGB+colour key": encode(rgb_key, transparency=(0, 0, 0)),
        "GIF": encode(palette, "GIF", transparency=clear),
        "WebP": encode(rgba, "WEBP", lossless=True),
    }


@pytest.mark.parametrize("name", list(transparent_variants()))
def test_transparent_pixels_become_the_background_colour(name):
    decoded = read_image(transparent_variants()[name]).image
    assert decoded.mode == "RGBA"
    assert flatten_alpha(decoded).getpixel((0, 0)) == (255, 255, 255)  # white by default, never black
    assert flatten_alpha(decoded, (0, 128, 0)).getpixel((0, 0)) == (0, 128, 0)
    centre = flatten_alpha(decoded).getpixel((24, 24))
    assert centre[0] > 150 and centre != (255, 255, 255)  # the opaque disc is kept


def test_preprocessing_uses_the_models_background():
    decoded = read_image(transparent_variants()["RGBA"]).image
    white = build_transforms(CONFIG, train=False)(decoded)
    black = build_transforms(CONFIG | {"background": [0, 0, 0]}, train=False)(decoded)
    assert white[:, 0, 0].tolist() == pytest.approx([1.0, 1.0, 1.0])  # (255 / 255 - 0.5) / 0.5
    assert black[:, 0, 0].tolist() == pytest.approx([-1.0, -1.0, -1.0])


@pytest.mark.parametrize("text,expected", [
    ("white", (255, 255, 255)), ("#00ff80", (0, 255, 128)), ("10,20,30", (10, 20, 30)), ([1, 2, 3], (1, 2, 3)),
    (None, (255, 255, 255)),
])
def test_parse_background(text, expected):
    assert parse_background(text) == expected


@pytest.mark.parametrize("bad", ["nocolour", "1,2", "300,0,0", [1, 2, 3, 4]])
def test_parse_background_refuses_non_colours(bad):
    with pytest.raises(ValueError, match="colour"):
        parse_background(bad)


# --- bit depth and colour ---------------------------------------------------------------------------
def test_16_bit_greyscale_is_scaled_by_its_range_not_clipped():
    values = np.array([[0, 257 * 64, 257 * 128, 65535]], np.uint16).repeat(4, 0)
    image = Image.fromarray(values)
    assert image.mode == "I;16"
    decoded = read_image(encode(image)).image
    assert decoded.mode == "RGB"
    assert [decoded.getpixel((x, 0))[0] for x in range(4)] == [0, 64, 128, 255]


def test_cmyk_jpeg_becomes_rgb():
    cyan = Image.new("CMYK", (16, 16), (255, 0, 0, 0))
    decoded = read_image(encode(cyan, "JPEG", quality=95)).image
    r, g, b = decoded.getpixel((8, 8))
    assert decoded.mode == "RGB" and r < 40 and g > 215 and b > 215


def rgb_profile(red, green, blue, gamma: float = 2.2) -> bytes:
    """A minimal ICC v2 display profile with the given D50 primaries (matrix/TRC), built by hand."""

    def s15(v):
        return struct.pack(">i", round(v * 65536))

    def xyz(x, y, z):
        return b"XYZ " + b"\0" * 4 + s15(x) + s15(y) + s15(z)

    curve = b"curv" + b"\0" * 4 + struct.pack(">IH", 1, round(gamma * 256)) + b"\0\0"
    text = b"swapped primaries\0"
    desc = b"desc" + b"\0" * 4 + struct.pack(">I", len(text)) + text + b"\0" * 11 + b"\0" * 67
    tags = [(b"desc", desc), (b"wtpt", xyz(0.9642, 1.0, 0.8249)), (b"rXYZ", xyz(*red)), (b"gXYZ", xyz(*green)),
            (b"bXYZ", xyz(*blue)), (b"rTRC", curve), (b"gTRC", curve), (b"bTRC", curve)]
    offset, table, data = 128 + 4 + 12 * len(tags), b"", b""
    for signature, body in tags:
        body += b"\0" * (-len(body) % 4)
        table += signature + struct.pack(">II", offset + len(data), len(body))
        data += body
    header = (struct.pack(">I", offset + len(data)) + b"lcms" + struct.pack(">I", 0x02100000) + b"mntrRGB XYZ "
              + b"\0" * 12 + b"acsp" + b"\0" * 28 + s15(0.9642) + s15(1.0) + s15(0.8249) + b"\0" * 48)
    return header + struct.pack(">I", len(tags)) + table + data


SRGB_D50 = ((0.4361, 0.2225, 0.0139), (0.3851, 0.7169, 0.0971), (0.1431, 0.0606, 0.7141))


@pytest.mark.parametrize("mode", ["RGB", "RGBA"])
def test_icc_profile_is_converted_to_srgb(mode):
    swapped = rgb_profile(SRGB_D50[1], SRGB_D50[0], SRGB_D50[2])  # its "red" is sRGB's green
    image = Image.new(mode, (8, 8), (255, 0, 0, 255)[: len(mode)])
    decoded = read_image(encode(image, icc_profile=swapped)).image
    r, g, b = decoded.getpixel((4, 4))[:3]
    assert g > 240 and r < 20 and b < 20
    assert decoded.mode == mode


def test_a_broken_icc_profile_is_a_note_not_a_failure():
    decoded = read_image(encode(Image.new("RGB", (8, 8), (255, 0, 0)), icc_profile=b"not a profile" * 10))
    assert decoded.image.getpixel((0, 0)) == (255, 0, 0) and "ICC" in decoded.notes[0]


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_as_pil_does(orientation):
    from PIL import ImageOps

    image = Image.fromarray(np.arange(6 * 4 * 3, dtype=np.uint8).reshape(4, 6, 3) * 2)  # asymmetric pixels
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(image, exif=exif.tobytes())
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert np.array_equal(np.asarray(read_image(data).image), np.asarray(expected.convert("RGB")))


def test_exif_orientation_survives_shrinking():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    decoded = read_image(encode(Image.new("RGB", (2400, 1600), (0, 0, 255)), "JPEG", exif=exif.tobytes())).image
    assert decoded.size == (800, 1200)  # decoded at half scale (short side >= 768), then turned upright


def test_animated_gif_gives_its_first_frame_and_says_so():
    frames = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    decoded = read_image(buffer.getvalue())
    assert decoded.frames == 3 and decoded.image.getpixel((8, 8)) == (255, 0, 0)
    assert decoded.notes == ("animated image: the first of its 3 frames was used",)


# --- hostile input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("data,kind", [
    (b"", "empty"),
    (b"this is not an image\n" * 10, "not_image"),
    (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not_image"),  # never handed to Ghostscript
    (encode(Image.new("RGB", (8, 8)), "TIFF"), "not_image"),  # formats outside the gallery's are refused
    (encode(Image.new("RGB", (64, 64), (1, 2, 3)))[:80], "truncated"),
])
def test_unusable_bytes_are_refused_with_their_kind(data, kind):
    with pytest.raises(ImageDecodeError) as info:
        read_image(data)
    assert info.value.kind == kind or (kind == "truncated" and info.value.kind == "unreadable")


def bomb_png(width: int, height: int) -> bytes:
    """A tiny PNG whose header declares width x height pixels."""
    import zlib

    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_pixel_limit_is_checked_before_decoding():
    started = time.perf_counter()
    with pytest.raises(ImageDecodeError, match="decompression bomb") as info:
        read_image(bomb_png(200_000, 200_000))
    assert info.value.kind == "too_large" and time.perf_counter() - started < 1


@pytest.mark.parametrize("path", ["/dev/zero", "fifo"])
def test_non_regular_files_are_refused_before_reading(path, tmp_path):
    if path == "fifo":
        path = tmp_path / "fifo.png"
        os.mkfifo(path)  # opening it for reading must not wait for a writer
    started = time.perf_counter()
    with pytest.raises(ImageDecodeError, match="not a regular file"):
        open_image(path)
    assert time.perf_counter() - started < 1


@pytest.mark.parametrize("size", [(30000, 1), (1, 30000), (9000, 20)])
def test_extreme_aspect_ratios_are_cropped_around_the_centre(size):
    image = read_image(encode(Image.new("RGB", size, (10, 200, 30)))).image
    assert max(image.size) <= MAX_ASPECT * min(image.size) and min(image.size) == min(size)
    assert build_transforms(CONFIG | {"input_size": 224}, train=False)(image).shape == (3, 224, 224)


def test_large_images_are_shrunk_by_an_integer_factor():
    image = read_image(encode(Image.new("RGB", (4000, 3000), (5, 6, 7)), compress_level=1)).image
    assert image.size == (1334, 1000)  # factor 3000 // 768 = 3 keeps the short side >= 768
    assert image.getpixel((10, 10)) == (5, 6, 7)


MEMORY_PROBE = textwrap.dedent("""
    import resource, sys
    from retrieval.data import build_transforms, open_image
    config = {"input_size": 224, "mean": [0.5] * 3, "std": [0.5] * 3}
    for train in (False, True):
        build_transforms(config, train)(open_image(sys.argv[2]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    image = open_image(sys.argv[1])
    for train in (False, True):
        build_transforms(config, train)(image)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
""")


@pytest.mark.slow
def test_decoding_any_image_the_limits_admit_stays_under_300_mb(tmp_path):
    """Peak memory above the process's own idle peak, for the worst shapes and modes under the default limit."""
    small = tmp_path / "small.png"
    Image.new("RGB", (64, 64)).save(small)
    side = int((DEFAULT_MAX_PIXELS / 1.1) ** 0.5)
    cases = {
        "wide.png": Image.new("RGB", (30000, 1), (10, 200, 30)),  # 169 bytes; 2.4 GB before the fix
        "rgba_at_limit.png": Image.new("RGBA", (side, int(side * 1.1)), (10, 200, 30, 128)),
        "rgba_long.png": Image.new("RGBA", (1535, DEFAULT_MAX_PIXELS // 1535), (10, 200, 30, 128)),
        "grey16_at_limit.png": Image.new("I;16", (side, int(side * 1.1)), 40000),
    }
    for name, image in cases.items():
        path = tmp_path / name
        image.save(path, compress_level=1)
        del image
        result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(small)], cwd=ROOT,
                                capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stderr
        assert float(result.stdout) < 300, f"{name}: {result.stdout.strip()} MB above idle"


BUILD_PROBE = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from retrieval.index import IngestOptions, build_index
    from tests.test_index_support import FakeEmbedder
    options = IngestOptions(workers=0, progress=False)
    build_index(sys.argv[2], Path(sys.argv[3]) / "warm", embedder=FakeEmbedder(), options=options)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    summary = build_index(sys.argv[1], Path(sys.argv[3]) / "hostile", embedder=FakeEmbedder(), options=options)
    assert summary["indexed"] == 2, summary
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
""")


@pytest.mark.slow
def test_index_build_of_a_hostile_gallery_stays_under_300_mb(tmp_path):
    """The 169-byte 30000 x 1 PNG took ``index build`` to 2.2 GB; now it is one more small image."""
    hostile, warm = tmp_path / "hostile", tmp_path / "warm"
    for folder in (hostile, warm):
        folder.mkdir()
        Image.new("RGB", (64, 64), (1, 2, 3)).save(folder / "plain.png")
    Image.new("RGB", (30000, 1), (10, 200, 30)).save(hostile / "wide.png")
    Image.new("RGB", (48, 64), (10, 20, 30)).save(warm / "second.png")  # the warm-up build is benign
    result = subprocess.run([sys.executable, "-c", BUILD_PROBE, str(hostile), str(warm), str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) < 300
