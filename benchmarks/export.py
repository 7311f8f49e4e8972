"""Images/s of PyTorch eager vs onnxruntime for an exported embedder, on this CPU.

    .venv/bin/python benchmarks/export.py [--backbones efficientnet_lite0 resnet18] [--batch-sizes 1 32]
                                          [--size 224] [--threads 2] [--rounds 5] [--seconds 1.0]

Each backbone (512-d head, L2 norm) is exported with ``export_embedder`` (verified on real images; the
export time, file size and verification numbers are printed), then timed: in every round each runtime
runs for about --seconds on the same input, the order alternating between rounds, so that both see the
same load from other processes. Reported: median images/s over rounds (min..max in brackets) and the
median of the per-round ratios onnxruntime / eager. Both runtimes use the same --threads. onnxruntime
variants: ``ort`` (ORT_ENABLE_ALL, the OnnxEmbedder default) and ``ort-basic`` (ORT_ENABLE_BASIC) to
show what the graph optimisations bring. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from retrieval.export.onnx_export import export_embedder
from retrieval.models import PretrainedWeightsMissing, create_embedder


def make_session(path: Path, threads: int, level: ort.GraphOptimizationLevel) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # No busy-waiting after a run: spinning threads would steal the cores eager PyTorch is timed on next.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def images_per_second(run: Callable[[], object], batch: int, seconds: float) -> float:
    run()  # warm (allocations, caches)
    count, start = 0, time.perf_counter()
    while True:
        run()
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count * batch / elapsed


def build_model(backbone: str, dim: int):
    try:
        return create_embedder(backbone, dim, pretrained=True).eval(), "ImageNet"
    except PretrainedWeightsMissing:
        return create_embedder(backbone, dim, pretrained=False).eval(), "random"


def bench_backbone(args: argparse.Namespace, backbone: str, folder: Path) -> list[dict]:
    model, weights = build_model(backbone, args.dim)
    model.config = model.config.with_fields({"input_size": args.size})
    path = folder / f"{backbone}.onnx"
    result = export_embedder(model, path, log=lambda line: print(f"  {line}", flush=True))
    print(f"| {backbone} | {weights} | {result.seconds:.1f} s | {result.file_bytes / 2**20:.1f} MiB | "
          f"{result.verification.describe()} |", flush=True)
    sessions = {
        "ort": make_session(path, args.threads, ort.GraphOptimizationLevel.ORT_ENABLE_ALL),
        "ort-basic": make_session(path, args.threads, ort.GraphOptimizationLevel.ORT_ENABLE_BASIC),
    }
    rows = []
    for batch in args.batch_sizes:
        x = torch.randn(batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))
        x_np = x.numpy()

        def eager(x=x):
            with torch.inference_mode():
                return model(x)

        runners = {"eager": eager}
        for name, session in sessions.items():
            runners[name] = lambda s=session, x_np=x_np: s.run(None, {"images": x_np})
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for round_index in range(args.rounds):
            order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
            for name in order:
                rates[name].append(images_per_second(runners[name], batch, args.seconds))
        eager_rates = np.array(rates["eager"])
        row = {"backbone": backbone, "batch": batch}
        for name, values in rates.items():
            row[name] = values
            if name != "eager":
                row[f"{name}/eager"] = float(np.median(np.array(values) / eager_rates))
        rows.append(row)
        print(f"  batch {batch}: " + ", ".join(f"{n} {statistics.median(v):.1f} img/s" for n, v in rates.items()),
              flush=True)
    return rows


def fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}..{max(values):.1f})"


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backbones", nargs="+", default=["efficientnet_lite0", "resnet18"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="time per runtime per round")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(["export-files", f"export-threads{args.threads}"], args.save)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, threads {args.threads}, "
          f"{args.size} px, {args.rounds} rounds x {args.seconds} s\n")
    print("| backbone | weights | export time | file size | verification (fp32) |\n|---|---|---|---|---|")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for backbone in args.backbones:
            rows += bench_backbone(args, backbone, Path(tmp))
    print("\n| backbone | batch | eager img/s | onnxruntime img/s | ort / eager | ort-basic img/s | "
          "ort-basic / eager |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['backbone']} | {r['batch']} | {fmt(r['eager'])} | {fmt(r['ort'])} | {r['ort/eager']:.2f}x | "
              f"{fmt(r['ort-basic'])} | {r['ort-basic/eager']:.2f}x |")


if __name__ == "__main__":
    main()
