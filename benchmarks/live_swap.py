"""The pause a running server's searches see when a writer changes its index: 1,000,000 vectors in IVF-Flat.

    .venv/bin/python benchmarks/live_swap.py [--n 1000000] [--dim 128] [--key "IVF{K},Flat"] [--swaps 3]

One process serves the index through ``SearchService`` (as ``retrieval serve`` does: a watcher thread polls the
folder and swaps in the new state once a writer has finished; the new state is opened beside the old one, which
keeps answering, then one reference assignment switches). Two client threads search it back to back with random
embeddings (k = 10) and record when each search started and how long it took. Meanwhile a separate process (as
`retrieval index remove` is) removes 10 images at a time, ``--swaps`` times. Reported per swap: how long the
writer took, how long until the server answered from the new state, and the searches' latency during the swap
window against a baseline: while the writer works, and from its last write to the swap + 1 s (the server opening the
new state beside the old one): median, p99, max, and the longest gap between two answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from retrieval.data.preprocessing import ModelPreprocessing
from retrieval.index.layout import IndexLayout

sys.path.insert(0, str(Path(__file__).resolve().parent))


class VectorsOnly:
    """The embedder of a benchmark index of precomputed vectors: queries arrive as embeddings, never images."""

    preprocessing = ModelPreprocessing(input_size=32, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    model_hash = "bench"

    def __init__(self, dim: int) -> None:
        self.embedding_dim = dim
        self.metadata = {"model_hash": self.model_hash}

    def embed(self, batch: object) -> np.ndarray:
        raise RuntimeError("this benchmark searches with embeddings only")


def remove(index: str, ids: list[int]) -> None:
    """The writer, in a process of its own (as the CLI is)."""
    from retrieval.index import remove_images

    remove_images(index, ids=ids)


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--key", default="IVF{K},Flat")
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--index", help="an index folder made by an earlier run (skips building one)")
    parser.add_argument("--remove", help=argparse.SUPPRESS)  # internal: the writer process
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(["live-swap-writer", "live-swap-searches"], args.save)
    if args.remove:
        remove(args.index, json.loads(args.remove))
        return

    from index import write_vector_index

    from retrieval.serve.service import SearchService

    folder = Path(args.index) if args.index else Path(tempfile.mkdtemp(prefix="bench-swap-")) / "idx"
    if not args.index:
        started = time.perf_counter()
        write_vector_index(folder, args.n, args.dim, key=args.key, clusters=2000)
        print(f"(index of {args.n:,} x {args.dim} built in {time.perf_counter() - started:.0f} s: {folder})",
              file=sys.stderr)
    info = IndexLayout(folder).read_record()
    service = SearchService(folder, embedder=VectorsOnly(args.dim), reload_interval_s=0.2)
    records: list[tuple[float, float]] = []  # (start, seconds)
    stop = threading.Event()
    generations: list[tuple[float, int]] = []

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            query = rng.standard_normal(args.dim).astype(np.float32)
            start = time.perf_counter()
            service.search(query, 10)
            records.append((start, time.perf_counter() - start))

    def watch() -> None:
        last = len(service)
        while not stop.is_set():
            now = len(service)
            if now != last:
                generations.append((time.perf_counter(), now))
                last = now
            time.sleep(0.001)

    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in (1, 2)]
    threads.append(threading.Thread(target=watch, daemon=True))
    for thread in threads:
        thread.start()
    time.sleep(3)  # warm, and a baseline
    windows = []
    next_id = 1
    for _ in range(args.swaps):
        ids = list(range(next_id, next_id + 10))
        next_id += 10
        before = len(generations)
        start = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--index", str(folder), "--remove", json.dumps(ids)], check=True)
        # the writer's last step replaces index.json: from then on the server may swap
        written = start + ((folder / "index.json").stat().st_mtime - (time.time() - (time.perf_counter() - start)))
        while len(generations) == before and time.perf_counter() - written < 120:
            time.sleep(0.01)
        swapped = generations[-1][0] if len(generations) > before else float("nan")
        windows.append((start, written, swapped))
        time.sleep(3)
    stop.set()
    for thread in threads:
        thread.join(timeout=10)
    service.close()

    def stats(spans: list[tuple[float, float]]) -> dict[str, float]:
        """Latencies of the searches started within the spans, and the longest time without an answer in one."""
        lat, gap = [], 0.0
        for low, high in spans:
            rows = [r for r in records if low <= r[0] <= high]
            lat += [r[1] * 1e3 for r in rows]
            ends = sorted(s + d for s, d in rows)
            gap = max(gap, max((b - a for a, b in zip(ends, ends[1:], strict=False)), default=0.0) * 1e3)
        lat.sort()
        return {"searches": len(lat), "p50_ms": statistics.median(lat), "p99_ms": lat[int(0.99 * (len(lat) - 1))],
                "max_ms": lat[-1], "longest_gap_ms": gap}

    baseline = [(records[0][0] + 1.0, windows[0][0])]
    writing = [(start, written) for start, written, _ in windows]
    swaps = [(written, swapped + 1.0) for _, written, swapped in windows]
    print(f"n = {info.vectors.count:,} vectors, d = {args.dim}, {info.vectors.index_key}, 2 client threads, "
          f"writer: remove 10 images in its own process, {args.swaps} times\n")
    print("| swap | writer s | writer's index.json written -> new state served, s |")
    print("| --- | ---: | ---: |")
    for i, (start, written, swapped) in enumerate(windows, 1):
        print(f"| {i} | {written - start:.2f} | {swapped - written:.2f} |")
    print("\n| searches | count | p50 ms | p99 ms | max ms | longest gap between answers, ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, spans in (("before (baseline)", baseline), ("while the writer works (its own process)", writing),
                        ("the swap: index.json written -> new state served + 1 s", swaps)):
        s = stats(spans)
        print(f"| {name} | {s['searches']} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} | {s['max_ms']:.1f} | "
              f"{s['longest_gap_ms']:.1f} |")


if __name__ == "__main__":
    main()
