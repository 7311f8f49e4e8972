"""On a CUDA GPU: training-step throughput per precision option, and DCDL's Sinkhorn per batch on GPU vs CPU.

    python benchmarks/gpu.py train [--backbones efficientnet_lite0 resnet50] [--size 224] [--batch 128]
    python benchmarks/gpu.py sinkhorn [--repeats 20]

``train`` times the trainer's own step (``DataParallelStep`` with autocast, channels-last and torch.compile as
``--amp/--channels-last/--compile`` set them, ``GlobalBatchObjective``, ``GradScaler`` for fp16, AdamW) on random
224 px images, the whole backbone fine-tuned, per option: images/s over the timed steps (after warm-up, CUDA
synchronised) and the peak GPU memory. ``sinkhorn`` times forward + backward of ``classwise_sinkhorn`` (converged)
for the results grid's batch (10 x 6, D = 512) and larger ones, on the GPU and on the CPU. The loss and hard-negative
timings on the GPU come from ``benchmarks/hard_negatives.py --device cuda``. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def time_train_steps(backbone: str, option: str, size: int, batch: int, steps: int, warmup: int) -> tuple[float, float]:
    """(images/s, peak GPU MiB) of ``steps`` optimizer steps of the trainer's step, after ``warmup`` steps."""
    from retrieval import losses
    from retrieval.distributed import GlobalBatchObjective
    from retrieval.models import create_embedder
    from retrieval.train.distributed import DataParallelStep, init_distributed

    amp, channels_last, compile_step, tf32 = OPTIONS[option]
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    ctx = init_distributed("cuda")
    torch.manual_seed(0)
    model = create_embedder(backbone, 512, pretrained=False, freeze_bn=True).cuda()
    loss = losses.build("ms")
    objective = GlobalBatchObjective(loss, gather=True)
    step = DataParallelStep(model, lambda net, x: net(x), None, loss, ctx, channels_last=channels_last,
                            compile_step=compile_step)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=amp == torch.float16)
    images = torch.rand(batch, 3, size, size, device="cuda")
    labels = torch.arange(batch, device="cuda").div(4, rounding_mode="floor")
    model.train()
    torch.cuda.reset_peak_memory_stats()
    start = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        embeddings, _ = step(images, labels, amp)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(objective(embeddings, labels).backward).backward()
        scaler.step(optimizer)
        scaler.update()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20
    del model, step, optimizer
    torch.cuda.empty_cache()
    return batch * steps / elapsed, peak


def train_table(args: argparse.Namespace) -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.size} px, batch {args.batch} "
          f"(P x 4), loss ms, AdamW, {args.steps} timed steps after {args.warmup}\n")
    print("| backbone | option | images/s | vs fp32 | peak GPU MiB |")
    print("|---|---|---:|---:|---:|")
    for backbone in args.backbones:
        base = None
        for option in OPTIONS:
            rate, peak = time_train_steps(backbone, option, args.size, args.batch, args.steps, args.warmup)
            base = base or rate
            print(f"| {backbone} | {option} | {rate:,.0f} | {rate / base:.2f}x | {peak:,.0f} |", flush=True)


def sinkhorn_ms(classes: int, per_class: int, dim: int, device: str, repeats: int) -> tuple[float, float]:
    """(median ms, iterations are inside) of forward + backward of the converged class-wise Sinkhorn term."""
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
        classwise_sinkhorn(leaf, labels, 2.5e-3).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def sinkhorn_table(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; CPU: {args.threads} thread(s); "
          f"eps = 2.5e-3, converged\n")
    print("| batch (classes x per class) | D | GPU ms (median / best) | CPU ms (median / best) | CPU / GPU |")
    print("|---|---:|---|---|---:|")
    for classes, per_class, dim in ((10, 6, 512), (32, 4, 512), (64, 8, 512)):
        gpu = sinkhorn_ms(classes, per_class, dim, "cuda", args.repeats)
        cpu = sinkhorn_ms(classes, per_class, dim, "cpu", max(3, args.repeats // 4))
        print(f"| {classes} x {per_class} | {dim} | {gpu[0]:.1f} / {gpu[1]:.1f} | {cpu[0]:.1f} / {cpu[1]:.1f} "
              f"| {cpu[0] / gpu[0]:.1f} |", flush=True)


def main() -> None:
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
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    {"train": train_table, "sinkhorn": sinkhorn_table}[args.command](args)


if __name__ == "__main__":
    main()
