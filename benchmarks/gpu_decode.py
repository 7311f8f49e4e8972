"""JPEG decoding alone on a CUDA GPU: ``torchvision.io.decode_jpeg(device="cuda")`` in batches, from 1 and from several
host threads, next to PIL and torchvision on one CPU core.

    python3 benchmarks/gpu_decode.py [--folder DIR] [--images 2048] [--batch 128] [--threads 1 2 4]

The folder is the one ``benchmarks/gpu_input.py`` writes (400-640 x 300-480 px JPEGs); images/s after one warm-up
pass, CUDA synchronised. Threads split each pass's batches between them, each on its own CUDA stream: if the
rate does not grow with threads, the decoder's host side is serialised (one lock, or the GIL held).
"""

from __future__ import annotations

import argparse
import io
import sys
import threading
import time
from pathlib import Path

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg


def gpu_rate(data: list[torch.Tensor], batch: int, threads: int) -> float:
    """Images/s of batched CUDA decoding, the batches shared by ``threads`` host threads."""
    groups = [data[i:i + batch] for i in range(0, len(data), batch)]

    def work(part: list[list[torch.Tensor]]) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for group in part:
                decode_jpeg(group, mode=ImageReadMode.RGB, device="cuda")
        stream.synchronize()

    work(groups[:2])  # warm-up: the decoder's handles and buffers
    torch.cuda.synchronize()
    start = time.perf_counter()
    pool = [threading.Thread(target=work, args=(groups[t::threads],)) for t in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    torch.cuda.synchronize()
    return len(data) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/gpu-jpegs"))
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    if not args.folder.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_input import write_folder

        write_folder(args.folder, 8_000, 40)
    paths = sorted(args.folder.rglob("*.jpg"))[: args.images]
    raw = [p.read_bytes() for p in paths]
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {len(data)} JPEGs of "
          f"{sum(map(len, raw)) / len(raw) / 1024:.0f} KiB, batch {args.batch}\n")
    print("| decoder | images/s |\n|---|---:|")
    for threads in args.threads:
        rate = gpu_rate(data, args.batch, threads)
        print(f"| decode_jpeg on CUDA, {threads} host thread(s) | {rate:,.0f} |", flush=True)
    torch.set_num_threads(1)
    few = raw[:256]
    start = time.perf_counter()
    for b in few:
        Image.open(io.BytesIO(b)).convert("RGB").load()
    print(f"| PIL, one core | {len(few) / (time.perf_counter() - start):,.0f} |")
    start = time.perf_counter()
    for t in data[:256]:
        decode_jpeg(t, mode=ImageReadMode.RGB)
    print(f"| torchvision decode_jpeg on the CPU, one core | {len(few) / (time.perf_counter() - start):,.0f} |")


if __name__ == "__main__":
    main()
