"""Peak memory of ``read_image`` per format and mode, for the worst images the pixel limit admits (issue 24).

Each image is decoded in a fresh subprocess; the peak is the process's own high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs`` after decoding a 64 x 48 image of the same kind), so what the parent held
before the fork is not counted (``ru_maxrss`` of a child starts at its parent's size). Linux only.

    .venv/bin/python benchmarks/decode_memory.py [--decoder PATH] [--no-limit] [--no-trim] [--threads N] [CASE ...]

``--decoder PATH`` measures another version of ``retrieval/data/decode.py`` (e.g. ``git show
HEAD~1:retrieval/data/decode.py > /tmp/old.py``); ``--no-limit`` lifts ``MAX_DECODE_BYTES`` in the child so
that images the decoder refuses are measured too; ``--threads N`` decodes the given images together, as a
server would: N long-lived threads, 3 waves of N decodes, then reports the peak and what the process still
holds afterwards (what the decoder gave back); ``--no-trim`` turns ``trim_heap`` off to see what it does.
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

from PIL import Image, ImageCms

ROOT = Path(__file__).resolve().parents[1]
SQUARE, LONG, WEBP_LONG, JPEG_MAX = (6324, 6324), (1535, 26058), (1535, 16383), (9459, 9459)


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def rotated_with_profile() -> dict:
    """An EXIF orientation (6: turn 90 degrees) and an sRGB ICC profile: the decoder's extra conversions."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return {"exif": exif.tobytes(), "icc_profile": ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()}


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_rgba16(width: int, height: int) -> bytes:
    """A 16-bit RGBA PNG (Pillow cannot write one), rows of zeros."""
    packer, row = zlib.compressobj(1), bytes(1 + width * 8)
    data = b"".join(packer.compress(row) for _ in range(height)) + packer.flush()
    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header) + png_chunk(b"IDAT", data) + png_chunk(b"IEND", b"")


def bmp_rle8(width: int, height: int) -> bytes:
    """An RLE8 BMP (Pillow cannot write one): runs of 255 pixels, decoded by Pillow's Python decoder."""
    row = bytes((255, 1)) * (width // 255) + (bytes((width % 255, 1)) if width % 255 else b"") + b"\0\0"
    data = row * height + b"\0\1"
    palette = b"".join(bytes((i, i, 0, 0)) for i in range(256))
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 8, 1, len(data), 2835, 2835, 256, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(data), 0, 0, offset) + info + palette + data


def animated(fmt: str, mode: str, size: tuple[int, int], **params) -> bytes:
    first, second = Image.new(mode, size, 0), Image.new(mode, size, 1 if mode == "P" else (9, 9, 9, 255))
    return encode(first, fmt, save_all=True, append_images=[second], duration=100, **params)


def flat(mode: str, size: tuple[int, int]) -> Image.Image:
    colour = {"RGBA": (10, 200, 30, 128), "RGB": (10, 200, 30), "CMYK": (10, 200, 30, 0), "I;16": 40000,
              "LA": (5, 128)}.get(mode, 3)
    return Image.new(mode, size, colour)


# name -> (size, bytes of an image of that size)
CASES = {
    "webp lossless RGBA": (SQUARE, lambda s: encode(flat("RGBA", s), "WEBP", lossless=True)),
    "webp lossless RGB": (SQUARE, lambda s: encode(flat("RGB", s), "WEBP", lossless=True)),
    "webp lossy RGB": (SQUARE, lambda s: encode(flat("RGB", s), "WEBP", quality=80)),
    "webp lossy RGBA": (SQUARE, lambda s: encode(flat("RGBA", s), "WEBP", quality=80)),
    "webp animated (2 frames)": (SQUARE, lambda s: animated("WEBP", "RGBA", s, lossless=True)),
    "webp RGBA, long": (WEBP_LONG, lambda s: encode(flat("RGBA", s), "WEBP", lossless=True)),
    "webp largest admitted": ((4000, 4000), lambda s: encode(flat("RGBA", s), "WEBP", lossless=True)),
    "png RGBA": (SQUARE, lambda s: encode(flat("RGBA", s), "PNG", compress_level=1)),
    "png RGBA, long": (LONG, lambda s: encode(flat("RGBA", s), "PNG", compress_level=1)),
    "png RGBA, long, ICC + EXIF": (LONG, lambda s: encode(flat("RGBA", s), "PNG", compress_level=1,
                                                          **rotated_with_profile())),
    "png RGB + colour key, long": (LONG, lambda s: encode(flat("RGB", s), "PNG", compress_level=1,
                                                          transparency=(10, 200, 30))),
    "png P + tRNS, long": (LONG, lambda s: encode(flat("P", s), "PNG", compress_level=1, transparency=3)),
    "png LA, long": (LONG, lambda s: encode(flat("LA", s), "PNG", compress_level=1)),
    "png I;16": (SQUARE, lambda s: encode(flat("I;16", s), "PNG", compress_level=1)),
    "png I;16, long": (LONG, lambda s: encode(flat("I;16", s), "PNG", compress_level=1)),
    "png RGBA 16-bit, long": (LONG, lambda s: png_rgba16(*s)),
    "png APNG (2 frames), long": (LONG, lambda s: animated("PNG", "RGBA", s, compress_level=1)),
    "gif": (SQUARE, lambda s: encode(flat("P", s), "GIF")),
    "gif + transparency, long": (LONG, lambda s: encode(flat("P", s), "GIF", transparency=3)),
    "gif animated (2 frames)": (SQUARE, lambda s: animated("GIF", "P", s)),
    "bmp 32-bit": (SQUARE, lambda s: encode(flat("RGBA", s), "BMP")),
    "bmp 24-bit, long": (LONG, lambda s: encode(flat("RGB", s), "BMP")),
    "bmp 1-bit, long": (LONG, lambda s: encode(Image.new("1", s, 1), "BMP")),
    "bmp RLE8, long": (LONG, lambda s: bmp_rle8(*s)),
    "jpeg baseline (1/8 scale)": (JPEG_MAX, lambda s: encode(flat("RGB", s), "JPEG", subsampling=0)),
    "jpeg baseline, long": (LONG, lambda s: encode(flat("RGB", s), "JPEG")),
    "jpeg CMYK, long": (LONG, lambda s: encode(flat("CMYK", s), "JPEG")),
    "jpeg baseline, long, ICC + EXIF": (LONG, lambda s: encode(flat("RGB", s), "JPEG", **rotated_with_profile())),
    "jpeg progressive 4:2:0, long": (LONG, lambda s: encode(flat("RGB", s), "JPEG", progressive=True)),
    "jpeg progressive 4:4:4 (1/8 scale)": (JPEG_MAX, lambda s: encode(flat("RGB", s), "JPEG", progressive=True,
                                                                       subsampling=0)),
    "jpeg progressive 4:2:0 (1/8 scale)": (JPEG_MAX, lambda s: encode(flat("RGB", s), "JPEG", progressive=True)),
    "jpeg progressive grey (1/8 scale)": (JPEG_MAX, lambda s: encode(flat("L", s), "JPEG", progressive=True)),
    "jpeg progressive CMYK (1/8 scale)": (JPEG_MAX, lambda s: encode(flat("CMYK", s), "JPEG", progressive=True)),
}

PROBE = r"""
import gc, importlib.util, json, sys
from concurrent.futures import ThreadPoolExecutor
sys.path.insert(0, sys.argv[1])
decoder, no_limit, no_trim, threads = sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5])
small, paths = sys.argv[6], sys.argv[7:]
if decoder:
    spec = importlib.util.spec_from_file_location("decode_under_test", decoder)
    decode = importlib.util.module_from_spec(spec)
    sys.modules["decode_under_test"] = decode
    spec.loader.exec_module(decode)
else:
    import retrieval.data.decode as decode
if no_limit and hasattr(decode, "MAX_DECODE_BYTES"):
    decode.MAX_DECODE_BYTES = 2**40
if no_trim:
    decode._MALLOC_TRIM = None

def status(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key)) / 1024

def work(i):
    try:
        decoded = decode.read_image(images[i % len(images)])
        return getattr(decoded, "estimated_bytes", 0) / 2**20
    except decode.ImageDecodeError as exc:
        return str(exc)

images = [open(path, "rb").read() for path in paths]
pool = ThreadPoolExecutor(threads)  # long-lived threads, as a server's: each has a malloc arena of its own
list(pool.map(lambda _: decode.read_image(small), range(threads)))
open("/proc/self/clear_refs", "w").write("5")
idle = status("VmRSS")
results = [result for _ in range(3 if threads > 1 else 1) for result in pool.map(work, range(threads))]
gc.collect()
print(json.dumps({"peak": status("VmHWM") - idle, "after": status("VmRSS") - idle, "result": results[0]}))
"""


def files(case: str, folder: Path) -> tuple[Path, Path]:
    """The image of ``case`` and a 64 x 48 one of the same kind (to warm the decoder up), made once."""
    size, make = CASES[case]
    ext = case.split()[0]
    name = "".join(c if c.isalnum() else "_" for c in case)
    big, small = folder / f"{name}_{size[0]}x{size[1]}.{ext}", folder / f"{name}_small.{ext}"
    if not big.exists():
        small.write_bytes(make((64, 48)))
        big.write_bytes(make(size))
    return big, small


def probe(paths: list[Path], small: Path, args: argparse.Namespace, threads: int = 1) -> dict:
    options = [args.decoder, "1" if args.no_limit else "0", "1" if args.no_trim else "0", str(threads)]
    command = [sys.executable, "-c", PROBE, str(ROOT), *options, str(small), *map(str, paths)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def measure(case: str, folder: Path, args: argparse.Namespace) -> dict:
    big, small = files(case, folder)
    with Image.open(big) as image:
        mode, (width, height) = image.mode, image.size
    row = probe([big], small, args)
    return {"case": case, "mode": mode, "size": f"{width}x{height}", "file_kb": big.stat().st_size / 1024,
            "bytes_per_pixel": row["peak"] * 2**20 / (width * height), **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--decoder", default="", help="another decode.py to measure")
    parser.add_argument("--no-limit", action="store_true", help="lift MAX_DECODE_BYTES to measure refused images")
    parser.add_argument("--no-trim", action="store_true", help="turn trim_heap (malloc_trim) off")
    parser.add_argument("--threads", type=int, default=1, help="decode the images together in this many threads")
    parser.add_argument("--folder", default="/tmp/decode_memory", help="where the generated images are kept")
    args = parser.parse_args()
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    if args.threads > 1:
        paths = [files(case, folder)[0] for case in args.cases or CASES]
        row = probe(paths, files(args.cases[0] if args.cases else next(iter(CASES)), folder)[1], args, args.threads)
        print(f"{args.threads} threads, 3 waves of {args.threads} decodes: peak {row['peak']:.0f} MB above idle, "
              f"{row['after']:.0f} MB still held afterwards")
        return
    print("| image | mode | size | file | peak above idle (MB) | bytes/pixel | after (MB) | estimate (MB) or refusal |")
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases or CASES:
        row = measure(case, folder, args)
        result = row["result"] if isinstance(row["result"], str) else f"{row['result']:.0f}"
        print(f"| {row['case']} | {row['mode']} | {row['size']} | {row['file_kb']:.0f} KB | {row['peak']:.0f} | "
              f"{row['bytes_per_pixel']:.1f} | {row['after']:.0f} | {result[:90]} |", flush=True)


if __name__ == "__main__":
    main()
