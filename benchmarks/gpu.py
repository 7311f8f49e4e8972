"""On a CUDA GPU: training-step throughput per precision option, and DCDL's Sinkhorn per batch on GPU vs CPU.

    python benchmarks/gpu.py train [--backbones efficientnet_lite0 resnet50] [--size 224] [--batch 128]
    python benchmarks/gpu.py sinkhorn [--repeats 20]
    python benchmarks/gpu.py knn [--sizes 20000 100000 500000] [--cpu-sizes 20000] [--dim 512]

``train`` times the trainer's own step (``DataParallelStep`` with autocast, channels-last and torch.compile as
``--amp/--channels-last/--compile`` set them, ``GlobalBatchObjective``, ``GradScaler`` for fp16, AdamW) on random
224 px images, the whole backbone fine-tuned, per option: images/s over the timed steps (after warm-up, CUDA
synchronised) and the peak GPU memory. ``sinkhorn`` times forward + backward of ``classwise_sinkhorn`` (converged)
for the results grid's batch (10 x 6, D = 512) and larger ones, on the GPU and on the CPU. The loss and hard-negative
timings on the GPU come from ``benchmarks/hard_negatives.py --device cuda``. ``knn`` times
``retrieval.metrics.knn`` (k = 10) and ``evaluate`` (Recall@K, MAP@R) leave-one-out on N random rows with
``device="cuda"`` and on the CPU (torch's own thread count), measured rows only. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch

# option name -> (amp dtype, channels_last, compile, TF32 matmuls/convolutions)
OPTIONS = {
    "fp32": (None, False, False, False),
    "fp32 + TF32": (None, False, False, True),
    "fp16 (--amp fp16)": (torch.float16, False, False, False),
    "bf16 (--amp bf16)": (torch.bfloat16, False, False, False),
    "bf16 + --channels-last": (torch.bfloat16, True, False, False),
    "bf16 + --channels-last --compile": (torch.bfloat16, True, True, False),
}


class StepTiming(NamedTuple):
    """What ``time_train_steps`` measured over its timed steps."""

    images_per_s: float
    peak_mib: float  # peak GPU memory (NaN on a CPU)
    waiting: float  # share of the time spent waiting for ``feed``'s next batch (0 without a feed)


def time_train_steps(backbone: str, option: str, size: int, batch: int, steps: int, warmup: int,
                     feed: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None,
                     device: str = "cuda") -> StepTiming:
    """``steps`` optimizer steps of the trainer's step after ``warmup`` steps, on random images or ``feed``'s."""
    from retrieval import losses
    from retrieval.distributed import GlobalBatchObjective
    from retrieval.models import create_embedder
    from retrieval.train.distributed import DataParallelStep, init_distributed
    from retrieval.utils.reads import deferred_checks, read_checks, to_device

    amp, channels_last, compile_step, tf32 = OPTIONS[option]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    cuda, target = device == "cuda", torch.device(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx = init_distributed(device)
    torch.manual_seed(0)
    model = create_embedder(backbone, 512, pretrained=False, freeze_bn=True).to(device)
    loss = losses.build("ms")
    objective = GlobalBatchObjective(loss, gather=True)
    step = DataParallelStep(model, lambda net, x: net(x), None, loss, ctx, channels_last=channels_last,
                            compile_step=compile_step)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = torch.amp.GradScaler(device, enabled=amp == torch.float16)
    if feed is None:  # the same random images every step
        images = torch.rand(batch, 3, size, size, device=device)
        labels = torch.arange(batch, device=device).div(4, rounding_mode="floor")
    model.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start, seen, waited = 0.0, 0, 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            start, seen, waited = time.perf_counter(), 0, 0.0
        if feed is not None:
            fetch = time.perf_counter()
            images, labels = next(feed, (None, None))
            if images is None:
                raise RuntimeError(f"the feed ran out after {i} of {warmup + steps} batches: give it more")
            waited += time.perf_counter() - fetch
            labels = to_device(labels, target)  # as the trainer: queued, no wait for the device
        seen += len(images)
        with deferred_checks() as checks:
            embeddings, _ = step(images, labels, amp)
            value = objective(embeddings, labels)
        (finite,), failed = read_checks(checks, torch.isfinite(value.total))  # the trainer's one read a step
        if failed is not None:
            raise failed
        if not finite:  # skipped, as the trainer skips it
            continue
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(value.backward).backward()
        scaler.step(optimizer)
        scaler.update()
    sync()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    del model, step, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return StepTiming(seen / elapsed, peak, waited / elapsed)


def train_table(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.size} px, batch {args.batch} "
          f"(P x 4), loss ms, AdamW, {args.steps} timed steps after {args.warmup}\n")
    print("| backbone | option | images/s | vs fp32 | peak GPU MiB |")
    print("|---|---|---:|---:|---:|")
    for backbone in args.backbones:
        base = None
        for option in OPTIONS:
            rate, peak, _ = time_train_steps(backbone, option, args.size, args.batch, args.steps, args.warmup)
            base = base or rate
            print(f"| {backbone} | {option} | {rate:,.0f} | {rate / base:.2f}x | {peak:,.0f} |", flush=True)


def sinkhorn_ms(classes: int, per_class: int, dim: int, device: str, repeats: int,
                compiled: bool = False) -> tuple[float, float]:
    """(median, best) ms of forward + backward of the converged class-wise Sinkhorn term (``compiled``: its
    iterations through torch.compile, as ``--compile`` runs them; the warm-up calls compile)."""
    from retrieval.losses.discrepancy import classwise_sinkhorn

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(classes).repeat_interleave(per_class)
    centres = torch.randn(classes, dim, generator=g)
    x = torch.nn.functional.normalize(centres[labels] + torch.randn(len(labels), dim, generator=g), dim=1)
    x, labels = x.to(device), labels.to(device)
    times = []
    for i in range(repeats + 2):
        leaf = x.clone().requires_grad_(True)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        classwise_sinkhorn(leaf, labels, 2.5e-3, compiled=compiled).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def sinkhorn_table(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; CPU: {args.threads} thread(s); "
          f"eps = 2.5e-3, converged\n")
    print("| batch (classes x per class) | D | GPU ms (median / best) | GPU compiled ms | compiled / eager | "
          "CPU ms (median / best) | CPU / GPU |")
    print("|---|---:|---|---|---:|---|---:|")
    for classes, per_class, dim in ((10, 6, 512), (32, 4, 512), (64, 8, 512)):
        gpu = sinkhorn_ms(classes, per_class, dim, "cuda", args.repeats)
        fused = sinkhorn_ms(classes, per_class, dim, "cuda", args.repeats, compiled=True)
        cpu = sinkhorn_ms(classes, per_class, dim, "cpu", max(3, args.repeats // 4))
        print(f"| {classes} x {per_class} | {dim} | {gpu[0]:.1f} / {gpu[1]:.1f} | {fused[0]:.1f} / {fused[1]:.1f} "
              f"| {fused[0] / gpu[0]:.2f} | {cpu[0]:.1f} / {cpu[1]:.1f} | {cpu[0] / gpu[0]:.1f} |", flush=True)


def knn_timings(x, labels, device: str | None, k: int) -> tuple[float, float]:
    """(seconds of knn, seconds of evaluate) of leave-one-out exact kNN on rows ``x`` (cosine), on ``device``."""
    from retrieval.metrics import evaluate, knn

    start = time.perf_counter()
    knn(x, k=k, exclude_self=True, device=device)  # returns NumPy arrays: the GPU has finished
    knn_s = time.perf_counter() - start
    start = time.perf_counter()
    evaluate(x, labels, ks=(1, k), metrics=["recall", "map@r"], device=device)
    return knn_s, time.perf_counter() - start


def knn_table(args: argparse.Namespace) -> None:
    from retrieval.metrics import knn

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; CPU: {torch.get_num_threads()} thread(s); "
          f"leave-one-out, cosine, D = {args.dim}, float32, k = {args.k}; evaluate: recall@1/@{args.k} and MAP@R, "
          f"classes of ~{args.class_size} rows\n")
    knn(torch.randn(64, 8), k=2, device="cuda")  # CUDA context and cuBLAS start-up, outside the timings
    print("| device | N (queries = gallery) | kNN s | kNN queries/s | evaluate s | evaluate queries/s "
          "| GPU/CPU speed-up (kNN / evaluate) |")
    print("|---|---:|---:|---:|---:|---:|---|")
    cpu: dict[int, tuple[float, float]] = {}
    for n in sorted(set(args.sizes) | set(args.cpu_sizes)):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, args.dim, generator=g).numpy()
        labels = torch.randint(0, max(1, n // args.class_size), (n,), generator=g).numpy()
        for device in (["cpu"] if n in args.cpu_sizes else []) + (["cuda"] if n in args.sizes else []):
            knn_s, eval_s = knn_timings(x, labels, device, args.k)
            if device == "cpu":
                cpu[n] = (knn_s, eval_s)
            speedup = f"{cpu[n][0] / knn_s:.0f}x / {cpu[n][1] / eval_s:.0f}x" if device == "cuda" and n in cpu else ""
            print(f"| {device} | {n:,} | {knn_s:.2f} | {n / knn_s:,.0f} | {eval_s:.2f} | {n / eval_s:,.0f} "
                  f"| {speedup} |", flush=True)
        del x, labels


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train")
    train.add_argument("--backbones", nargs="+", default=["efficientnet_lite0", "timm:resnet50"])
    train.add_argument("--size", type=int, default=224)
    train.add_argument("--batch", type=int, default=128)
    train.add_argument("--steps", type=int, default=20)
    train.add_argument("--warmup", type=int, default=5)
    sinkhorn = sub.add_parser("sinkhorn")
    sinkhorn.add_argument("--repeats", type=int, default=20)
    sinkhorn.add_argument("--threads", type=int, default=4)
    knn_cmd = sub.add_parser("knn", help="exact leave-one-out kNN and evaluate: GPU vs CPU")
    knn_cmd.add_argument("--sizes", type=int, nargs="+", default=[20_000, 100_000, 500_000], help="N on the GPU")
    # N = 100,000 on the CPU takes ~40 s on 16 cores (H200 machine, 2026-11): add it with --cpu-sizes 20000 100000
    knn_cmd.add_argument("--cpu-sizes", type=int, nargs="+", default=[20_000], help="N on the CPU")
    knn_cmd.add_argument("--dim", type=int, default=512)
    knn_cmd.add_argument("--k", type=int, default=10)
    knn_cmd.add_argument("--class-size", type=int, default=20, help="rows per class (R + 1): the evaluate depth")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables({"train": "gpu-train-step"}.get(args.command, args.command), args.save)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    {"train": train_table, "sinkhorn": sinkhorn_table, "knn": knn_table}[args.command](args)


if __name__ == "__main__":
    main()
