"""On a CUDA GPU: where training on a JPEG folder spends its time, and what decoding on the device (--decode-on
device) gives end to end.

    python benchmarks/gpu_input.py [--images 8000] [--size 224] [--batch 128] [--workers 16] [--compile]

Writes a class folder of photo-sized JPEGs (about 500 x 375, like ImageNet's; smooth colour fields with texture,
so that they compress as photos do), then measures, each alone and in one process:
- the step: the trainer's own training step on random images in GPU memory (``benchmarks/gpu.py train``'s);
- the input pipelines without a model: the DataLoader workers decoding and augmenting (``--decode-on workers``),
  and the workers reading bytes and drawing crops with the device decoding and augmenting (``--decode-on device``);
- between the two, the step without the trainer fed by the device stage: its thread decoding one batch in memory
  again and again (no workers), then the whole device pipeline (the workers reading the files too). The steps
  from "alone" to "end to end" say what costs the time: the decode thread in the process, the workers, the trainer;
- end to end: ``retrieval.train.train`` on the folder with each pipeline; images/s of the last epoch (the trainer's
  own figure, evaluation excluded).
EfficientNet-Lite0 (not pretrained: the speed is the same), loss MS, AdamW, bf16, channels-last (and compiled with
--compile). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import multiprocessing
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import time_train_steps  # noqa: E402  (the step as benchmarks/gpu.py times it)

if TYPE_CHECKING:
    from retrieval.data import WithSampleSeeds
    from retrieval.data.preprocessing import ModelPreprocessing


def _write_class(task: tuple[Path, int, int]) -> None:
    root, label, count = task
    folder = root / f"class{label:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(label)
    grain = rng.normal(0, 14, (480 + 64, 640 + 64, 3)).astype(np.int16)  # one tile, cropped differently per image
    for i in range(count):
        width, height = int(rng.integers(400, 640)), int(rng.integers(300, 480))
        coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height),
                                                                                           Image.BICUBIC)
        dy, dx = rng.integers(0, 64, 2)
        pixels = np.asarray(coarse, dtype=np.int16) + grain[dy:dy + height, dx:dx + width]
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.jpg", quality=90)


def write_folder(root: Path, images: int, per_class: int) -> None:
    """``images`` JPEGs in classes of ``per_class``, written by all cores."""
    classes = images // per_class
    with multiprocessing.Pool(os.cpu_count()) as pool:
        pool.map(_write_class, [(root, label, per_class) for label in range(classes)])


STEP_WARMUP = 5  # the step's untimed steps
STAGE_AHEAD = 2  # the batches the device stage decodes ahead of the step (``decoded_batches``' default)


def preprocessing(size: int) -> ModelPreprocessing:
    """The model preprocessing the pipelines read: ``size`` px, ImageNet's normalisation."""
    from retrieval.data.preprocessing import ModelPreprocessing
    from retrieval.models.backbones import IMAGENET_MEAN, IMAGENET_STD

    return ModelPreprocessing(input_size=size, mean=IMAGENET_MEAN, std=IMAGENET_STD)


def made_ahead(workers: int) -> int:
    """The batches ready before the first is asked for: ``prefetch_factor`` = 2 a worker, and 2 more."""
    return 2 * workers + STAGE_AHEAD


def seeded_batches(labels: Sequence[int], batch: int, batches: int) -> WithSampleSeeds:
    """``batches`` class-balanced batches of 4 images a class, with their samples' seeds (the trainer's sampler)."""
    from retrieval.data import ClassBalancedBatchSampler, WithSampleSeeds

    sampler = ClassBalancedBatchSampler(labels, batch // 4, 4, seed=0, batches_per_epoch=batches)
    sampler.set_epoch(0, 0)
    return WithSampleSeeds(sampler)


def device_pipeline(root: Path, size: int, batch: int, workers: int, batches: int, device: torch.device,
                    in_memory: bool = False) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], int]:
    """The ``--decode-on device`` pipeline's (images, labels) batches and how many of them the workers make ahead.

    ``in_memory``: the device stage runs in its thread as in training, on one class-balanced batch read once, again
    and again (no workers). Closing the iterator stops the stage's thread and the workers."""
    from retrieval.data import CatchBadSamples, load_dataset
    from retrieval.data.augment import resolve_augmentation
    from retrieval.data.device_decode import DeviceAugment, EncodedImages, collate_encoded, decoded_batches
    from retrieval.inference import make_loader

    config, aug = preprocessing(size), resolve_augmentation("crop-flip")
    dataset = load_dataset("folder", str(root), split="train")
    ahead = STAGE_AHEAD if in_memory else made_ahead(workers)
    sampler = seeded_batches(dataset.labels, batch, batches + ahead)
    encoded, stage = EncodedImages(dataset, config, aug), DeviceAugment(config, aug, device, dataset=dataset)
    if in_memory:
        keys = next(iter(sampler))
        loader = itertools.repeat(collate_encoded([CatchBadSamples(encoded)[key] for key in keys]))
    else:
        loader = make_loader(encoded, None, workers, device, batch_sampler=sampler, collate_fn=collate_encoded)

    def decoded() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        results = decoded_batches(loader, stage, ahead=STAGE_AHEAD)
        try:
            for _, done in results:
                if done is not None:  # None: no image of the batch loaded
                    yield done[0], done[1]
        finally:
            results.close()

    return decoded(), ahead


def pipeline_rate(root: Path, decode_on: str, size: int, batch: int, workers: int, batches: int,
                  device: str = "cuda") -> float:
    """Images/s of the training input pipeline alone (batches ready on the device), in its steady state: the timing
    starts once the batches the workers had made in advance (``prefetch_factor`` = 2 each) are consumed."""
    from retrieval.data import load_dataset
    from retrieval.data.augment import resolve_augmentation
    from retrieval.data.transforms import ScaleAndNormalise, build_transforms
    from retrieval.inference import make_loader
    from retrieval.train.features import normalises_on_arrival

    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if decode_on == "device":
        batches_on_device, warm_up = device_pipeline(root, size, batch, workers, batches, device)
    else:
        config = preprocessing(size)
        # as the trainer's workers pipeline: uint8 pixels normalised on a GPU as they arrive
        on_arrival = ScaleAndNormalise(config, device) if normalises_on_arrival(device) else None
        dataset = load_dataset("folder", str(root), split="train",
                               transform=build_transforms(config, True, resolve_augmentation("crop-flip"),
                                                          normalise=on_arrival is None))
        warm_up = made_ahead(workers)
        loader = make_loader(dataset, None, workers, device,
                             batch_sampler=seeded_batches(dataset.labels, batch, batches + warm_up))
        arrived = (loaded.inputs.to(device, non_blocking=True) for loaded in loader)
        batches_on_device = ((on_arrival(images) if on_arrival is not None else images, None) for images in arrived)
    seen, start = 0, 0.0
    for i, (images, _) in enumerate(batches_on_device):
        if i == warm_up:
            sync()
            start, seen = time.perf_counter(), 0
        seen += len(images)
    sync()
    return seen / (time.perf_counter() - start)


def fed_step_rates(root: Path, option: str, args: argparse.Namespace, device: str = "cuda") -> list[tuple[str, float]]:
    """(row, images/s) of the bare step (no trainer) fed by the device stage on one batch in memory, then by the
    whole device pipeline: the rows between "the step alone" and "end to end"."""
    rows = []
    for in_memory, what in ((True, "the device stage's thread on one batch in memory, no workers"),
                            (False, f"the device pipeline, {args.workers} workers")):
        # the batches made ahead are consumed before the timing, and the step warms up at least as when alone
        batches, ahead = device_pipeline(root, args.size, args.batch, args.workers, args.batches + STEP_WARMUP,
                                         torch.device(device), in_memory=in_memory)
        with contextlib.closing(batches):  # stops the stage's thread and the workers before the next row
            timing = time_train_steps(args.backbone, option, args.size, args.batch, args.batches,
                                      max(ahead, STEP_WARMUP), feed=batches, device=device)
        rows.append((f"the step without the trainer, fed by {what} (waiting for batches: {timing.waiting:.0%})",
                     timing.images_per_s))
    return rows


def end_to_end(root: Path, out: Path, decode_on: str, args: argparse.Namespace) -> float:
    """Images/s of the last of two epochs of ``train`` on the folder."""
    from retrieval.train import TrainConfig, train

    cfg = TrainConfig(dataset="folder", data=str(root), backbone=args.backbone, pretrained=False,
                      image_size=args.size, embedding_dim=512, loss="ms", batch_size=args.batch, per_class=4,
                      batches_per_epoch=args.batches, epochs=2, device="cuda", amp="bf16", channels_last=True,
                      compile=args.compile, workers=args.workers, decode_on=decode_on, eval_before=False,
                      eval_limit=256, plots=False, out=str(out))
    report = train(cfg, progress=False)
    epochs = [row for row in report["history"] if "images_per_s" in row]
    rates = [row["images_per_s"] for row in epochs]
    waits = [row["data_wait_s"] / row["epoch_time_s"] for row in epochs]
    print(f"  (--decode-on {decode_on}: images/s per epoch {', '.join(f'{rate:,.0f}' for rate in rates)}; "
          f"share of the epoch waiting for batches {', '.join(f'{wait:.0%}' for wait in waits)})", flush=True)
    return rates[-1]


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8_000)
    parser.add_argument("--per-class", type=int, default=40, help="images per class in the folder")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch (and timed pipeline batches)")
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--compile", action="store_true", help="compile the step (retrieval train --compile)")
    parser.add_argument("--backbone", default="efficientnet_lite0",
                        help="e.g. timm:efficientnet_lite0: the same network where efficientnet_lite_pytorch is absent")
    parser.add_argument("--only-end-to-end", action="store_true", help="skip the step and the pipelines alone")
    parser.add_argument("--decodes", nargs="+", choices=["workers", "device"], default=["workers", "device"],
                        help="the pipelines to time (--decode-on)")
    parser.add_argument("--folder", type=Path, default=None,
                        help="the JPEG folder: written there if missing, reused if present")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("gpu-input", args.save)
    scratch = Path(tempfile.mkdtemp(prefix="gpu-input-"))
    root = args.folder or scratch / "jpegs"
    if not root.exists():
        start = time.perf_counter()
        write_folder(root, args.images, args.per_class)
        files = list(root.rglob("*.jpg"))
        size = sum(path.stat().st_size for path in files) / len(files) / 1024
        print(f"wrote {len(files):,} JPEGs ({size:.0f} KiB each on average) in {time.perf_counter() - start:.0f} s",
              flush=True)
    option = "bf16 + --channels-last" + (" --compile" if args.compile else "")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.size} px, batch {args.batch}, "
          f"{args.workers} workers, {args.backbone}, {option}\n")
    print("| what | images/s | vs the step |")
    print("|---|---:|---:|")
    step = float("nan")
    if not args.only_end_to_end:
        step = time_train_steps(args.backbone, option, args.size, args.batch, 20, STEP_WARMUP).images_per_s
        print(f"| the training step alone (random images on the GPU) | {step:,.0f} | 1.00 |", flush=True)
        for decode_on in [mode for mode in ("workers", "device") if mode in args.decodes]:
            rate = pipeline_rate(root, decode_on, args.size, args.batch, args.workers, args.batches)
            print(f"| input pipeline alone, --decode-on {decode_on} | {rate:,.0f} | {rate / step:.2f} |", flush=True)
        if "device" in args.decodes:  # where end to end loses against the step: the decode thread, the workers
            for what, rate in fed_step_rates(root, option, args):
                print(f"| {what} | {rate:,.0f} | {rate / step:.2f} |", flush=True)
    for decode_on in [mode for mode in ("device", "workers") if mode in args.decodes]:
        rate = end_to_end(root, scratch / f"run-{decode_on}", decode_on, args)
        ratio = "-" if math.isnan(step) else f"{rate / step:.2f}"  # no step timed with --only-end-to-end
        print(f"| end to end (`retrieval train`, {args.batches} batches an epoch), --decode-on {decode_on} | "
              f"{rate:,.0f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
