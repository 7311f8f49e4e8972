"""JPEG decoding alone on a CUDA GPU: ``torchvision.io.decode_jpeg(device="cuda")`` in batches, from 1 and from several
host threads, next to PIL and torchvision on one CPU core; then the device pipeline's crop-resize-flip of decoded
batches, one image at a time against the batched product (``retrieval/data/batched_resize.py``).

    python3 benchmarks/gpu_decode.py [--folder DIR] [--images 2048] [--batch 128] [--threads 1 2 4] [--device cpu]

The folder is the one ``benchmarks/gpu_input.py`` writes (400-640 x 300-480 px JPEGs); images/s after one warm-up
pass, CUDA synchronised. Threads split each pass's batches between them, each on its own CUDA stream: if the
rate does not grow with threads, the decoder's host side is serialised (one lock, or the GIL held). The resize rows
crop each decoded image at a random box (a quarter to all of it, as RandomResizedCrop draws) to 224 x 224 and count
the operators torch dispatches per batch; ``--device cpu`` runs the resize rows alone (decoded by torchvision there).
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
from torch.profiler import ProfilerActivity, profile
from torchvision.io import ImageReadMode, decode_jpeg

from retrieval.data.augment import resolve_augmentation
from retrieval.data.batched_resize import resize_crops
from retrieval.data.device_decode import DeviceAugment


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


def resize_rows(data: list[torch.Tensor], batch: int, device: torch.device, repeats: int = 5) -> None:
    """Print the images/s and operators per batch of the per-image and the batched crop-resize-flip."""
    g = torch.Generator().manual_seed(0)
    images = [decode_jpeg(one, mode=ImageReadMode.RGB, device=device) for one in data[:batch]]
    crops, flips = [], []
    for image in images:
        _, h, w = image.shape
        share = float(torch.empty(1).uniform_(0.25, 1.0, generator=g))
        ch, cw = max(1, int(h * share ** 0.5)), max(1, int(w * share ** 0.5))
        top = int(torch.randint(0, h - ch + 1, (1,), generator=g))
        left = int(torch.randint(0, w - cw + 1, (1,), generator=g))
        crops.append(image[:, top:top + ch, left:left + cw])
        flips.append(bool(torch.randint(0, 2, (1,), generator=g)))
    config = {"input_size": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    stage = DeviceAugment(config, resolve_augmentation("crop-flip"), device, batched_resize=False)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for label, run in (("one image at a time", lambda: stage._resize_each(crops, flips)),
                       ("batched product", lambda: resize_crops(crops, flips, 224))):
        run()
        sync()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        sync()
        rate = repeats * len(crops) / (time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run()
            sync()
        ops = sum(1 for event in prof.events() if event.name.startswith("aten::") and event.cpu_parent is None)
        print(f"| crop-resize-flip to 224 on {device.type}, {label} | {rate:,.0f} | {ops} operators a batch |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/gpu-jpegs"))
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the resize rows alone")
    args = parser.parse_args()
    if not args.folder.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_input import write_folder

        write_folder(args.folder, 8_000, 40)
    paths = sorted(args.folder.rglob("*.jpg"))[: args.images]
    raw = [p.read_bytes() for p in paths]
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
    device = torch.device(args.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{where}, torch {torch.__version__}, {len(data)} JPEGs of "
          f"{sum(map(len, raw)) / len(raw) / 1024:.0f} KiB, batch {args.batch}\n")
    print("| what | images/s | |\n|---|---:|---|")
    resize_rows(data, args.batch, device)
    if device.type != "cuda":
        return
    for threads in args.threads:
        rate = gpu_rate(data, args.batch, threads)
        print(f"| decode_jpeg on CUDA, {threads} host thread(s) | {rate:,.0f} | |", flush=True)
    torch.set_num_threads(1)
    few = raw[:256]
    start = time.perf_counter()
    for b in few:
        Image.open(io.BytesIO(b)).convert("RGB").load()
    print(f"| PIL, one core | {len(few) / (time.perf_counter() - start):,.0f} | |")
    start = time.perf_counter()
    for t in data[:256]:
        decode_jpeg(t, mode=ImageReadMode.RGB)
    print(f"| torchvision decode_jpeg on the CPU, one core | {len(few) / (time.perf_counter() - start):,.0f} | |")


if __name__ == "__main__":
    main()
