"""Tight memory budgets against autofaiss: the same vectors, the same memory budget and time per query.

Unit vectors in Gaussian clusters (500,000 x 128 around 2,000 centres by default) are written once in the layout
``retrieval index export --format npy`` writes and autofaiss reads (``DIR/embeddings/part-*.npy``), with held-out
queries and their exact top 10. Each side builds from that folder under each budget and is measured the same way,
in its own process with 2 faiss threads: 10-recall@10 of the 1,000 queries against the exact top 10, the median
time of one query alone, the build's wall time and the size of the index file.

    .venv/bin/python benchmarks/index_budgets.py data --out /tmp/budgets
    .venv/bin/python benchmarks/index_budgets.py ours --data /tmp/budgets --budget 40M --max-query-ms 10
    PEER/bin/python benchmarks/index_budgets.py peer --data /tmp/budgets --budget 40M --max-query-ms 10
    .venv/bin/python benchmarks/index_budgets.py table --data /tmp/budgets --peer-python PEER/bin/python \\
        --budgets 20M,30M,40M,60M,100M --max-query-ms 10

PEER is a separate virtual environment with autofaiss 2.18 (faiss-cpu 1.8.0, the last faiss it runs with; it also
needs pyarrow < 18 and packaging there); this file imports only numpy and faiss at the top so that both run it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np

THREADS = 2


def write_data(args: argparse.Namespace) -> dict:
    """Clustered unit vectors in parts, held-out queries from the same clusters and their exact top 10."""
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    centres = rng.standard_normal((args.clusters, args.d)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)

    def sample(count: int) -> np.ndarray:
        noise = rng.standard_normal((count, args.d)).astype(np.float32) * (args.spread / np.sqrt(args.d))
        x = centres[rng.integers(0, args.clusters, count)] + noise
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    (out / "embeddings").mkdir(parents=True, exist_ok=True)
    parts, per_part = [], -(-args.n // args.parts)
    for number, start in enumerate(range(0, args.n, per_part)):
        part = sample(min(per_part, args.n - start))
        np.save(out / "embeddings" / f"part-{number:05d}.npy", part)
        parts.append(part)
    queries = sample(args.queries)
    _, exact = faiss.knn(queries, np.concatenate(parts), 10, metric=faiss.METRIC_INNER_PRODUCT)
    np.save(out / "queries.npy", queries)
    np.save(out / "exact_top10.npy", exact.astype(np.int64))
    facts = {"n": args.n, "d": args.d, "clusters": args.clusters, "spread": args.spread, "seed": args.seed,
             "queries": args.queries}
    (out / "data.json").write_text(json.dumps(facts))
    return facts


def measure(index: faiss.Index, rows_of, data: Path) -> dict:
    """10-recall@10 against the exact top 10 and the median time of one query alone (``THREADS`` faiss threads);
    ``rows_of(ids)`` maps the index's ids to row numbers of the embeddings."""
    faiss.omp_set_num_threads(THREADS)
    queries, exact = np.load(data / "queries.npy"), np.load(data / "exact_top10.npy")
    _, found = index.search(queries, 10)
    found = rows_of(found)
    recall = float(np.mean([len(np.intersect1d(f, e)) / 10 for f, e in zip(found, exact, strict=True)]))
    times = []
    for query in queries:
        started = time.perf_counter()
        index.search(query[None], 10)
        times.append(time.perf_counter() - started)
    return {"recall_10_at_10": round(recall, 4), "p50_ms": round(float(np.median(times)) * 1e3, 3)}


def run_ours(args: argparse.Namespace) -> dict:
    """``retrieval index build --embeddings`` as a user runs it, then the index it wrote, searched as it is saved."""
    from retrieval.index.faiss_backend import faiss_files, faiss_params
    from retrieval.index.layout import IndexLayout

    data, work = Path(args.data), Path(args.work) / f"ours-{args.budget}"
    shutil.rmtree(work, ignore_errors=True)
    command = [sys.executable, "-m", "retrieval.cli.main", "index", "build", "--embeddings", str(data),
               "--out", str(work), "--max-index-memory", args.budget, "--json"]
    if args.max_query_ms:
        command += ["--max-query-ms", str(args.max_query_ms)]
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS))
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        return {"side": "ours", "budget": args.budget, "error": (result.stdout + result.stderr)[-2000:]}
    info = IndexLayout(work).read_record()
    index = faiss_files.read_index(work / "index.faiss")
    faiss_params.set_search_params(index, info.vectors.params if info.holds("params") else {})
    measured = measure(index, lambda ids: np.where(ids >= 1, ids - 1, -1), data)  # ids: rows from 1
    return {"side": "ours", "budget": args.budget, "key": info.vectors.index_key, "params": info.vectors.params,
            "build_s": round(seconds, 1), "file_mib": round((work / "index.faiss").stat().st_size / 2**20, 1),
            "estimated_mib": round((info.vectors.budget or {}).get("estimated_bytes", 0) / 2**20, 1),
            "tuned_recall": (info.vectors.tuning or {}).get("recall_10_at_10"), **measured}


def run_peer(args: argparse.Namespace) -> dict:
    """autofaiss' ``build_index`` on the same folder and budgets; its index searched with the settings it chose."""
    from autofaiss import build_index

    data, work = Path(args.data), Path(args.work) / f"autofaiss-{args.budget}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.perf_counter()
    index, infos = build_index(
        embeddings=str(data / "embeddings"), index_path=str(work / "knn.index"),
        index_infos_path=str(work / "infos.json"), metric_type="ip",
        max_index_memory_usage=args.budget.replace("M", "MB").replace("G", "GB") if args.budget[-1] in "MG"
        else args.budget, current_memory_available="16GB",
        max_index_query_time_ms=args.max_query_ms or 10.0, nb_cores=THREADS, verbose=40,
    )
    seconds = time.perf_counter() - started
    if index is None:
        return {"side": "autofaiss", "budget": args.budget, "error": f"no index: {infos}"}
    measured = measure(index, lambda ids: ids, data)  # autofaiss numbers the rows from 0
    return {"side": "autofaiss", "budget": args.budget, "key": infos.get("index_key"),
            "params": infos.get("index_param"), "build_s": round(seconds, 1),
            "file_mib": round((work / "knn.index").stat().st_size / 2**20, 1), **measured}


def table(args: argparse.Namespace) -> list[dict]:
    """Both sides at every budget, each run in its own process; a markdown table on stdout, rows as JSON lines."""
    rows = []
    for budget in args.budgets.split(","):
        for python, side in ((sys.executable, "ours"), (args.peer_python, "peer")):
            command = [python, __file__, side, "--data", args.data, "--work", args.work, "--budget", budget]
            if args.max_query_ms:
                command += ["--max-query-ms", str(args.max_query_ms)]
            result = subprocess.run(command, capture_output=True, text=True)
            lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
            row = json.loads(lines[-1]) if lines else {"side": side, "budget": budget,
                                                      "error": result.stderr[-2000:]}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    print("| budget | tool | index | search setting | 10-recall@10 | ms / query (p50) | build s | file MiB |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for row in rows:
        if "error" in row:
            print(f"| {row['budget']} | {row['side']} | (failed: see the JSON line) | | | | | |")
            continue
        params = row.get("params")
        setting = ", ".join(f"{k}={v}" for k, v in params.items()) if isinstance(params, dict) else params or ""
        print(f"| {row['budget']} | {row['side']} | `{row['key']}` | {setting} | {row['recall_10_at_10']:.3f} | "
              f"{row['p50_ms']:.2f} | {row['build_s']:.0f} | {row['file_mib']:.1f} |")
    return rows


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    data = commands.add_parser("data")
    data.add_argument("--out", required=True)
    data.add_argument("--n", type=int, default=500_000)
    data.add_argument("--d", type=int, default=128)
    data.add_argument("--clusters", type=int, default=2_000)
    data.add_argument("--spread", type=float, default=0.5, help="noise norm around a unit centre")
    data.add_argument("--parts", type=int, default=5)
    data.add_argument("--queries", type=int, default=1_000)
    data.add_argument("--seed", type=int, default=0)
    for name in ("ours", "peer", "table"):
        sub = commands.add_parser(name)
        sub.add_argument("--data", required=True)
        sub.add_argument("--work", default="/tmp/index-budgets-work")
        sub.add_argument("--max-query-ms", type=float, default=10.0)
        if name == "table":
            sub.add_argument("--budgets", default="20M,30M,40M,60M,100M")
            sub.add_argument("--peer-python", required=True)
        else:
            sub.add_argument("--budget", required=True, help="e.g. 40M (binary units on both sides)")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("index-budgets", args.save)
    run = {"data": write_data, "ours": run_ours, "peer": run_peer, "table": table}[args.command]
    result = run(args)
    if args.command != "table":
        print(json.dumps(result))


if __name__ == "__main__":
    main()
