"""A text query's latency on the CPU (tokenize + encode with text.onnx + search) beside an image query's (decode +
preprocess + embed with the image model + search), one query at a time in this process, on one index.

    python benchmarks/text_latency.py --index INDEX --text-model TEXT.onnx --image QUERY.png [--queries 200]
        [--threads 1] [--save MACHINE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

QUERIES = ["face smiling", "a red apple", "animal mammal", "grinning face with big eyes", "flag", "keycap seven",
           "a woman scientist with a microscope", "clock", "musical instrument", "hot beverage"]


def timed(call, count: int) -> np.ndarray:
    """Milliseconds of ``count`` calls, after 5 to warm up."""
    for _ in range(5):
        call(0)
    out = []
    for n in range(count):
        started = time.perf_counter()
        call(n)
        out.append((time.perf_counter() - started) * 1000)
    return np.asarray(out)


def shown(ms: float) -> str:
    """Milliseconds with the digits that matter (0.04, 8.6)."""
    return f"{ms:.2f}" if ms < 1 else f"{ms:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index", required=True, type=Path)
    parser.add_argument("--text-model", required=True, type=Path)
    parser.add_argument("--image", required=True, type=Path)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--save", metavar="MACHINE")
    args = parser.parse_args()
    from retrieval.index import Index
    from retrieval.text.text_onnx import TextEmbedder

    text = TextEmbedder(args.text_model, providers=["CPUExecutionProvider"])
    data = args.image.read_bytes()
    rows = []
    with Index.open(args.index) as index:
        from io import BytesIO

        from PIL import Image

        def image_query(_: int) -> None:
            index.search(index.embedder.embed([Image.open(BytesIO(data))]), args.k)

        def text_query(n: int) -> None:
            index.search(text.embed([QUERIES[n % len(QUERIES)]]), args.k)

        def tokenize(n: int) -> None:
            text.tokenizer([QUERIES[n % len(QUERIES)]])

        for name, call in (("image query (decode, preprocess, embed, search)", image_query),
                           ("text query (tokenize, encode, search)", text_query), ("tokenize alone", tokenize)):
            ms = timed(call, args.queries)
            rows.append([name, shown(np.median(ms)), shown(np.percentile(ms, 90)), f"{1000 / ms.mean():.0f}"])
        vectors = len(index)
    print("| query | p50 ms | p90 ms | queries/s |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if args.save:
        from results_io import write_result  # beside this file

        write_result("text-latency", args.save, "python " + " ".join(sys.argv),
                     ["query", "p50 ms", "p90 ms", "queries/s"], rows,
                     notes=f"{vectors} vectors, k={args.k}, one query at a time, onnxruntime's default threads")


if __name__ == "__main__":
    main()
