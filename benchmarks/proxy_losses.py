"""Forward + backward time of each proxy loss and of MS with a cross-batch memory, next to MS, on CPU (or CUDA).

    .venv/bin/python benchmarks/proxy_losses.py [--batch 128] [--per-class 4] [--dim 512] [--classes 1000]
                                                [--memory 4096] [--repeats 30] [--device cpu|cuda]

Every row times ``loss(embeddings, labels).backward()`` (the proxies' gradient included), interleaved with MS run
by run in one process, so the ratio to MS is measured under the same load (median and best of the repeats after a
warm-up). The memory row fills the queue first, so it times a step that sees --memory past rows. One torch thread
by default (the CPUs are shared). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from retrieval.losses import build
from retrieval.losses.memory import CrossBatchMemory

PROXY_LOSSES = ["proxy_anchor", "proxy_nca", "norm_softmax", "cosface", "arcface", "soft_triple"]


def one_step_ms(loss: torch.nn.Module, emb: torch.Tensor, labels: torch.Tensor) -> float:
    e = emb.clone().requires_grad_(True)
    if e.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    loss(e, labels).backward()
    if e.is_cuda:
        torch.cuda.synchronize()
    loss.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--per-class", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, default=1000, help="training classes (the proxies' count)")
    parser.add_argument("--memory", type=int, default=4096, help="rows of the cross-batch memory")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("proxy-losses", args.save)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    labels = torch.randperm(args.classes)[: args.batch // args.per_class].repeat_interleave(args.per_class).to(device)
    emb = torch.randn(len(labels), args.dim, device=device)
    ms = build("ms").to(device)
    rows = [(name, build(name, num_classes=args.classes, embedding_dim=args.dim).to(device)) for name in PROXY_LOSSES]
    memory = CrossBatchMemory(build("ms"), args.memory, args.dim).to(device)
    memory.enqueue(torch.randn(args.memory, args.dim, device=device),
                   torch.randint(0, args.classes, (args.memory,), device=device))
    memory.train(False)  # timed steps do not enqueue: every one sees the same full memory
    rows.append((f"ms + XBM ({args.memory} rows)", memory))
    print(f"B = {args.batch} ({args.per_class} per class), D = {args.dim}, C = {args.classes}, {args.device}, "
          f"{args.threads} thread(s)\n")
    print("| loss | ms (median) | ms (best) | MS median | x MS (median) |")
    print("| --- | --- | --- | --- | --- |")
    for name, loss in rows:
        for _ in range(2):
            one_step_ms(ms, emb, labels), one_step_ms(loss, emb, labels)
        base, timed = [], []
        for _ in range(args.repeats):
            base.append(one_step_ms(ms, emb, labels))
            timed.append(one_step_ms(loss, emb, labels))
        b, t = statistics.median(base), statistics.median(timed)
        print(f"| {name} | {t:.2f} | {min(timed):.2f} | {b:.2f} | {t / b:.2f} |")


if __name__ == "__main__":
    main()
