"""Keyword search on Milvus (BM25 full-text search, ``retrieval.index.milvus.milvus_keywords``) against the folder's
SQLite FTS5 keyword index (``retrieval.text.keywords``), on the same catalogue.

A shop-like catalogue of N product titles (a brand, colours, materials, a product noun, a few extra words; words
Zipf-distributed, as a shop's vocabulary is) is built into a folder index from random embeddings, its titles kept
as keywords (``index text --text-columns title``) and pushed into a Milvus Lite collection. Then per query (1 to 3
words, a share of them words no title holds): the latency of one keyword search of ``--limit`` hits on each side
(the whole ``KeywordSearch.search``: stemming, the search, the hits' matched share), and how far the two agree:
one-word queries in the same order (ties aside), the top 10 of longer ones (Milvus' IDF differs: docs/INDEX.md,
"Keywords on Milvus"). Also the push's seconds with keywords and without. Three seeds (catalogue and queries).

    .venv/bin/python benchmarks/milvus_keywords.py --rows 10000 --queries 300 --save cpu-2core
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
BRANDS = [f"brand{n}" for n in range(40)]
COLOURS = "red blue green black white grey navy beige pink yellow orange purple brown silver gold".split()
MATERIALS = "cotton wool leather steel oak bamboo linen denim ceramic glass plastic canvas suede silk".split()
NOUNS = ("shirt jacket hammer mug kettle teapot lamp desk chair sofa rug blanket pillow sneaker boot sandal hat "
         "scarf glove backpack wallet belt watch bottle pan knife spoon bowl plate vase frame mirror clock candle "
         "towel apron tent jeans skirt dress sweater hoodie socks").split()
EXTRA = ("classic slim large small vintage modern outdoor kids women men waterproof organic handmade travel "
         "portable heavy light soft warm premium set pack of two with for and the").split()
ABSENT = "unicorn spaceship zeppelin trombone".split()


def zipf_choice(rng: np.random.Generator, words: list[str], size: int) -> list[str]:
    weights = 1.0 / np.arange(1, len(words) + 1)
    return list(rng.choice(words, size, p=weights / weights.sum()))


def catalogue(rows: int, rng: np.random.Generator) -> list[str]:
    """``rows`` product titles, 3 to 9 words each."""
    titles = []
    for _ in range(rows):
        words = [rng.choice(BRANDS), *zipf_choice(rng, COLOURS, rng.integers(0, 3)),
                 *zipf_choice(rng, MATERIALS, rng.integers(0, 2)), *zipf_choice(rng, NOUNS, 1),
                 *zipf_choice(rng, EXTRA, rng.integers(0, 5))]
        titles.append(" ".join(words).title() if rng.random() < 0.3 else " ".join(words))
    return titles


def queries(count: int, rng: np.random.Generator) -> list[str]:
    """Customer-like queries: 1 to 3 words of the vocabulary (plurals too), one in ten with a word no title has."""
    made = []
    for _ in range(count):
        words = zipf_choice(rng, COLOURS + MATERIALS + NOUNS + NOUNS + BRANDS[:10], rng.integers(1, 4))
        words = [w + "s" if rng.random() < 0.2 else w for w in words]
        if rng.random() < 0.1:
            words.append(rng.choice(ABSENT))
        made.append(" ".join(words))
    return made


def build(root: Path, titles: list[str], seed: int) -> Path:
    """A folder index of random unit vectors with ``titles`` as its keywords."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from retrieval.index import build_from_embeddings
    from retrieval.index.embedding.engine import IngestOptions
    from retrieval.index.writing.keyword_build import record_keywords

    vectors = np.random.default_rng(seed).standard_normal((len(titles), 64)).astype(np.float32)
    (root / "in" / "embeddings").mkdir(parents=True)
    (root / "in" / "metadata").mkdir()
    np.save(root / "in" / "embeddings" / "part-00000.npy", vectors)
    pq.write_table(pa.table({"path": [f"p/{i}.jpg" for i in range(len(titles))], "title": titles}),
                   root / "in" / "metadata" / "part-00000.parquet")
    build_from_embeddings(root / "in", root / "idx", index_key="Flat", options=IngestOptions(progress=False))
    record_keywords(root / "idx", "title")
    return root / "idx"


def latencies(search, texts: list[str], limit: int) -> tuple[np.ndarray, list]:
    """Milliseconds of each search (after two warm-up queries), and the hits."""
    for text in texts[:2]:
        search(text, limit)
    times, hits = [], []
    for text in texts:
        started = time.perf_counter()
        hits.append(search(text, limit))
        times.append((time.perf_counter() - started) * 1000)
    return np.asarray(times), hits


def tied(hits) -> list[set[int]]:
    groups: list[tuple[float, set[int]]] = []
    for i, s in zip(hits.ids.tolist(), hits.scores.tolist(), strict=True):
        if groups and abs(groups[-1][0] - s) <= 1e-5 * abs(s):
            groups[-1][1].add(i)
        else:
            groups.append((s, {i}))
    return [g for _, g in groups]


def same_ranks(a, b) -> bool:
    """The same groups of tied hits in the same order; the last group may be cut by the limit at other rows."""
    ga, gb = tied(a), tied(b)
    return ga[:-1] == gb[:-1] and [len(g) for g in ga[-1:]] == [len(g) for g in gb[-1:]]


def run_seed(seed: int, rows: int, count: int, limit: int) -> list[list]:
    from retrieval.index.milvus.milvus_collection import MilvusPlace
    from retrieval.index.milvus.milvus_index import MilvusIndex
    from retrieval.index.milvus.milvus_push import push_index
    from retrieval.records.index_info import IndexInfo
    from retrieval.text.keywords import FolderKeywords, query_terms

    rng = np.random.default_rng(seed)
    titles, texts = catalogue(rows, rng), queries(count, rng)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        index_dir = build(root, titles, seed)
        place = MilvusPlace.checked(str(root / "milvus.db"), "shop")
        started = time.perf_counter()
        push_index(index_dir, place, index_type="FLAT", progress=False)
        push_s = time.perf_counter() - started
        info_path = index_dir / "index.json"  # the same index pushed without keywords, for the push's cost
        import json

        info = IndexInfo.from_json(json.loads(info_path.read_text()))
        info_path.write_text(json.dumps(info.without("text_columns", "keyword_index").to_json()))
        started = time.perf_counter()
        push_index(index_dir, MilvusPlace.checked(str(root / "plain.db"), "shop"), index_type="FLAT",
                   progress=False)
        plain_s = time.perf_counter() - started
        info_path.write_text(json.dumps(info.to_json()))
        folder_keywords = FolderKeywords.of_index(info, index_dir)
        with MilvusIndex(place) as remote:
            fts5_ms, fts5_hits = latencies(folder_keywords.search, texts, limit)
            milvus_ms, milvus_hits = latencies(remote.keywords.search, texts, limit)
    one = [n for n, text in enumerate(texts) if len(query_terms(text)) == 1]
    same_order = np.mean([same_ranks(milvus_hits[n], fts5_hits[n]) for n in one]) if one else float("nan")
    many = [n for n, text in enumerate(texts) if len(query_terms(text)) > 1]
    top10 = np.mean([len(set(milvus_hits[n].ids[:10].tolist()) & set(fts5_hits[n].ids[:10].tolist()))
                     / max(1, min(10, len(fts5_hits[n].ids))) for n in many])
    found = np.mean([sorted(m.ids.tolist()) == sorted(f.ids.tolist()) for m, f in zip(milvus_hits, fts5_hits,
                                                                                      strict=True)
                     if len(f.ids) < limit])
    rows_out = []
    for name, ms in (("FTS5 (folder)", fts5_ms), ("Milvus Lite BM25", milvus_ms)):
        rows_out.append([seed, name, f"{np.percentile(ms, 50):.2f}", f"{np.percentile(ms, 99):.2f}",
                         f"{np.mean([len(h.ids) for h in (fts5_hits if 'FTS5' in name else milvus_hits)]):.1f}",
                         f"{push_s:.1f} / {plain_s:.1f}" if "Milvus" in name else "",
                         f"{same_order:.3f}" if "Milvus" in name else "", f"{top10:.3f}" if "Milvus" in name else "",
                         f"{found:.3f}" if "Milvus" in name else ""])
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--limit", type=int, default=50, help="hits per query (a top-10 text query's pool: 50)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--save", metavar="MACHINE", help="write benchmarks/results/milvus_keywords-MACHINE.json")
    args = parser.parse_args()
    columns = ["seed", "keywords", "p50 ms", "p99 ms", "hits/query", "push s (with / without keywords)",
               "1-word queries in FTS5's order", "top-10 overlap, 2-3 words", "same hits (under the limit)"]
    rows = [row for seed in args.seeds for row in run_seed(seed, args.rows, args.queries, args.limit)]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")
    if args.save:
        from results_io import write_result

        command = "benchmarks/milvus_keywords.py " + shlex.join(sys.argv[1:])
        path = write_result("milvus_keywords", args.save, command, columns, rows,
                            notes=f"{args.rows} titles, {args.queries} queries, limit {args.limit}; Milvus Lite "
                                  "(in this process) against SQLite FTS5; latency of one whole KeywordSearch.search")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
