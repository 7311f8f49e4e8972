"""Loss forward + backward time on CPU: ours side by side with pytorch-metric-learning (PML).

    .venv/bin/python benchmarks/losses.py [--repeats 30] [--batch-sizes 32 128 256] [--threads 1]

For every loss both implementations get the same embeddings [B, 512] (a leaf tensor) and labels; the two
are timed interleaved (ours, PML, ours, PML, ...) after a warm-up, and the table reports the median and
the minimum ("best", the less load-sensitive estimate) of ``--repeats`` forward + backward passes.
Batches are P classes x K samples: K = 4, except N-pair and angular (K = 2, the N-pair batch construction
of their papers). Settings are matched as far as the two libraries allow (same margins, same mining); the
"notes" column says where the two compute different things.
PML is a benchmark-only dependency (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from retrieval import losses

DIM = 512


@dataclass
class Case:
    name: str
    ours: Callable[[], torch.nn.Module]
    pml: Callable[[], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]
    per_class: int = 4
    notes: str = ""


def pml_cases() -> list[Case]:
    from pytorch_metric_learning import distances, miners
    from pytorch_metric_learning import losses as pml_losses

    def with_miner(loss, miner):
        return lambda e, y: loss(e, y, miner(e, y))

    return [
        Case(
            "contrastive",
            lambda: losses.build("contrastive", form="distance", pos_margin=0.0, neg_margin=1.0),
            lambda: pml_losses.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0),
            notes="all pairs, L2 distance; ours sum/B, PML mean over non-zero",
        ),
        Case(
            "triplet (all)",
            lambda: losses.build("triplet", margin=0.2, mining="all"),
            lambda: pml_losses.TripletMarginLoss(margin=0.2, triplets_per_anchor="all"),
            notes="every valid triplet",
        ),
        Case(
            "triplet (batch-hard)",
            lambda: losses.build("triplet", margin=0.2, mining="hard"),
            lambda: with_miner(pml_losses.TripletMarginLoss(margin=0.2), miners.BatchHardMiner()),
            notes="hardest positive + hardest negative per anchor",
        ),
        Case(
            "multi-similarity",
            lambda: losses.build("ms", alpha=2.0, beta=50.0, gamma=0.5, margin=0.1),
            lambda: with_miner(
                pml_losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5),
                miners.MultiSimilarityMiner(epsilon=0.1),
            ),
            notes="MS miner eps 0.1 + MS loss (2, 50, 0.5)",
        ),
        Case(
            "generalized lifted",
            lambda: losses.build("generalized_lifted", margin=1.0),
            lambda: pml_losses.GeneralizedLiftedStructureLoss(
                neg_margin=-1.0, pos_margin=0.0, distance=distances.CosineSimilarity()
            ),
            notes="same per-anchor formula on cosine similarity",
        ),
        Case(
            "N-pair",
            lambda: losses.build("npair"),
            lambda: pml_losses.NPairsLoss(),
            per_class=2,
            notes="PML: one pair per class (N x N CE); ours: every ordered positive pair",
        ),
        Case(
            "angular",
            lambda: losses.build("angular", alpha=30.0),
            lambda: pml_losses.AngularLoss(alpha=30.0),
            per_class=2,
            notes="all positive pairs x negatives; PML normalises, ours raw features",
        ),
    ]


def batch(batch_size: int, per_class: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(batch_size // per_class).repeat_interleave(per_class)
    centres = torch.randn(batch_size // per_class, DIM, generator=g)
    embeddings = centres[labels] + 2.0 * torch.randn(batch_size, DIM, generator=g)
    return torch.nn.functional.normalize(embeddings, dim=1), labels


def time_once(fn, embeddings: torch.Tensor, labels: torch.Tensor) -> float:
    leaf = embeddings.clone().requires_grad_(True)
    start = time.perf_counter()
    fn(leaf, labels).backward()
    return time.perf_counter() - start


def measure(case: Case, batch_size: int, repeats: int, warmup: int = 3) -> tuple[list[float], list[float]]:
    ours, pml = case.ours(), case.pml()
    embeddings, labels = batch(batch_size, case.per_class, seed=batch_size)
    for _ in range(warmup):
        time_once(ours, embeddings, labels)
        time_once(pml, embeddings, labels)
    ours_times, pml_times = [], []
    for _ in range(repeats):  # interleaved, so that load changes hit both sides alike
        ours_times.append(time_once(ours, embeddings, labels))
        pml_times.append(time_once(pml, embeddings, labels))
    return ours_times, pml_times


def main(argv: list[str] | None = None) -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: steadier timings)")
    parser.add_argument("--only", nargs="*", help="loss names to run (default: all)")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args(argv)
    record_tables("losses-pml", args.save)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(
        f"torch {torch.__version__}, {args.threads} thread(s), D = {DIM}, {args.repeats} interleaved repeats"
    )
    print()
    print(
        "| loss | B | K | ours ms (median / best) | PML ms (median / best) "
        "| ours / PML (median / best) | notes |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for case in pml_cases():
        if args.only and case.name not in args.only:
            continue
        for batch_size in args.batch_sizes:
            ours, pml = measure(case, batch_size, args.repeats)
            ours_med, pml_med = statistics.median(ours), statistics.median(pml)
            ours_best, pml_best = min(ours), min(pml)
            note = case.notes if batch_size == args.batch_sizes[0] else ""
            print(
                f"| {case.name} | {batch_size} | {case.per_class} "
                f"| {1e3 * ours_med:.2f} / {1e3 * ours_best:.2f} "
                f"| {1e3 * pml_med:.2f} / {1e3 * pml_best:.2f} "
                f"| {ours_med / pml_med:.2f} / {ours_best / pml_best:.2f} | {note} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
