"""Peak memory of ``read_image`` per format and mode, for the worst images the pixel limit admits.

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
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from retrieval.data.synthetic import bmp_rle8, encode, flat, png_rgba16, turned_with_profile

SQUARE, LONG, WEBP_LONG, JPEG_MAX = (6324, 6324), (1535, 26058), (1535, 16383), (9459, 9459)


# The colours of the one-colour images, per mode.
COLOURS = {"RGBA": (10, 200, 30, 128), "RGB": (10, 200, 30), "CMYK": (10, 200, 30, 0), "I;16": 40000, "LA": (5, 128)}


def solid(mode: str, fmt: str, **params) -> Callable[[tuple[int, int]], bytes]:
    """A function size -> the bytes of a one-colour image in ``mode`` (its colour from ``COLOURS``)."""
    return flat(mode, fmt, COLOURS.get(mode, 3), **params)


def animated(fmt: str, mode: str, **params) -> Callable[[tuple[int, int]], bytes]:
    """A function size -> the bytes of a two-frame animation."""
    second = 1 if mode == "P" else (9, 9, 9, 255)
    return lambda size: encode(Image.new(mode, size, 0), fmt, save_all=True,
                               append_images=[Image.new(mode, size, second)], duration=100, **params)


# name -> (size, bytes of an image of that size)
CASES = {
    "webp lossless RGBA": (SQUARE, solid("RGBA", "WEBP", lossless=True)),
    "webp lossless RGB": (SQUARE, solid("RGB", "WEBP", lossless=True)),
    "webp lossy RGB": (SQUARE, solid("RGB", "WEBP", quality=80)),
    "webp lossy RGBA": (SQUARE, solid("RGBA", "WEBP", quality=80)),
    "webp animated (2 frames)": (SQUARE, animated("WEBP", "RGBA", lossless=True)),
    "webp RGBA, long": (WEBP_LONG, solid("RGBA", "WEBP", lossless=True)),
    "webp largest admitted": ((4000, 4000), solid("RGBA", "WEBP", lossless=True)),
    "png RGBA": (SQUARE, solid("RGBA", "PNG", compress_level=1)),
    "png RGBA, long": (LONG, solid("RGBA", "PNG", compress_level=1)),
    "png RGBA, long, ICC + EXIF": (LONG, solid("RGBA", "PNG", compress_level=1, **turned_with_profile())),
    "png RGB + colour key, long": (LONG, solid("RGB", "PNG", compress_level=1, transparency=(10, 200, 30))),
    "png P + tRNS, long": (LONG, solid("P", "PNG", compress_level=1, transparency=3)),
    "png LA, long": (LONG, solid("LA", "PNG", compress_level=1)),
    "png I;16": (SQUARE, solid("I;16", "PNG", compress_level=1)),
    "png I;16, long": (LONG, solid("I;16", "PNG", compress_level=1)),
    "png RGBA 16-bit, long": (LONG, png_rgba16),
    "png APNG (2 frames), long": (LONG, animated("PNG", "RGBA", compress_level=1)),
    "gif": (SQUARE, solid("P", "GIF")),
    "gif + transparency, long": (LONG, solid("P", "GIF", transparency=3)),
    "gif animated (2 frames)": (SQUARE, animated("GIF", "P")),
    "bmp 32-bit": (SQUARE, solid("RGBA", "BMP")),
    "bmp 24-bit, long": (LONG, solid("RGB", "BMP")),
    "bmp 1-bit, long": (LONG, flat("1", "BMP", 1)),
    "bmp RLE8, long": (LONG, bmp_rle8),
    "tiff RGB": (SQUARE, solid("RGB", "TIFF")),
    "tiff RGB deflate, one strip": (SQUARE, solid("RGB", "TIFF", compression="tiff_deflate", strip_size=2**40)),
    "tiff RGB deflate, long": (LONG, solid("RGB", "TIFF", compression="tiff_deflate")),
    "ppm RGB": (SQUARE, solid("RGB", "PPM")),
    "pgm 16-bit": (SQUARE, solid("I;16", "PPM")),
    "jpeg baseline (1/8 scale)": (JPEG_MAX, solid("RGB", "JPEG", subsampling=0)),
    "jpeg baseline, long": (LONG, solid("RGB", "JPEG")),
    "jpeg CMYK, long": (LONG, solid("CMYK", "JPEG")),
    "jpeg baseline, long, ICC + EXIF": (LONG, solid("RGB", "JPEG", **turned_with_profile())),
    "jpeg progressive 4:2:0, long": (LONG, solid("RGB", "JPEG", progressive=True)),
    "jpeg progressive 4:4:4 (1/8 scale)": (JPEG_MAX, solid("RGB", "JPEG", progressive=True, subsampling=0)),
    "jpeg progressive 4:2:0 (1/8 scale)": (JPEG_MAX, solid("RGB", "JPEG", progressive=True)),
    "jpeg progressive grey (1/8 scale)": (JPEG_MAX, solid("L", "JPEG", progressive=True)),
    "jpeg progressive CMYK (1/8 scale)": (JPEG_MAX, solid("CMYK", "JPEG", progressive=True)),
}

PROBE = r"""
import gc, importlib.util, json, sys
from concurrent.futures import ThreadPoolExecutor
decoder, no_limit, no_trim, threads = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", int(sys.argv[4])
small, paths = sys.argv[5], sys.argv[6:]
if decoder:
    spec = importlib.util.spec_from_file_location("decode_under_test", decoder)
    decode = importlib.util.module_from_spec(spec)
    sys.modules["decode_under_test"] = decode
    spec.loader.exec_module(decode)
else:
    import retrieval.data.decode as decode
import retrieval.data.decode_memory as memory, retrieval.utils.heap as heap
for module in (decode, memory):  # an older decode.py given with --decoder holds its limit and trim itself
    if no_limit and hasattr(module, "MAX_DECODE_BYTES"):
        module.MAX_DECODE_BYTES = 2**40
for module in (decode, heap):  # an older decode.py held its malloc_trim itself
    if no_trim and hasattr(module, "_MALLOC_TRIM"):
        module._MALLOC_TRIM = None

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
    command = [sys.executable, "-c", PROBE, *options, str(small), *map(str, paths)]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def measure(case: str, folder: Path, args: argparse.Namespace) -> dict:
    big, small = files(case, folder)
    with Image.open(big) as image:
        mode, (width, height) = image.mode, image.size
    row = probe([big], small, args)
    return {"case": case, "mode": mode, "size": f"{width}x{height}", "file_kb": big.stat().st_size / 1024,
            "bytes_per_pixel": row["peak"] * 2**20 / (width * height), **row}


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--decoder", default="", help="another decode.py to measure")
    parser.add_argument("--no-limit", action="store_true", help="lift MAX_DECODE_BYTES to measure refused images")
    parser.add_argument("--no-trim", action="store_true", help="turn trim_heap (malloc_trim) off")
    parser.add_argument("--threads", type=int, default=1, help="decode the images together in this many threads")
    parser.add_argument("--folder", default="/tmp/decode_memory", help="where the generated images are kept")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("decode-concurrent" if args.threads > 1 else "decode-memory", args.save)
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
