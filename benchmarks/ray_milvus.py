"""Images to a served Milvus collection: the local build then `index push`, beside the Ray engine writing the
collection itself (`index build --engine ray --milvus`), and the Ray engine writing a folder, on the same gallery of
distinct random PNGs, against a Milvus Lite server on this machine (a local Ray cluster of ``--cpus`` CPUs).

The Ray runs are repeated (``--repeats``): the first pays the cluster's cold start.

    .venv/bin/python benchmarks/ray_milvus.py --n 20000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' model writer and Milvus Lite server


def write_gallery(folder: Path, n: int) -> None:
    """``n`` distinct 32x32 random PNGs in 10 class folders (no exact copies: every row is indexed)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(n):
        target = folder / str(i % 10)
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(target / f"{i:06d}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run

    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("ray-milvus", args.save)

    import ray
    from embedders import write_projection_onnx
    from milvus_server import milvus_lite_server

    from retrieval.index import IngestOptions, build_index
    from retrieval.index.embedding.engine import RayOptions
    from retrieval.index.milvus.milvus_collection import MilvusPlace
    from retrieval.index.milvus.milvus_push import push_index

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_gallery(root / "images", args.n)
        model = write_projection_onnx(root / "model.onnx")
        ray_options = IngestOptions(progress=False, engine="ray", ray=RayOptions())
        ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        out: dict[str, object] = {"images": args.n, "cpus": args.cpus}
        try:
            with milvus_lite_server(root / "lite") as uri:
                started = time.perf_counter()
                build_index(root / "images", root / "local", model=model, index_key="Flat",
                            options=IngestOptions(progress=False))
                built = time.perf_counter()
                push_index(root / "local", MilvusPlace.checked(uri, "pushed"), index_type="FLAT", progress=False)
                out |= {"local_build_s": round(built - started, 1), "push_s": round(time.perf_counter() - built, 1)}
                for run in range(args.repeats):
                    started = time.perf_counter()
                    build_index(root / "images", root / f"folder{run}", model=model, index_key="Flat",
                                options=ray_options)
                    folder = time.perf_counter()
                    build_index(root / "images", root / f"milvus{run}", model=model, options=ray_options,
                                milvus=MilvusPlace.checked(uri, f"direct{run}"), milvus_index_type="FLAT")
                    out |= {f"ray_folder_s_{run}": round(folder - started, 1),
                            f"ray_into_milvus_s_{run}": round(time.perf_counter() - folder, 1)}
        finally:
            ray.shutdown()
    rows = [("local build (folder, Flat)", [out["local_build_s"]]), ("then `index push`", [out["push_s"]]),
            ("`index build --engine ray` into a folder", [out[f"ray_folder_s_{r}"] for r in range(args.repeats)]),
            ("`index build --engine ray --milvus` into a collection",
             [out[f"ray_into_milvus_s_{r}"] for r in range(args.repeats)])]
    print(f"{args.n:,} images, {args.cpus} CPUs: seconds end to end (Ray runs in order: the first pays the cold start)")
    print()
    print("| path | seconds |")
    print("| --- | ---: |")
    for name, seconds in rows:
        print(f"| {name} | {', '.join(f'{s:.1f}' for s in seconds)} |")


if __name__ == "__main__":
    main()
