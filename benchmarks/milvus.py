"""Search on Milvus against the local faiss index, on the same vectors.

1. Push: ``push_index`` of a local index of N clustered unit vectors into a collection of each vector index type
   (rows/s, the whole push: reading the shards, converting, inserting, flushing, building the index).
2. Search: recall@10 against exact search and p50/p99 single-query latency through ``MilvusIndex.search_arrays``
   for each Milvus index type, beside the local faiss index of the same kind and memory (Flat, HNSW32, IVF-Flat,
   IVF-PQ with the same lists and codes).
3. Replicas: queries/s of one search client, then of two at once (two processes, one collection), each sending
   single queries back to back; against Milvus Lite's server here (``milvus-lite server``: one process for the
   engine) or a cluster given by ``--uri``.

    .venv/bin/python benchmarks/milvus.py --n 1000000 --dim 128
    .venv/bin/python benchmarks/milvus.py --n 100000 --dim 128 --types FLAT HNSW IVF_FLAT IVF_PQ
    .venv/bin/python benchmarks/milvus.py --uri http://milvus:19530 --n 1000000   # a cluster
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' writer of an embeddings folder


def clustered(n: int, dim: int, seed: int) -> np.ndarray:
    """``n`` unit vectors around 1,000 centres, as real embeddings cluster."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32)
    out = np.empty((n, dim), np.float32)
    for start in range(0, n, 100_000):
        stop = min(n, start + 100_000)
        x = centres[rng.integers(0, 1000, stop - start)] + 0.6 * rng.standard_normal((stop - start, dim))
        out[start:stop] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def local_index(kind: str, vectors: np.ndarray, nlist: int, m: int) -> object:
    """The local faiss index like Milvus' ``kind``: the same lists, graph degree and codes."""
    import faiss

    dim = vectors.shape[1]
    key = {"FLAT": "Flat", "AUTOINDEX": "HNSW32,Flat", "HNSW": "HNSW32,Flat", "IVF_FLAT": f"IVF{nlist},Flat",
           "IVF_PQ": f"IVF{nlist},PQ{m}x8"}[kind]
    index = faiss.index_factory(dim, key, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        index.train(vectors[np.random.default_rng(1).choice(len(vectors), min(len(vectors), 50 * nlist),
                                                            replace=False)])
    index.add(vectors)
    if "IVF" in key:
        faiss.extract_index_ivf(index).nprobe = 32  # as milvus_collection.search_params
    if "HNSW" in key:
        index.hnsw.efSearch = 64
    return index


def latencies(search, queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each query alone: its top 10 ids and the seconds it took."""
    ids, seconds = [], []
    for query in queries:
        started = time.perf_counter()
        ids.append(search(query[None]))
        seconds.append(time.perf_counter() - started)
    return np.concatenate(ids), np.asarray(seconds)


def recall_at_10(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f[:10]) & set(e[:10])) / 10 for f, e in zip(found, exact, strict=True)]))


def client_rate(uri: str, collection: str, queries: np.ndarray, seconds: float, ready, start) -> None:
    """One replica: single queries back to back for ``seconds``; prints queries/s."""
    from retrieval.index.milvus.milvus_collection import MilvusPlace
    from retrieval.index.milvus.milvus_index import MilvusIndex

    with MilvusIndex(MilvusPlace.checked(uri, collection)) as index:
        index.search_arrays(queries[:1], 10)
        ready.set()
        start.wait()
        done, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            index.search_arrays(queries[done % len(queries)][None], 10)
            done += 1
        print(done / (time.perf_counter() - began), flush=True)


def replicas(uri: str, collection: str, queries: np.ndarray, seconds: float, count: int) -> float:
    """Total queries/s of ``count`` search processes on one collection."""
    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(count)]
    start = context.Event()
    reader, writer = context.Pipe(duplex=False)
    processes = [context.Process(target=_rate_to_pipe, args=(uri, collection, queries, seconds, r, start, writer))
                 for r in ready]
    for process in processes:
        process.start()
    for event in ready:
        event.wait(120)
    start.set()
    total = sum(reader.recv() for _ in processes)
    for process in processes:
        process.join()
    return total


def _rate_to_pipe(uri, collection, queries, seconds, ready, start, pipe) -> None:
    import contextlib
    import io

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        client_rate(uri, collection, queries, seconds, ready, start)
    pipe.send(float(shown.getvalue().split()[-1]))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--types", nargs="+", default=["FLAT", "HNSW", "IVF_FLAT", "IVF_PQ"])
    parser.add_argument("--uri", default=None, help="a Milvus server (default: a Milvus Lite server started here)")
    parser.add_argument("--seconds", type=float, default=10.0, help="per replica measurement")
    parser.add_argument("--replicas-only", action="store_true", help="push --types' first type, measure replicas")
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run

    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(["milvus-replicas"] if args.replicas_only else ["milvus-search", "milvus-replicas"], args.save)

    import faiss
    from index_builds import write_embeddings_folder

    from retrieval.index import build_from_embeddings
    from retrieval.index.embedding.engine import IngestOptions
    from retrieval.index.milvus.milvus_collection import MilvusPlace, pq_subquantizers
    from retrieval.index.milvus.milvus_index import MilvusIndex
    from retrieval.index.milvus.milvus_push import push_index

    work = Path(tempfile.mkdtemp(prefix="milvus-bench-"))
    vectors = clustered(args.n + args.queries, args.dim, 0)
    gallery, queries = vectors[: args.n], vectors[args.n:]
    write_embeddings_folder(work / "in", [gallery])
    build_from_embeddings(work / "in", work / "idx", index_key="Flat", options=IngestOptions(progress=False))
    exact = faiss.IndexFlatIP(args.dim)
    exact.add(gallery)
    _, truth = exact.search(queries, 10)
    truth += 1  # the catalogue's ids start at 1
    nlist, m = int(min(65536, max(1, 4 * math.isqrt(args.n)))), pq_subquantizers(args.dim)

    server = None
    uri = args.uri
    if uri is None:
        port = free_port()
        server = subprocess.Popen([str(Path(sys.executable).with_name("milvus-lite")), "server", "--data-dir",
                                   str(work / "lite"), "--host", "127.0.0.1", "--port", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        uri = f"http://127.0.0.1:{port}"
        time.sleep(3)
    print(f"{args.n:,} vectors of {args.dim} dimensions, {args.queries} queries, {uri}"
          f"{' (Milvus Lite server, one process)' if server else ''}\n")
    first = args.types[0]
    if args.replicas_only:
        push_index(work / "idx", MilvusPlace.checked(uri, f"bench_{args.types[0].lower()}"), index_type=args.types[0],
                   progress=False)
        args.types = []
    else:
        print("| index type | push rows/s | Milvus recall@10 | Milvus p50 ms | Milvus p99 ms | faiss recall@10 | "
              "faiss p50 ms | faiss p99 ms |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        for kind in args.types:
            place = MilvusPlace.checked(uri, f"bench_{kind.lower()}")
            started = time.perf_counter()
            push_index(work / "idx", place, index_type=kind, progress=False)
            rate = args.n / (time.perf_counter() - started)
            with MilvusIndex(place) as index:
                index.search_arrays(queries[:1], 10)  # load
                found, seconds = latencies(lambda q, index=index: index.search_arrays(q, 10)[1], queries)
            local = local_index(kind, gallery, nlist, m)
            local_found, local_seconds = latencies(lambda q, local=local: local.search(q, 10)[1] + 1, queries)
            print(f"| {kind} | {rate:,.0f} | {recall_at_10(found, truth):.3f} | "
                  f"{1000 * np.median(seconds):.2f} | {1000 * np.quantile(seconds, 0.99):.2f} | "
                  f"{recall_at_10(local_found, truth):.3f} | {1000 * np.median(local_seconds):.2f} | "
                  f"{1000 * np.quantile(local_seconds, 0.99):.2f} |", flush=True)
        collection = f"bench_{(args.types or [first])[0].lower()}"
        one = replicas(uri, collection, queries, args.seconds, 1)
        two = replicas(uri, collection, queries, args.seconds, 2)
        print(f"\n| search replicas on `{collection}` | queries/s |\n|---|---:|\n| 1 | {one:,.0f} |\n| 2 | {two:,.0f} "
              f"|\n| ratio 2 / 1 | {two / one:.2f} |")
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
