"""Training throughput: 2 torchrun ranks x 1 thread vs 1 process x 2 threads, and the cost of the gather.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/ddp.py [--backbone resnet18] [--size 64] [--batch 32]
                                                        [--steps 12] [--warmup 3] [--loss ms] [--ranks 2]

Both runs do the same work per optimizer step: a global batch of --batch random images (P x K labels, K = 4)
through ``create_embedder(backbone)`` (fine-tuning, frozen BN), the loss on the global batch, backward, AdamW.
One process uses ``torch.set_num_threads(ranks)`` (and, for reference, 1 thread); the distributed run has --ranks
gloo ranks of one thread each, each with its B / ranks part, DDP and ``GlobalBatchObjective`` (all-gather of
embeddings and labels). Reported: images/s over the timed steps (after --warmup) and, for the ranks, the
milliseconds per step spent in the all-gather of the [B, D] embeddings (timed apart, same tensors). Prints a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def steps(args: argparse.Namespace) -> dict:
    """Time ``args.steps`` optimizer steps in this process (one rank of a torchrun job or the only process)."""
    import torch

    from retrieval import losses
    from retrieval.distributed import GlobalBatchObjective, all_gather_rows, rank_and_world
    from retrieval.models import create_embedder
    from retrieval.train.distributed import DataParallelStep, init_distributed

    ctx = init_distributed("cpu")
    rank, world = rank_and_world()
    torch.set_num_threads(1 if world > 1 else args.threads)
    torch.manual_seed(0)
    model = create_embedder(args.backbone, 128, pretrained=False, freeze_bn=True)
    loss = losses.build(args.loss)
    objective = GlobalBatchObjective(loss, gather=True)
    step = DataParallelStep(model, lambda net, x: net(x), None, loss, ctx)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    part = args.batch // world
    generator = torch.Generator().manual_seed(rank)
    images = torch.rand(part, 3, args.size, args.size, generator=generator)
    labels = torch.arange(args.batch).div(4, rounding_mode="floor")[rank * part:(rank + 1) * part]
    model.train()
    gather_s, start = 0.0, 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            ctx.barrier()
            start = time.perf_counter()
        embeddings, _ = step(images, labels, None)
        if world > 1:  # the gather alone, on the same tensors (the objective below gathers again)
            t = time.perf_counter()
            all_gather_rows(embeddings.detach())
            all_gather_rows(labels)
            gather_s += time.perf_counter() - t if i >= args.warmup else 0.0
        optimizer.zero_grad(set_to_none=True)
        objective(embeddings, labels).backward.backward()
        optimizer.step()
    ctx.barrier()
    elapsed = time.perf_counter() - start
    return {"rank": rank, "world": world, "images_per_s": args.batch * args.steps / elapsed,
            "gather_ms": 1000 * gather_s / args.steps}


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--loss", default="ms")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="(one process: defaults to --ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("ddp", args.save)
    args.threads = args.threads or args.ranks
    if args.worker:
        result = steps(args)
        if result["rank"] == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("worker", "save")]
    one = [sys.executable, __file__, "--worker", *forwarded]
    single = [sys.executable, __file__, "--worker", *forwarded, "--threads=1"]
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
             __file__, "--worker", *forwarded]
    rows = []
    runs = (("1 process x 1 thread", single), (f"1 process x {args.threads} threads", one),
            (f"{args.ranks} ranks x 1 thread", ranks))
    for name, command in runs:
        out = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout
        result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
        rows.append((name, result))
    print(f"{args.backbone} {args.size}px, global batch {args.batch}, loss {args.loss}, {args.steps} timed steps\n")
    print("| run | images/s | all-gather ms/step |\n|---|---|---|")
    for name, result in rows:
        gather = f"{result['gather_ms']:.2f}" if result["world"] > 1 else "-"
        print(f"| {name} | {result['images_per_s']:.1f} | {gather} |")


if __name__ == "__main__":
    main()
