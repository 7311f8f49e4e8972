"""Peak memory and time of one fine-tuning step with --chunks 1, 2, 4, 8 on a batch that does not fit otherwise.

    .venv/bin/python benchmarks/chunks.py [--batch 512] [--image-size 128] [--chunks 1 2 4 8] [--steps 3]
                                          [--device cpu|cuda] [--memory-limit-gb 12]

Each setting runs in its own process (a fresh peak): EfficientNet-Lite0 at --image-size, the ms loss, AdamW, one
warm-up step then --steps timed steps of the same batch of random images through ``DataParallelStep`` exactly as the
trainer runs it. On CUDA the peak is ``torch.cuda.max_memory_allocated``; on the CPU it is the process's peak RSS
(``ru_maxrss``), and a process whose address space would pass --memory-limit-gb is stopped by ``RLIMIT_AS`` and
reported as not fitting. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def one_setting(args: argparse.Namespace, chunks: int) -> dict:
    import torch

    from retrieval.losses import build
    from retrieval.models import create_embedder
    from retrieval.train.distributed import DataParallelStep, DistContext

    torch.manual_seed(0)
    device = torch.device(args.device)
    model = create_embedder("efficientnet_lite0", 512, pretrained=True, normalize=True, freeze_bn=True).to(device)
    model.train()
    loss = build("ms")
    step = DataParallelStep(model, lambda net, x: net(x), None, loss, DistContext(0, 1, 0, device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.arange(args.batch // 4, device=device).repeat_interleave(4)
    times = []
    for i in range(args.steps + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if chunks > 1:
            embeddings, replay = step.chunked(images, labels, None, chunks)
            loss(embeddings, labels).backward()
            replay()
        else:
            embeddings, _ = step(images, labels, None)
            loss(embeddings, labels).backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first step warms up
            times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"chunks": chunks, "step_s": sum(times) / len(times), "peak_gb": peak / 2**30}


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--memory-limit-gb", type=float, default=12.0)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one setting, print JSON
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(f"chunks-batch{args.batch}", args.save)
    if args.one is not None:
        if args.device == "cpu":
            limit = int(args.memory_limit_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(one_setting(args, args.one)))
        return
    print(f"batch {args.batch} images of {args.image_size} px, EfficientNet-Lite0, ms, AdamW, {args.device}; "
          f"{'peak RSS' if args.device == 'cpu' else 'peak CUDA memory'}\n")
    print("| --chunks | peak memory (GiB) | time per step (ms) | x time of the first row that fits |")
    print("| --- | --- | --- | --- |")
    first = None
    for chunks in args.chunks:
        command = [sys.executable, __file__, "--one", str(chunks), "--batch", str(args.batch), "--image-size",
                   str(args.image_size), "--steps", str(args.steps), "--device", args.device,
                   "--memory-limit-gb", str(args.memory_limit_gb)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            reason = "out of memory" if "memory" in (done.stderr[-2000:]).lower() else done.stderr.strip()[-200:]
            print(f"| {chunks} | does not fit under {args.memory_limit_gb:g} GiB ({reason}) | - | - |")
            continue
        result = json.loads(done.stdout.strip().splitlines()[-1])
        first = first or result["step_s"]
        print(f"| {chunks} | {result['peak_gb']:.2f} | {result['step_s'] * 1e3:.0f} | {result['step_s'] / first:.2f} |")


if __name__ == "__main__":
    main()
