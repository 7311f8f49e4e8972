"""What keeping freed heap (``retrieval.utils.heap.kept_heap``) buys a CPU training or embedding loop: images/s, user
and kernel CPU time, minor page faults and peak memory, with the kept heap on and off, each run in a fresh process,
the two alternated so that both see the same machine.

    .venv/bin/python benchmarks/heap.py embed --repeats 3      # embed_samples: EfficientNet-Lite0, 128 px, batch 128
    .venv/bin/python benchmarks/heap.py train --repeats 3      # the demo recipe's step: batch 32, 128 px, AdamW
    .venv/bin/python benchmarks/heap.py demo --repeats 3 --out /tmp/heap-demo   # retrieval demo --no-serve, whole

"off" is glibc's own defaults, as without ``kept_heap`` (the benchmark makes ``kept_heap`` a no-op).
"passive" (``--cases off,kept,passive``) is "kept" with ``OMP_WAIT_POLICY=PASSIVE``: idle OpenMP threads sleep
instead of spinning. The ``tree_*`` columns are the CPU time of the whole child process, start-up and data workers
included; the other columns cover the measured part alone (``wall_s``) in the main process alone (faults, peak).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = "--child"


def _usage() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": usage.ru_utime, "sys_s": usage.ru_stime, "faults": usage.ru_minflt}


def _since(start: dict[str, float], wall: float) -> dict[str, float]:
    now = _usage()
    return {**{key: now[key] - start[key] for key in start}, "wall_s": time.perf_counter() - wall,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_embed(images: int) -> dict[str, float]:
    import torch
    from torch.utils.data import TensorDataset

    from retrieval.inference import embed_samples
    from retrieval.models import create_embedder

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=512, pretrained=False)
    data = TensorDataset(torch.randn(images, 3, 128, 128), torch.zeros(images, dtype=torch.long))
    embed_samples(model, torch.utils.data.Subset(data, range(128)), batch_size=128, workers=0, progress=False)
    start, wall = _usage(), time.perf_counter()
    embed_samples(model, data, batch_size=128, workers=0, progress=False)
    result = _since(start, wall)
    return {**result, "images_per_s": images / result["wall_s"]}


def run_train(steps: int) -> dict[str, float]:
    import torch

    from retrieval.models import create_embedder
    from retrieval.utils.heap import kept_heap

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=512, pretrained=False).train()
    optimizer = torch.optim.AdamW(model.parameters(), 1e-3)
    images = torch.randn(32, 3, 128, 128)

    def step() -> None:
        loss = model(images).pow(2).sum(1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    with kept_heap():  # as train() runs its steps
        step()
        start, wall = _usage(), time.perf_counter()
        for _ in range(steps):
            step()
        result = _since(start, wall)
    return {**result, "images_per_s": 32 * steps / result["wall_s"]}


def run_demo(out: Path) -> dict[str, float]:
    from retrieval.cli.demo import run_demo

    shutil.rmtree(out, ignore_errors=True)
    start, wall = _usage(), time.perf_counter()
    run_demo(out)  # what `retrieval demo --no-serve` runs
    measured = _since(start, wall)
    epochs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()
              if '"images_per_s"' in line]
    return {**measured, "epoch_s": statistics.mean(row["epoch_time_s"] for row in epochs),
            "train_images_per_s": statistics.mean(row["images_per_s"] for row in epochs)}


def child(args: argparse.Namespace) -> None:
    if args.off:
        import retrieval.utils.heap

        retrieval.utils.heap._MALLOPT = None  # kept_heap becomes a no-op: glibc's defaults throughout
    if args.what == "embed":
        result = run_embed(args.images)
    elif args.what == "train":
        result = run_train(args.steps)
    else:
        result = run_demo(Path(args.out))
    print(json.dumps(result))


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["embed", "train", "demo"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=1280, help="embed: images embedded")
    parser.add_argument("--steps", type=int, default=20, help="train: optimizer steps measured")
    parser.add_argument("--out", default="/tmp/heap-demo", help="demo: the demo's folder (emptied before each run)")
    parser.add_argument("--cases", default="off,kept", help="comma-separated, of: off, kept, passive")
    parser.add_argument("--off", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables(f"heap-{args.what}", args.save)
    if args.child:
        child(args)
        return
    cases = args.cases.split(",")
    if set(cases) - {"off", "kept", "passive"}:
        parser.error(f"--cases {args.cases}: choose among off, kept, passive")
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in cases}
    for repeat in range(args.repeats):
        for case in cases:
            command = [sys.executable, __file__, args.what, CHILD, "--images", str(args.images), "--steps",
                       str(args.steps), "--out", args.out] + (["--off"] if case == "off" else [])
            env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}  # OpenMP's default
            if case == "passive":
                env["OMP_WAIT_POLICY"] = "PASSIVE"
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child and every process it waited for
            runs[case].append({**json.loads(done.stdout.strip().splitlines()[-1]),
                               "tree_user_s": after.ru_utime - before.ru_utime,
                               "tree_sys_s": after.ru_stime - before.ru_stime})
            print(f"{args.what} {case} run {repeat + 1}: {runs[case][-1]}", file=sys.stderr, flush=True)
    keys = list(runs[cases[0]][0])
    print(f"| {args.what} | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for case, rows in runs.items():
        cells = [" / ".join(f"{row[key]:.4g}" for row in rows) for key in keys]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
