"""Where a training step's time goes, end to end: ``retrieval.train.train`` on a JPEG folder under torch.profiler.

    python benchmarks/train_profile.py [--device cuda] [--decode-on device] [--size 224] [--batch 128] [--compile]

Trains two epochs (the folder of ``gpu_input.py``: photo-sized JPEGs, written if missing) and profiles ``--steps``
optimizer steps of the second epoch (after ``--warmup`` of its steps), then prints, for that window:
- wall time per step, and the share of it the trainer spent waiting for its batches (its own ``data_wait_s``);
- the device's busy share: the union of its kernels', copies' and fills' intervals over the profiled steps' span,
  and their time per stream (CUDA only, from the Chrome trace), what idles the GPU;
- the host's waits on the device: the calls that block until it finishes (``cudaStreamSynchronize``), and the
  reads of a value or a shape into Python (``aten::_local_scalar_dense``, ``aten::nonzero``), how many a step and
  their time;
- the ops with the most host time and (CUDA) the most device time.
Writes the Chrome trace (``--trace``, open it in https://ui.perfetto.dev) for the rest. On a CPU it runs too (small
sizes), without the device lines.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_input import write_folder  # noqa: E402  (the same JPEG folder as the input benchmark)

# host calls that wait for the GPU (the CUDA ones), and the reads of a value or a shape into Python (a wait when the
# tensor is on the GPU; on the CPU, or for the optimizer's step counts, none)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
         "aten::nonzero")


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace's categories of work on the device
MIN_STREAM_US = 10  # streams busy less than this a step are left out of the list (nvJPEG opens one per host thread)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals (microseconds)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def device_activity(trace: dict) -> tuple[float, dict[str, float], float]:
    """(device busy us, busy us per stream, profiled steps' span us) from a torch.profiler Chrome trace."""
    events = [event for event in trace["traceEvents"] if event.get("ph") == "X"]
    steps = [event for event in events if event.get("cat") == "user_annotation"
             and event["name"].startswith("ProfilerStep#")]
    if not steps:
        return float("nan"), {}, float("nan")
    first, last = min(step["ts"] for step in steps), max(step["ts"] + step["dur"] for step in steps)
    # the device's own step annotations span whole steps: only kernels, copies and fills are work
    work = [(max(event["ts"], first), min(event["ts"] + event["dur"], last), str(event["args"].get("stream", "?")))
            for event in events if event.get("cat") in DEVICE_WORK]
    work = [(start, end, stream) for start, end, stream in work if end > start]
    streams: dict[str, float] = {}
    for start, end, stream in work:
        streams[stream] = streams.get(stream, 0.0) + end - start
    return union_us([(start, end) for start, end, _ in work]), streams, last - first


def profiled_train(args: argparse.Namespace, root: Path, out: Path) -> tuple[profile, dict, float, int]:
    """(profiler, report, wall seconds of the profiled window, steps in it)."""
    from retrieval.train import TrainConfig, train
    from retrieval.train.trainer import Trainer

    cfg = TrainConfig(dataset="folder", data=str(root), backbone=args.backbone, pretrained=False,
                      image_size=args.size, embedding_dim=512, loss="ms", batch_size=args.batch, per_class=4,
                      batches_per_epoch=args.batches, epochs=2, device=args.device,
                      amp="bf16" if args.device == "cuda" else False, channels_last=args.device == "cuda",
                      compile=args.compile, workers=args.workers, decode_on=args.decode_on, eval_before=False,
                      eval_limit=64, plots=False, out=str(out))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    # one profiler step per optimizer step: the first epoch and the second's first --warmup steps are skipped
    prof = profile(activities=activities, schedule=schedule(wait=args.batches + args.warmup - 1, warmup=1,
                                                             active=args.steps, repeat=1))
    window: list[float] = []
    original = Trainer._train_step

    def train_step(self, *args, **kwargs):
        taken = original(self, *args, **kwargs)
        if taken is not None:  # an optimizer step
            # read before prof.step(): the step that ends the window stops the profiler, which takes a second or more
            window.append(time.perf_counter())
            prof.step()
        return taken

    Trainer._train_step = train_step
    try:
        with prof:
            report = train(cfg, progress=False)
    finally:
        Trainer._train_step = original
    first = args.batches + args.warmup - 1  # the step whose end opens the active window
    return prof, report, window[first + args.steps] - window[first], args.steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--decode-on", default="workers", choices=("workers", "device"))
    parser.add_argument("--images", type=int, default=4_000)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=60, help="batches per epoch")
    parser.add_argument("--warmup", type=int, default=10, help="steps of the second epoch before the window")
    parser.add_argument("--steps", type=int, default=20, help="steps profiled")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--backbone", default="efficientnet_lite0")
    parser.add_argument("--folder", type=Path, default=None, help="the JPEG folder: written there if missing")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write the Chrome trace here (gzipped when it ends in .gz)")
    args = parser.parse_args()
    if args.warmup + args.steps >= args.batches:
        parser.error("--warmup + --steps must be fewer than --batches (the window lies inside the second epoch)")
    scratch = Path(tempfile.mkdtemp(prefix="train-profile-"))
    root = args.folder or scratch / "jpegs"
    if not root.exists():
        write_folder(root, args.images, 40)
    prof, report, wall, steps = profiled_train(args, root, scratch / "run")
    epoch = [row for row in report["history"] if "images_per_s" in row][-1]
    events = prof.events()
    print(f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'}), torch "
          f"{torch.__version__}, {args.backbone}, {args.size} px, batch {args.batch}, --decode-on {args.decode_on}, "
          f"{args.workers} workers{', --compile' if args.compile else ''}; {steps} steps profiled\n")
    print(f"- wall per step: {wall / steps * 1e3:.1f} ms ({args.batch * steps / wall:,.0f} images/s in the window); "
          f"the second epoch: {epoch['images_per_s']:,.0f} images/s, "
          f"{epoch['data_wait_s'] / epoch['epoch_time_s']:.0%} of it waiting for batches")
    if args.device == "cuda" or args.trace:
        trace_path = args.trace or scratch / "trace.json"
        prof.export_chrome_trace(str(trace_path))
    if args.device == "cuda":
        opener = gzip.open if trace_path.suffix == ".gz" else open
        with opener(trace_path, "rt") as file:
            busy, streams, span = device_activity(json.load(file))
        print(f"- GPU busy: {busy / span:.0%} of the profiled steps ({busy / steps / 1e3:.1f} ms of kernels and "
              f"copies a step in {span / steps / 1e3:.1f} ms); by stream, ms a step: "
              + ", ".join(f"{stream} {total / steps / 1e3:.2f}" for stream, total
                          in sorted(streams.items(), key=lambda item: -item[1]) if total / steps >= MIN_STREAM_US))
    for name in WAITS:
        calls = [e for e in events if e.name == name]
        if calls:
            total = sum(e.cpu_time_total for e in calls) / 1e3
            print(f"- {name}: {len(calls) / steps:.1f} a step, {total / steps:.2f} ms a step")
    averages = prof.key_averages()
    print("\nmost host time (self):\n")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    if args.device == "cuda":
        print("most device time (self):\n")
        print(averages.table(sort_by="self_device_time_total", row_limit=15))
    if args.trace:
        print(f"trace: {args.trace}")


if __name__ == "__main__":
    main()
