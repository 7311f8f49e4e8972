"""Filtered search on 1,000,000 precomputed vectors: latency and recall@10 against the exact filtered top-10, at 10 %
and 1 % selectivity, for faiss' IDSelector with the probing widened by the selection's share (what `where` does),
the same selector without widening, and post-filtering with over-fetch; Flat (exact) beside IVF.

    .venv/bin/python benchmarks/filters.py [--n 1000000] [--dim 128] [--queries 200] [--nprobe 16] [--threads 2]

The vectors are a mixture of 2,000 Gaussian clusters on the unit sphere (a gallery of many classes: IVF's lists
mean something, as on real embeddings). Two kinds of selection: random rows (a `split` or a price range, unrelated
to the picture) and whole clusters (a `label`, which follows the picture). Queries are drawn near cluster centres.
Each query is searched alone (as the server does), one thread per faiss call unless --threads; median ms.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import faiss
import numpy as np

from retrieval.index.faiss_backend import faiss_params, faiss_search


def near(centres: np.ndarray, n: int, rng: np.random.Generator, spread: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """``n`` unit vectors, each a random centre plus noise of norm about ``spread``; and their centres."""
    owner = rng.integers(0, len(centres), n)
    noise = rng.standard_normal((n, centres.shape[1])).astype(np.float32) * (spread / np.sqrt(centres.shape[1]))
    vectors = centres[owner] + noise
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors.astype(np.float32), owner


def exact_filtered(vectors: np.ndarray, queries: np.ndarray, selected: np.ndarray, k: int) -> np.ndarray:
    sub = vectors[selected]
    out = np.empty((len(queries), k), np.int64)
    for start in range(0, len(queries), 50):
        scores = queries[start:start + 50] @ sub.T
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        order = np.take_along_axis(scores, top, 1).argsort(axis=1)[:, ::-1]
        out[start:start + 50] = selected[np.take_along_axis(top, order, 1)]
    return out


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(f) & set(e)) / len(e) for f, e in zip(found, exact, strict=True)]))


def timed(search, queries: np.ndarray) -> tuple[np.ndarray, float]:
    """Each query alone; (ids [q, k], median ms)."""
    found, times = [], []
    for query in queries:
        start = time.perf_counter()
        _, ids = search(query[None])
        times.append((time.perf_counter() - start) * 1e3)
        found.append(ids[0])
    return np.stack(found), statistics.median(times)


def filter_cost(n: int, rng: np.random.Generator) -> None:
    """The cost of the `where` itself on n rows: building the columns (once per index state) and one evaluation."""
    import json

    from retrieval.index.filters import FilterTable, parse_filter

    labels = [f"class{i}" for i in rng.integers(0, 2000, n)]
    extra = {i: json.dumps({"split": "test" if i % 3 else "train", "price": float(i % 50)}) for i in range(n)}
    start = time.perf_counter()
    table = FilterTable(list(range(n)), [f"{i}.png" for i in range(n)], labels, extra)
    built = time.perf_counter() - start
    where = parse_filter('label in ("class1", "class7", "class99") or (split = "test" and price < 5)')
    table.matching(where)  # the columns are made on first use
    first = time.perf_counter() - start - built
    times = []
    for _ in range(5):
        start = time.perf_counter()
        matched = table.matching(where)
        times.append((time.perf_counter() - start) * 1e3)
    print(f"\n`where` on {n:,} rows: table from the catalogue's lists {built:.1f} s, columns made on first use "
          f"{first:.1f} s, then one evaluation {statistics.median(times):.1f} ms ({len(matched):,} rows match)")


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--nprobe", type=int, default=16)
    parser.add_argument("--lists", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("-k", type=int, default=10)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("filters", args.save)
    faiss.omp_set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    clusters = 2000
    centres = rng.standard_normal((clusters, args.dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    vectors, owner = near(centres, args.n, rng)
    ids = np.arange(args.n, dtype=np.int64)
    queries, _ = near(centres, args.queries, np.random.default_rng(1))
    print(f"n = {args.n:,}, d = {args.dim}, {args.queries} queries one at a time, k = {args.k}, "
          f"{args.threads} faiss threads, IVF{args.lists},Flat at nprobe {args.nprobe}\n")

    indexes = {}
    flat = faiss.index_factory(args.dim, "IDMap2,Flat", faiss.METRIC_INNER_PRODUCT)
    flat.add_with_ids(vectors, ids)
    indexes["Flat"] = flat
    start = time.perf_counter()
    ivf = faiss.index_factory(args.dim, f"IDMap2,IVF{args.lists},Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors[rng.choice(args.n, min(args.n, 200_000), replace=False)])
    ivf.add_with_ids(vectors, ids)
    faiss_params.set_search_params(ivf, {"nprobe": args.nprobe})
    indexes[f"IVF{args.lists},Flat"] = ivf
    print(f"(IVF built in {time.perf_counter() - start:.0f} s)\n")

    exact_all = exact_filtered(vectors, queries, ids, args.k)
    found, unfiltered_ms = timed(lambda q: ivf.search(q, args.k), queries)
    print(f"Unfiltered IVF: recall@{args.k} {recall(found, exact_all):.3f}, {unfiltered_ms:.2f} ms; "
          f"Flat {timed(lambda q: flat.search(q, args.k), queries[:50])[1]:.2f} ms\n")

    selections = {
        "random 10 %": np.sort(rng.choice(args.n, args.n // 10, replace=False)),
        "random 1 %": np.sort(rng.choice(args.n, args.n // 100, replace=False)),
        "10 % of the clusters": ids[owner < clusters // 10],
        "1 % of the clusters": ids[owner < clusters // 100],
    }
    print(f"| selection | index | method | recall@{args.k} | median ms |")
    print("| --- | --- | --- | ---: | ---: |")
    for name, selected in selections.items():
        selected = np.ascontiguousarray(selected, dtype=np.int64)
        fraction = len(selected) / args.n
        exact = exact_filtered(vectors, queries, selected, args.k)
        selector = faiss.IDSelectorBatch(len(selected), faiss.swig_ptr(selected))
        for key, index in indexes.items():
            methods = {"IDSelector, probing x 2/share (ours)": faiss_search.filtered_search_params(index, selector,
                                                                                             fraction)}
            if key != "Flat":
                methods["IDSelector, nprobe unchanged"] = faiss.SearchParametersIVF(sel=selector, nprobe=args.nprobe)
                for factor in (1, 4):
                    probes = int(min(args.lists, np.ceil(args.nprobe * factor / fraction)))
                    methods[f"IDSelector, nprobe x {factor}/share = {probes}"] = faiss.SearchParametersIVF(
                        sel=selector, nprobe=probes)
                methods["IDSelector, every list"] = faiss.SearchParametersIVF(sel=selector, nprobe=args.lists)
            for method, params in methods.items():
                found, ms = timed(lambda q, params=params, index=index: index.search(q, args.k, params=params),
                                  queries)
                print(f"| {name} | {key} | {method} | {recall(found, exact):.3f} | {ms:.2f} |")
            found, ms = timed(lambda q, index=index, selected=selected: faiss_search.post_filtered_search(
                index, q, args.k, selected), queries)
            print(f"| {name} | {key} | post-filter, over-fetch 2k/share + k | {recall(found, exact):.3f} | {ms:.2f} |")
    filter_cost(args.n, rng)


if __name__ == "__main__":
    main()
