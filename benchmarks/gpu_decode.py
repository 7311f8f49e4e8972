"""The device pipeline (``--decode-on device``) taken apart: the workers' hand-over of encoded batches alone, the
device stage alone on a batch in memory, and nvJPEG alone (from 1 and several host threads), next to PIL and
torchvision on one CPU core.

    python3 benchmarks/gpu_decode.py [--folder DIR] [--images 2048] [--batch 128] [--workers 16] [--threads 1 2 4]
                                     [--device cuda|cpu]

The folder is the one ``benchmarks/gpu_input.py`` writes (400-640 x 300-480 px JPEGs). Images/s; the hand-over
counts from the first batch after those the workers made in advance (2 a worker), once with each batch's bytes
crossing the process boundary as one tensor (``EncodedBatch.__reduce__``) and once as a tensor an image (torch's
default: a shared-memory file each). The device stage (``DeviceAugment``: decode, crop, resize, flip, normalise) and
nvJPEG run after one warm-up pass, synchronised. If nvJPEG's rate does not grow with threads, its host side is
serialised. ``--device cpu`` runs the hand-over rows only.

For the workers pipeline (``--decode-on workers``), the same count for its batches: decoded, augmented and
normalised to float32 in the workers (as on the CPU), against uint8 pixels, a quarter of the bytes, which the GPU
scales and normalises on arrival (``ScaleAndNormalise``; nothing is done with them here).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import threading
import time
from pathlib import Path

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from retrieval.data import ImageDataset, build_transforms
from retrieval.data.augment import resolve_augmentation
from retrieval.data.dataset import CatchBadSamples
from retrieval.data.device_decode import DeviceAugment, EncodedBatch, EncodedImages, collate_encoded
from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.inference import make_loader
from retrieval.models.backbones import IMAGENET_MEAN, IMAGENET_STD

CONFIG = ModelPreprocessing(input_size=224, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def image_dataset(paths: list[Path], transform=None) -> ImageDataset:
    """The files as one class, through ``transform``."""
    return ImageDataset([str(p) for p in paths], [0] * len(paths), [p.name for p in paths], transform)


def encoded_images(paths: list[Path]) -> EncodedImages:
    return EncodedImages(image_dataset(paths), CONFIG, resolve_augmentation("crop-flip"))


def arrival_rate(dataset, batch: int, workers: int, **loader_options) -> float:
    """Images/s of seeded random batches of ``dataset`` arriving from ``workers`` processes, counted from the first
    batch after those the workers made in advance (2 a worker)."""
    warm_up = 2 * workers + 2
    g = torch.Generator().manual_seed(0)
    batches = [[(int(i), 7 + int(i)) for i in torch.randint(0, len(dataset), (batch,), generator=g)]
               for _ in range(warm_up + max(30, 4 * workers))]
    seen, start = 0, 0.0
    for i, loaded in enumerate(make_loader(dataset, None, workers, None, batch_sampler=batches, **loader_options)):
        if i == warm_up:
            start, seen = time.perf_counter(), 0
        seen += len(loaded.labels)
    return seen / (time.perf_counter() - start)


def hand_over_rate(encoded: EncodedImages, batch: int, workers: int, per_image: bool) -> float:
    """Images/s of encoded batches arriving from ``workers`` processes (nothing decoded in the main process)."""
    packed = EncodedBatch.__reduce__
    if per_image:  # torch's default: each image's tensor in its own shared-memory file
        EncodedBatch.__reduce__ = lambda self: (EncodedBatch, (self.images, self.labels, self.indices))
    try:
        return arrival_rate(encoded, batch, workers, collate_fn=collate_encoded)
    finally:
        EncodedBatch.__reduce__ = packed


def workers_pipeline_rate(paths: list[Path], batch: int, workers: int, normalise: bool) -> float:
    """Images/s of the workers pipeline's batches arriving from ``workers`` processes: float32 normalised in the
    workers, or uint8 (``normalise=False``)."""
    transform = build_transforms(CONFIG, train=True, augmentation=resolve_augmentation("crop-flip"),
                                 normalise=normalise)
    return arrival_rate(image_dataset(paths, transform), batch, workers)


def stage_rate(encoded: EncodedImages, batch: int, device: torch.device, repeats: int = 10) -> float:
    """Images/s of ``DeviceAugment`` on one encoded batch already in the main process."""
    inputs = collate_encoded([CatchBadSamples(encoded)[(i, 7 + i)] for i in range(batch)]).inputs
    stage = DeviceAugment(CONFIG, resolve_augmentation("crop-flip"), device)
    stage(inputs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        stage(inputs)
    torch.cuda.synchronize()
    return repeats * batch / (time.perf_counter() - start)


def nvjpeg_rate(data: list[torch.Tensor], batch: int, threads: int) -> float:
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
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/gpu-jpegs"))
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for the hand-over rows alone")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("gpu-decode", args.save)
    if not args.folder.exists():
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from gpu_input import write_folder

        write_folder(args.folder, 8_000, 40)
    paths = sorted(args.folder.rglob("*.jpg"))[: args.images]
    device = torch.device(args.device)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    raw = [p.read_bytes() for p in paths]
    print(f"{where}, {os.cpu_count()} cores, torch {torch.__version__}, {len(raw)} JPEGs of "
          f"{sum(map(len, raw)) / len(raw) / 1024:.0f} KiB, batch {args.batch}, {args.workers} workers\n")
    print("| what | images/s |\n|---|---:|")
    encoded = encoded_images(paths)
    for per_image, label in ((True, "a tensor an image"), (False, "one tensor a batch")):
        rate = hand_over_rate(encoded, args.batch, args.workers, per_image)
        print(f"| the workers' hand-over alone, {label} | {rate:,.0f} |", flush=True)
    for normalise, label in ((True, "float32, normalised in the workers"), (False, "uint8, normalised on arrival")):
        rate = workers_pipeline_rate(paths, args.batch, args.workers, normalise)
        print(f"| the workers pipeline's batches alone, {label} | {rate:,.0f} |", flush=True)
    if device.type != "cuda":
        return
    print(f"| DeviceAugment alone (decode, crop, resize, flip, normalise) | "
          f"{stage_rate(encoded, args.batch, device):,.0f} |", flush=True)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in raw]
    for threads in args.threads:
        print(f"| nvJPEG alone (decode_jpeg on CUDA), {threads} host thread(s) | "
              f"{nvjpeg_rate(data, args.batch, threads):,.0f} |", flush=True)
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
