"""Time and peak memory of retrieval.metrics.evaluate on a Fashion-MNIST-sized set (60,000 x 512).

Each case runs in its own subprocess so that its peak RSS (ru_maxrss) is its own:

    .venv/bin/python benchmarks/metrics.py                     # random + clustered, 60000 x 512, 10 classes
    .venv/bin/python benchmarks/metrics.py --n 6000 --quick    # a fast smoke run
    .venv/bin/python benchmarks/metrics.py --knn-backends      # torch matmul+topk vs faiss IndexFlatIP
    .venv/bin/python benchmarks/metrics.py --kinds random --retrieval-metrics recall --quick  # k = 8 only

Printed: seconds and peak RSS for (a) Recall@K + MAP@R + R-precision, (b) NMI + F1, with the RSS right
after the embeddings were created, so that the metric's own share is visible.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def make_embeddings(kind: str, n: int, dim: int, num_classes: int, seed: int = 0):
    """float32 [n, dim] embeddings and int64 labels, classes of equal size.

    random: labels carry no signal (chance-level metrics). clustered: class centre + noise, with the
    noise chosen so that MAP@R is in a middle range rather than 0 or 1.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % num_classes
    x = torch.randn(n, dim, generator=gen)
    if kind == "clustered":
        centres = torch.randn(num_classes, dim, generator=gen)
        x.mul_(3.0).add_(centres[labels])
    return x.numpy(), labels.numpy()


def run_case(args: argparse.Namespace) -> dict:
    from retrieval.metrics import evaluate

    x, y = make_embeddings(args.kind, args.n, args.dim, args.classes)
    rss_data = current_rss_mib()
    result: dict = {"kind": args.kind, "n": args.n, "dim": args.dim, "classes": args.classes,
                    "rss_after_data_mib": round(rss_data, 1)}
    start = time.perf_counter()
    result["retrieval_metrics"] = args.retrieval_metrics
    knn_metrics = evaluate(x, y, metrics=args.retrieval_metrics.split(","), block_size=args.block_size)
    result["retrieval_s"] = round(time.perf_counter() - start, 2)
    result["peak_rss_after_retrieval_mib"] = round(peak_rss_mib(), 1)
    if not args.skip_clustering:
        start = time.perf_counter()
        clustering = evaluate(x, y, metrics=["nmi", "f1"])
        result["clustering_s"] = round(time.perf_counter() - start, 2)
        knn_metrics.update(clustering)
    result["peak_rss_mib"] = round(peak_rss_mib(), 1)
    result["metrics"] = {k: round(v, 4) for k, v in knn_metrics.items()}
    return result


def run_knn_backends(args: argparse.Namespace) -> list[dict]:
    """torch (the library's path) against faiss IndexFlatIP for the same queries, two depths."""
    import faiss
    import numpy as np

    from retrieval.metrics import knn

    x, _ = make_embeddings("random", args.n, args.dim, args.classes)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    queries = x[: args.knn_queries]
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(x)
    rows = []
    for k in (8, args.n // args.classes):
        start = time.perf_counter()
        knn(queries, x, k=k)
        torch_s = time.perf_counter() - start
        start = time.perf_counter()
        index.search(queries, k)
        faiss_s = time.perf_counter() - start
        rows.append({"queries": len(queries), "gallery": len(x), "k": k,
                     "torch_s": round(torch_s, 2), "faiss_s": round(faiss_s, 2)})
    return rows


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--n", type=int, default=60000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kinds", default="random,clustered")
    parser.add_argument("--retrieval-metrics", default="recall,map@r,r_precision",
                        help="comma-separated; 'recall' alone shows the cost of the MAP@R depth")
    parser.add_argument("--skip-clustering", action="store_true")
    parser.add_argument("--quick", action="store_true", help="alias for --skip-clustering")
    parser.add_argument("--knn-backends", action="store_true")
    parser.add_argument("--knn-queries", type=int, default=2048)
    parser.add_argument("--kind", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("knn-backends" if args.knn_backends else "metrics", args.save)
    args.skip_clustering = args.skip_clustering or args.quick

    if args.kind:
        print(json.dumps(run_case(args)))
        return
    if args.knn_backends:
        for row in run_knn_backends(args):
            print(json.dumps(row))
        return
    for kind in args.kinds.split(","):
        command = [sys.executable, __file__, "--kind", kind, "--n", str(args.n), "--dim", str(args.dim),
                   "--classes", str(args.classes), "--retrieval-metrics", args.retrieval_metrics]
        if args.block_size:
            command += ["--block-size", str(args.block_size)]
        if args.skip_clustering:
            command.append("--skip-clustering")
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        print(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
