"""Forward + backward time of the LoOp / Symm losses next to their base losses, on CPU (or a CUDA GPU).

    .venv/bin/python benchmarks/hard_negatives.py [--batch 32 128 256] [--per-class 4] [--dim 512] [--repeats 30]
                                                  [--device cpu|cuda] [--compile] [--compile-whole]
                                                  [--losses ms lifted_min ...]
    .venv/bin/python benchmarks/hard_negatives.py --pairing [--batch 16 64 256] [--per-class 4 8]

Each row times ``loss(embeddings, labels).backward()`` for the base loss and its hard-negative variant,
interleaved run by run in one process (median and best of --repeats runs after warm-up, fewer for slow
rows), so that the ratio is measured under the same load; on a shared machine the best-of time is the
less noisy estimate of the intrinsic cost. One torch thread by default (the CPUs are shared).
``--compile``: also the LoOp variants with their solver compiled (what ``retrieval train --compile`` runs: compiled for
the batch's sizes);
``--compile-dynamic``: also the LoOp variants with their solver compiled for dynamic sizes (what torch compiles once
the sizes change, and what ``--compile`` ran before);
``--cuda-graphs``: also the LoOp variants with their compiled solver replayed as CUDA graphs (``torch.compile``'s
``mode="reduce-overhead"``; an experiment, CUDA only);
``--compile-whole``: also LoOp with MS and lifted_min (the two above 1.5x the base loss with the solver compiled) as
one ``torch.compile(loss, dynamic=True)`` against the base loss compiled the same way: the pair bookkeeping and the
loss's pair-level form fused too, between the graph breaks of their data-dependent shapes (an experiment, not adopted:
on an H200 it took as much off the base loss as off LoOp, so the ratio stayed at 1.7x; the first call of each compiles
for a minute or more).
``--ops``: instead of times, the ops each row runs on the host, forward and backward: the top-level aten ops outside
the compiled regions (views included), about a kernel launch each on a GPU, counted with torch.profiler.
``--pairing``: instead, the host's share of a LoOp step alone, ``pair_grid`` (the positive pairs and their
combinations, formed in NumPy from the labels each step), in microseconds (best of 3 x 200 calls), for both readings
of ``negative_pairs``.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch._dynamo.utils import counters

from retrieval.losses import build
from retrieval.negatives import loop
from retrieval.negatives.pairs import NEGATIVE_PAIRS, pair_grid
from retrieval.utils.reads import known_on_host

# (loss name, negatives method): the base loss is build(name) with the same defaults.
VARIANTS = [
    ("triplet", "loop"),
    ("hphn_triplet", "loop"),
    ("lifted_min", "loop"),
    ("ms", "loop"),
    ("triplet", "loop-linear"),
    ("triplet", "symm"),
    ("lifted", "symm"),
    ("npair", "symm"),
    ("angular", "symm"),
]


class WithSolver(torch.nn.Module):
    """``loss`` (LoOp, its solver compiled) with the compiled grid replaced by ``solver`` while it runs forward."""

    def __init__(self, loss: torch.nn.Module, solver: object) -> None:
        super().__init__()
        self.loss, self.solver = loss, solver
        loss.method.compile_solver()

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        original = loop._compiled_hardest_grid
        loop._compiled_hardest_grid = lambda: self.solver
        try:
            return self.loss(embeddings, labels)
        finally:
            loop._compiled_hardest_grid = original


def _one_step_ms(loss: torch.nn.Module, emb: torch.Tensor, labels: torch.Tensor) -> float:
    e, host = emb.clone().requires_grad_(True), labels.cpu()  # the trainer's host labels (``known_on_host``)
    if e.is_cuda:  # GPU work is asynchronous: time from an idle device to the end of the backward
        torch.cuda.synchronize()
    start = time.perf_counter()
    with known_on_host(labels, host):
        loss(e, labels).backward()
    if e.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def time_pair(
    base: torch.nn.Module, variant: torch.nn.Module, emb: torch.Tensor, labels: torch.Tensor, repeats: int
) -> tuple[tuple[float, float], tuple[float, float]]:
    """(median, best) ms of one forward + backward of each, the two runs interleaved so that they share the load."""
    for _ in range(2):  # warm-up (a compiled variant compiles here)
        _one_step_ms(base, emb, labels), _one_step_ms(variant, emb, labels)
    first = _one_step_ms(base, emb, labels) + _one_step_ms(variant, emb, labels)
    repeats = max(5, min(repeats, int(3000 / max(first, 1e-3))))  # about 3 s per row at most
    base_ms, variant_ms = [], []
    for _ in range(repeats):
        base_ms.append(_one_step_ms(base, emb, labels))
        variant_ms.append(_one_step_ms(variant, emb, labels))
    return (statistics.median(base_ms), min(base_ms)), (statistics.median(variant_ms), min(variant_ms))


COMPILED_REGIONS = ("Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph", "TorchDynamo Cache Lookup")


def top_level_ops(loss: torch.nn.Module, emb: torch.Tensor, labels: torch.Tensor) -> int:
    """The aten ops one forward + backward of ``loss`` runs outside compiled regions, not counting those nested in
    another aten op (after two warm-up runs, which compile)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        _one_step_ms(loss, emb, labels)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _one_step_ms(loss, emb, labels)
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, outside = event.cpu_parent, True
        while parent is not None and outside:
            outside = not parent.name.startswith(("aten::", *COMPILED_REGIONS))
            parent = parent.cpu_parent
        count += outside
    return count


def pairing_us(labels: np.ndarray, negative_pairs: str, calls: int = 200) -> float:
    """Best of 3 mean times (microseconds) of ``pair_grid(labels, negative_pairs)`` over ``calls`` calls."""
    best = float("inf")
    for _ in range(3):
        pair_grid(labels, negative_pairs)
        start = time.perf_counter()
        for _ in range(calls):
            pair_grid(labels, negative_pairs)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def print_pairing(batches: list[int], per_class: list[int]) -> None:
    """The ``--pairing`` table: ``pair_grid``'s time for each batch size, images per class and reading."""
    print(f"| B | P x N | {' | '.join(f'{mode} (us)' for mode in NEGATIVE_PAIRS)} |")
    print(f"|---|---|{'---|' * len(NEGATIVE_PAIRS)}")
    for batch in batches:
        for n in per_class:
            labels = np.repeat(np.random.default_rng(batch).permutation(10 * batch)[:batch // n], n)
            times = " | ".join(f"{pairing_us(labels, mode):.0f}" for mode in NEGATIVE_PAIRS)
            print(f"| {batch} | {batch // n} x {n} | {times} |", flush=True)


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--per-class", type=int, nargs="+", default=[4],
                        help="images per class (several only with --pairing)")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave the default)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", action="store_true",
                        help="also time each LoOp variant with its solver compiled (retrieval train --compile)")
    parser.add_argument("--compile-dynamic", action="store_true",
                        help="also time each LoOp variant with its solver compiled for dynamic sizes")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="also time each LoOp variant with its compiled solver replayed as CUDA graphs")
    parser.add_argument("--compile-whole", action="store_true",
                        help="also time LoOp with MS and lifted_min compiled whole, against the base compiled whole")
    parser.add_argument("--losses", nargs="+", default=None, help="only these base losses (default: all)")
    parser.add_argument("--pairing", action="store_true", help="time the host's pairing (pair_grid) alone instead")
    parser.add_argument("--ops", action="store_true", help="count each row's top-level ops instead of timing it")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("hard-negatives", args.save)
    if args.pairing:
        print_pairing(args.batch, args.per_class)
        return
    if args.cuda_graphs and args.device != "cuda":
        parser.error("--cuda-graphs needs --device cuda (a CPU compile replays no graph)")
    if len(args.per_class) != 1:
        parser.error("--per-class takes one value, several only with --pairing")
    per_class = args.per_class[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {where}, N = {per_class}, D = {args.dim}\n")
    if args.ops:
        print("| loss | negatives | B | base ops | variant ops | difference |")
    else:
        print("| loss | negatives | B | base ms (median / best) | variant ms (median / best) | ratio (median / best) |")
    print("|---|---|---|---|---|---|")
    for batch in args.batch:
        torch._dynamo.reset()  # each batch size compiled for its own sizes, as a run of that size compiles it
        g = torch.Generator().manual_seed(batch)
        labels = torch.arange(batch // per_class).repeat_interleave(per_class)
        emb = torch.randn(batch, args.dim, generator=g).to(args.device)
        labels = labels.to(args.device)
        for name, method in VARIANTS:
            if args.losses and name not in args.losses:
                continue
            eager_base = build(name).to(args.device)
            rows = [(method, eager_base, build(name, negatives=method).to(args.device))]
            if args.compile and method.startswith("loop"):
                rows.append((f"{method} compiled", eager_base, build(name, negatives=method).to(args.device)))
                rows[-1][2].method.compile_solver()
            if args.compile_dynamic and method.startswith("loop"):
                rows.append((f"{method} compiled, dynamic sizes", eager_base, WithSolver(
                    build(name, negatives=method).to(args.device), torch.compile(loop._hardest_grid, dynamic=True))))
            if args.cuda_graphs and method.startswith("loop"):
                rows.append((f"{method} compiled, CUDA graphs", eager_base, WithSolver(
                    build(name, negatives=method).to(args.device),
                    torch.compile(loop._hardest_grid, mode="reduce-overhead"))))
            if args.compile_whole and method == "loop" and name in ("ms", "lifted_min"):
                rows.append((f"{method}, whole loss compiled (base too)",
                             torch.compile(build(name).to(args.device), dynamic=True),
                             torch.compile(build(name, negatives=method).to(args.device), dynamic=True)))
            for label, base_loss, loss in rows:
                if args.ops:
                    base_ops, variant_ops = top_level_ops(base_loss, emb, labels), top_level_ops(loss, emb, labels)
                    print(f"| {name} | {label} | {batch} | {base_ops} | {variant_ops} | {variant_ops - base_ops:+d} |",
                          flush=True)
                    continue
                skips = counters["inductor"]["cudagraph_skips"]
                try:
                    base, variant = time_pair(base_loss, loss, emb, labels, args.repeats)
                except Exception as exc:
                    if "CUDA graphs" not in label:
                        raise
                    # an experiment that fails leaves the other rows
                    print(f"| {name} | {label} | {batch} | failed: {type(exc).__name__}: {str(exc)[:200]} | | |")
                    continue
                if counters["inductor"]["cudagraph_skips"] > skips:  # torch ran the kernels without graphs
                    label += " (not replayed: see torch's 'skipping cudagraphs' warning)"
                print(
                    f"| {name} | {label} | {batch} | {base[0]:.2f} / {base[1]:.2f} | {variant[0]:.2f} / "
                    f"{variant[1]:.2f} | {variant[0] / base[0]:.2f} / {variant[1] / base[1]:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
