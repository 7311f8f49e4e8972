"""What converging DCDL's Sinkhorn costs: the class-wise Sinkhorn divergence (dcdl supp. eq. 11-13) per batch.

    .venv/bin/python benchmarks/sinkhorn.py [--repeats 20] [--threads 1]

For the grid's batch (10 classes x 6, D = 512, unit vectors, eps = 2.5e-3) and a 32 x 4 one, forward + backward
of ``classwise_sinkhorn`` (converged: iterations until no dual potential moves by 1e-6) next to geomloss's
fixed epsilon-scaling schedules (scaling 0.9 and 0.99), with each value's largest error against
POT's converged log-domain Sinkhorn. Batches are drawn around class centres (spread 1) as embeddings of a
partly trained head are. geomloss is a benchmark-only dependency (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ot
import torch

from retrieval.losses.discrepancy import DEFAULT_EPSILON, _gather_padded, classwise_sinkhorn, split_classes


def batch(classes: int, per_class: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(classes).repeat_interleave(per_class)
    z = torch.randn(classes, 512, generator=g)[labels] + torch.randn(len(labels), 512, generator=g)
    return torch.nn.functional.normalize(z, dim=1), labels


def pot_reference(z: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    """Eq. 13 per class from POT's log-domain Sinkhorn run to 1e-10 (float64)."""

    def w(x, y):
        a, b = np.full(len(x), 1 / len(x)), np.full(len(y), 1 / len(y))
        cost = 0.5 * ot.dist(x, y, metric="sqeuclidean")
        plan = ot.sinkhorn(a, b, cost, DEFAULT_EPSILON, method="sinkhorn_log", numItermax=20000, stopThr=1e-10,
                           warn=False)
        entropy = np.where(plan > 0, plan * (np.log(np.where(plan > 0, plan, 1.0)) - 1.0), 0.0)
        return float((cost * plan).sum() + DEFAULT_EPSILON * entropy.sum())

    zd = z.double().numpy()
    out = []
    for k in labels.unique().tolist():
        x, y = zd[(labels == k).numpy()], zd[(labels != k).numpy()]
        out.append(w(x, y) - 0.5 * (w(x, x) + w(y, y)))
    return np.array(out)


def geomloss_fn(scaling: float):
    from geomloss import SamplesLoss

    def fn(z, labels):
        split = split_classes(labels)
        x, a = _gather_padded(z, split.members, split.positive_weights)
        y, b = _gather_padded(z, ~split.members, split.negative_weights)
        diameter = float(torch.cdist(z.detach(), z.detach()).max())
        loss = SamplesLoss("sinkhorn", p=2, blur=DEFAULT_EPSILON**0.5, debias=True, scaling=scaling,
                           diameter=diameter, backend="tensorized")
        return loss(a, x, b, y)

    return fn


def timed(fn, z, labels, repeats: int) -> tuple[list[float], np.ndarray]:
    times = []
    for _ in range(repeats + 2):
        leaf = z.clone().requires_grad_(True)
        start = time.perf_counter()
        values = fn(leaf, labels)
        values.sum().backward()
        times.append(time.perf_counter() - start)
    return times[2:], values.detach().double().numpy()


def main(argv: list[str] | None = None) -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args(argv)
    record_tables("sinkhorn", args.save)
    torch.set_num_threads(args.threads)
    solvers = [("ours, converged (tolerance 1e-6)", classwise_sinkhorn)]
    try:
        solvers += [(f"geomloss, scaling {s}", geomloss_fn(s)) for s in (0.9, 0.99)]
    except ImportError:
        print("geomloss is not installed (the `bench` extra): only our solver is timed")
    print(f"torch {torch.__version__}, {args.threads} thread(s), D = 512, eps = {DEFAULT_EPSILON}, "
          f"{args.repeats} repeats")
    print()
    print("| batch (P x K) | solver | forward + backward ms (median / best) | largest error vs POT |")
    print("|---|---|---:|---:|")
    for classes, per_class in ((10, 6), (32, 4)):
        z, labels = batch(classes, per_class)
        reference = pot_reference(z, labels)
        for name, fn in solvers:
            times, values = timed(fn, z, labels, args.repeats)
            print(f"| {classes} x {per_class} | {name} | {1e3 * statistics.median(times):.1f} / "
                  f"{1e3 * min(times):.1f} | {np.abs(values - reference).max():.1e} |", flush=True)


if __name__ == "__main__":
    main()
