"""Embedding on a CPU: int8 against fp32 (speed and retrieval quality on real photos), the int8 recipe's choices, and
`retrieval index build` against the bare decode + session loop, all measured in one run on the same images.

    .venv/bin/python benchmarks/cpu_throughput.py [--sizes 128 224] [--seeds 0 1 2] [--rounds 3] [--work DIR]
        [--out benchmarks/results/cpu-throughput/cpu-2core.json]

The images: the catalogue of benchmarks/catalogue.py (Fashion-MNIST's Zalando product photos cut to the object, scaled
3x to 6x and set on white with margins of their own: 47 to 230 px, tall and wide, JPEG), 150 of each of 10 classes:
the first 100 of each class are the measured gallery (1,000 images), the other 50 the calibration pool (500 images,
never measured on). The model: the quick path's pretrained EfficientNet-Lite0 letterboxed (`retrieval export
--pretrained efficientnet_lite0 --resize pad`) at each --sizes.

1. int8 vs fp32, per size and calibration seed: `export_int8` (the default recipe, 256 images of the pool, the seed's
   sample) -> Recall@1 and MAP@R of each model on the 1,000 gallery images (each a query against the others), the
   int8 queries against the fp32 gallery (cross-model), the cosine of each image's two embeddings; images/s of the
   two sessions side by side (batch 32, onnxruntime's default threads, alternating rounds of ~2 s each).
2. The recipe's study at 224 px, seed 0: each choice changed alone (per-tensor weights, symmetric activations,
   percentile and entropy ranges, convolutions alone, QOperator, no pre-processing pass, 64 calibration images),
   measured as in 1.
3. Throughput, 1,000 images, wall clock of fresh processes, start-up included, alternating rounds: the bare loop
   (PIL decode + letterbox + the session at batch 32, one script) and `retrieval index build` of the same folder,
   for fp32 and int8; and a profile of what a build is made of: the process start-up with the command line's
   imports, decoding alone, the session alone on preprocessed batches.
4. Threads: the session's images/s by its thread count and by its batch; decoding alone and `build_index` (a fresh
   process, start-up included) by the decoders, threads or worker processes, and their number.

Parts 3 and 4 read the models part 1 wrote into --work (fp32-SIZE.onnx, int8-SIZE-0.onnx) and its gallery/.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the catalogue of benchmarks/catalogue.py

from catalogue import catalogue_folder  # noqa: E402

PER_CLASS, GALLERY_PER_CLASS = 150, 100
CALIBRATION = 256
STUDY = {  # name -> Int8Recipe fields changed from the default
    "default (QDQ, per channel, uint8 asymmetric, MinMax)": {},
    "weights per tensor": {"per_channel": False},
    "symmetric int8 activations": {"symmetric_activations": True},
    "percentile ranges": {"calibration": "Percentile"},
    "entropy ranges": {"calibration": "Entropy"},
    "convolutions alone": {"op_types": ("Conv",)},
    "QOperator format": {"quant_format": "QOperator"},
    "no pre-processing pass": {"pre_process": False},
    "64 calibration images": {"calibration_images": 64},
}
BARE_LOOP = """
import sys, time
started = time.perf_counter()
from pathlib import Path
import numpy as np
from PIL import Image
from retrieval.data.eval_preprocess import EvalPreprocess
from retrieval.onnx_runtime import OnnxEmbedder
model = OnnxEmbedder(sys.argv[1], providers="cpu")
prepare = EvalPreprocess(model.preprocessing)
files = sorted(Path(sys.argv[2]).rglob("*.jpg"))
for start in range(0, len(files), 32):
    batch = np.stack([prepare(Image.open(f).convert("RGB")) for f in files[start:start + 32]])
    model.session.run(None, {"images": batch})
"""


BUILD = """
import sys
sys.path.insert(0, sys.argv[6])
from retrieval.index.embedding import ingest
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.writing.writer import build_index
model, images, out, mode, workers = sys.argv[1:6]
if mode == "processes":  # the alternative measured against the build's threads
    from cpu_throughput import process_batches
    ingest.thread_batches = process_batches
build_index(images, out, model=model, options=IngestOptions(workers=int(workers), progress=False))
"""


def decode_items(items: list, preprocessing, max_pixels: int):
    """One batch decoded and stacked in a worker process (all it needs is in its arguments)."""
    from retrieval.index.embedding.decode import DecodedBatch, GalleryDecodeDataset

    dataset = GalleryDecodeDataset(items, preprocessing, max_pixels)
    records = [dataset[i] for i in range(len(dataset))]
    ok = [i for i, record in enumerate(records) if record.array is not None]
    batch = np.stack([records[i].array for i in ok]) if ok else None
    for record in records:
        record.array = None
    return DecodedBatch(records, ok, batch)


def process_batches(dataset, batch_size: int, processes: int):
    """The build's batches decoded by worker processes instead of threads, each batch pickled back through a pipe
    (what the build did without torch before it decoded in threads), a few batches ahead, in order."""
    from collections import deque
    from concurrent.futures import ProcessPoolExecutor

    pool, ahead = ProcessPoolExecutor(max(1, processes)), deque()
    try:
        for start in range(0, len(dataset), batch_size):
            ahead.append(pool.submit(decode_items, dataset.items[start:start + batch_size], dataset.preprocessing,
                                     dataset.max_pixels))
            if len(ahead) > processes + 2:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def split_catalogue(work: Path) -> tuple[Path, Path]:
    """The gallery (first 100 of each class) and the calibration pool (the rest), as folders of links (a --work
    that holds them already, copied to another machine, needs no Fashion-MNIST there)."""
    gallery, pool = work / "gallery", work / "pool"
    if not (gallery / "done").is_file():
        root = catalogue_folder(work, PER_CLASS)
        for folder in (gallery, pool):
            shutil.rmtree(folder, ignore_errors=True)
        for class_folder in sorted(p for p in root.iterdir() if p.is_dir()):
            for n, path in enumerate(sorted(class_folder.glob("*.jpg"))):
                target = (gallery if n < GALLERY_PER_CLASS else pool) / class_folder.name / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(path)
        (gallery / "done").write_text("")
    return gallery, pool


def gallery_arrays(gallery: Path, model) -> tuple[np.ndarray, list[str]]:
    """Every gallery image preprocessed for ``model``, and its class."""
    files = sorted(gallery.rglob("*.jpg"))
    return model.preprocess(files), [f.parent.name for f in files]


def quality(fp32: np.ndarray, int8: np.ndarray, labels: list[str]) -> dict:
    """Each model's Recall@1 and MAP@R, int8 queries against the fp32 gallery, and the cosines: the export's own
    verification (``verify_int8``) on the whole gallery."""
    from retrieval.export.int8_export import verify_int8

    check = verify_int8(fp32, int8, held_out=True, labels=labels)
    return {"fp32": check.labels["fp32"], "int8": check.labels["int8"],
            "cross": check.labels["int8 queries, fp32 gallery"],
            "cosine": {key: check.cosine[key] for key in ("median", "p01", "min")}}


def session_speeds(sessions: dict, batch: np.ndarray, rounds: int, seconds: float = 2.0) -> dict:
    """Images/s of each session on the same batch, alternating the order between rounds; median and per-round
    ratios to the first."""
    rates: dict[str, list[float]] = {name: [] for name in sessions}
    for r in range(rounds):
        for name in (list(sessions) if r % 2 == 0 else list(reversed(sessions))):
            run = sessions[name]
            run(batch)
            count, start = 0, time.perf_counter()
            while time.perf_counter() - start < seconds:
                run(batch)
                count += len(batch)
            rates[name].append(count / (time.perf_counter() - start))
    first = next(iter(sessions))
    return {name: {"images_per_s": round(float(np.median(values)), 1),
                   "ratio": round(float(np.median(np.array(values) / np.array(rates[first]))), 3)}
            for name, values in rates.items()}


def int8_rows(work: Path, size: int, seeds: list[int], rounds: int) -> dict:
    from retrieval.export import export_int8, export_pretrained
    from retrieval.onnx_runtime import OnnxEmbedder

    gallery, pool = split_catalogue(work)
    fp32_path = work / f"fp32-{size}.onnx"
    if not fp32_path.is_file():
        export_pretrained("efficientnet_lite0", fp32_path, image_size=size, resize="pad", log=lambda line: None)
    fp32 = OnnxEmbedder(fp32_path, providers="cpu")
    arrays, labels = gallery_arrays(gallery, fp32)
    reference = fp32.embed_batch(arrays)
    rows = {}
    for seed in seeds:
        path = work / f"int8-{size}-{seed}.onnx"
        result = export_int8(fp32_path, path, pool, images=CALIBRATION, seed=seed, log=lambda line: None)
        int8 = OnnxEmbedder(path, providers="cpu")
        rows[seed] = {"quality": quality(reference, int8.embed_batch(arrays), labels),
                      "speed": session_speeds({"fp32": fp32.embed_batch, "int8": int8.embed_batch}, arrays[:32],
                                              rounds),
                      "export_seconds": round(result.seconds, 1), "verification": result.verification.describe()}
        print(f"{size} px seed {seed}: {json.dumps(rows[seed])}", flush=True)
    return rows


def study_rows(work: Path, rounds: int) -> dict:
    from retrieval.export.int8_export import Int8Recipe, quantize_model, read_images, sample_items
    from retrieval.onnx_runtime import OnnxEmbedder

    gallery, pool = split_catalogue(work)
    fp32_path = work / "fp32-224.onnx"
    fp32 = OnnxEmbedder(fp32_path, providers="cpu")
    arrays, labels = gallery_arrays(gallery, fp32)
    reference = fp32.embed_batch(arrays)
    chosen, _, _ = sample_items(pool, CALIBRATION, 0)
    calibration = read_images(chosen, fp32, desc="calibration").arrays
    rows = {}
    for name, change in STUDY.items():
        path = work / "study.onnx"
        started = time.perf_counter()
        recipe = {key: value for key, value in change.items() if key != "calibration_images"}
        quantize_model(fp32_path, path, calibration[:change.get("calibration_images", CALIBRATION)],
                       Int8Recipe(**recipe))
        seconds = time.perf_counter() - started
        int8 = OnnxEmbedder(path, providers="cpu")
        rows[name] = {"quality": quality(reference, int8.embed_batch(arrays), labels),
                      "speed": session_speeds({"fp32": fp32.embed_batch, "int8": int8.embed_batch}, arrays[:32],
                                              rounds),
                      "quantize_seconds": round(seconds, 1)}
        print(f"study {name}: {json.dumps(rows[name])}", flush=True)
    return rows


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def throughput_rows(work: Path, sizes: list[int], rounds: int) -> dict:
    gallery, _ = split_catalogue(work)
    images = len(list(gallery.rglob("*.jpg")))
    python, cli = sys.executable, [sys.executable, "-m", "retrieval"]
    rows = {}
    for size in sizes:
        for precision, model in (("fp32", work / f"fp32-{size}.onnx"), ("int8", work / f"int8-{size}-0.onnx")):
            bare, build = [], []
            for r in range(rounds):
                out = work / "index"
                steps = [("bare", [python, "-c", BARE_LOOP, str(model), str(gallery)]),
                         ("build", [*cli, "index", "build", "--model", str(model), "--images", str(gallery),
                                    "--out", str(out)])]
                for name, command in (steps if r % 2 == 0 else reversed(steps)):
                    shutil.rmtree(out, ignore_errors=True)
                    (bare if name == "bare" else build).append(wall(command))
            row = {"bare_images_per_s": round(images / float(np.median(bare)), 1),
                   "build_images_per_s": round(images / float(np.median(build)), 1),
                   "ratio": round(float(np.median(np.array(bare) / np.array(build))), 3),
                   "bare_seconds": [round(s, 2) for s in bare], "build_seconds": [round(s, 2) for s in build]}
            rows[f"{size} px {precision}"] = row
            print(f"throughput {size} px {precision}: {json.dumps(row)}", flush=True)
    rows["profile"] = profile(work, gallery, rounds)
    return rows


def profile(work: Path, gallery: Path, rounds: int) -> dict:
    """What a build is made of, at 224 px fp32: start-up, decoding alone, the session alone."""
    from retrieval.index.embedding.decode import GalleryDecodeDataset, thread_batches
    from retrieval.onnx_runtime import OnnxEmbedder

    startup = float(np.median([wall([sys.executable, "-c", "import retrieval.cli.main, retrieval.index.writing.writer, "
                                     "retrieval.onnx_runtime"]) for _ in range(rounds)]))
    model = OnnxEmbedder(work / "fp32-224.onnx", providers="cpu")
    files = sorted(gallery.rglob("*.jpg"))
    dataset = GalleryDecodeDataset(list(enumerate(map(str, files))), model.preprocessing)
    decode = []
    for threads in (1, 2):
        started = time.perf_counter()
        for _ in thread_batches(dataset, 64, threads):
            pass
        decode.append(len(files) / (time.perf_counter() - started))
    batch = model.preprocess(files[:32])
    session = session_speeds({"session": model.embed_batch}, batch, rounds)["session"]["images_per_s"]
    return {"startup_seconds": round(startup, 2), "decode_images_per_s_1_thread": round(decode[0], 1),
            "decode_images_per_s_2_threads": round(decode[1], 1), "session_images_per_s": session}


def threads_rows(work: Path, size: int, rounds: int) -> dict:
    """The session's images/s by its thread count (0: onnxruntime's default), fp32 and int8; and `retrieval index
    build`'s wall clock by its decoding threads (--workers), the session's threads left at the command's choice."""
    import onnxruntime as ort

    gallery, _ = split_catalogue(work)
    cores = len(__import__("os").sched_getaffinity(0))
    counts = sorted(n for n in {0, 1, 2, 4, 8, cores // 2, cores} if n <= cores)  # 0: onnxruntime's default
    batch = np.random.default_rng(0).standard_normal((32, 3, size, size)).astype(np.float32)
    sessions = {}
    for precision in ("fp32", "int8"):
        path = work / (f"fp32-{size}.onnx" if precision == "fp32" else f"int8-{size}-0.onnx")
        for threads in counts:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
            sessions[f"{precision} {threads or 'default'} threads"] = (
                lambda x, session=session: session.run(None, {"images": x}))
    speeds = session_speeds(sessions, batch, rounds)
    by_batch = {}
    for precision in ("fp32", "int8"):
        model = sessions[f"{precision} default threads"]
        for size_of_batch in (8, 16, 32, 64):
            one = {"batch": model}
            by_batch[f"{precision} batch {size_of_batch}"] = session_speeds(
                one, np.repeat(batch[:1], size_of_batch, axis=0), rounds)["batch"]["images_per_s"]
    images = len(list(gallery.rglob("*.jpg")))
    from retrieval.index.embedding.decode import GalleryDecodeDataset, thread_batches
    from retrieval.onnx_runtime import OnnxEmbedder

    model = OnnxEmbedder(work / f"fp32-{size}.onnx", providers="cpu")
    dataset = GalleryDecodeDataset(list(enumerate(map(str, sorted(gallery.rglob("*.jpg"))))), model.preprocessing)
    decoding, builds = {}, {}
    for mode, batches in (("threads", thread_batches), ("processes", process_batches)):
        for workers in [n for n in (1, 2, 4, 8) if n <= max(2, cores)]:
            started = time.perf_counter()
            for _ in batches(dataset, 64, workers):
                pass
            decoding[f"{workers} {mode}"] = round(images / (time.perf_counter() - started), 1)
            seconds = []
            for _ in range(rounds):
                shutil.rmtree(work / "index", ignore_errors=True)
                seconds.append(wall([sys.executable, "-c", BUILD, str(work / f"fp32-{size}.onnx"), str(gallery),
                                     str(work / "index"), mode, str(workers), str(Path(__file__).resolve().parent)]))
            builds[f"{workers} decoding {mode}"] = round(images / float(np.median(seconds)), 1)
    row = {"cores": cores, "session_images_per_s": {name: value["images_per_s"] for name, value in speeds.items()},
           "session_images_per_s_by_batch": by_batch, "decode_images_per_s": decoding, "build_images_per_s": builds}
    print(f"threads {size} px: {json.dumps(row)}", flush=True)
    return row


def mean_spread(values: list[float], digits: int = 3) -> str:
    """Mean and half the spread over the seeds, as a cell."""
    return f"{np.mean(values):.{digits}f} ± {np.ptp(values) / 2:.{digits}f}"


def save_tables(result: dict, machine: str) -> list[Path]:
    """The run's tables as results files (docs/BENCHMARKS.md "CPU throughput" renders them)."""
    from results_io import write_result

    command, written = result["command"], []
    if "int8" in result:
        rows = []
        for size, seeds in result["int8"].items():
            runs = list(seeds.values())

            def pick(*keys, runs=runs) -> list[float]:
                values = []
                for run in runs:
                    value = run
                    for key in keys:
                        value = value[key]
                    values.append(float(value))
                return values

            delta = {m: [i - f for i, f in zip(pick("quality", "int8", m), pick("quality", "fp32", m), strict=True)]
                     for m in ("recall@1", "map@r")}
            rows.append([f"{size} px", f"{np.mean(pick('quality', 'fp32', 'recall@1')):.3f}",
                         mean_spread(pick("quality", "int8", "recall@1")), mean_spread(delta["recall@1"]),
                         f"{np.mean(pick('quality', 'fp32', 'map@r')):.3f}",
                         mean_spread(pick("quality", "int8", "map@r")), mean_spread(delta["map@r"]),
                         mean_spread(pick("quality", "cross", "recall@1")),
                         mean_spread(pick("quality", "cross", "map@r")),
                         mean_spread(pick("quality", "cosine", "median"), 4),
                         f"{np.median(pick('speed', 'fp32', 'images_per_s')):.0f}",
                         f"{np.median(pick('speed', 'int8', 'images_per_s')):.0f}",
                         f"{mean_spread(pick('speed', 'int8', 'ratio'), 2)}x"])
        written.append(write_result(
            "cpu-int8", machine, command,
            ["size", "fp32 R@1", "int8 R@1", "Δ R@1", "fp32 MAP@R", "int8 MAP@R", "Δ MAP@R", "int8→fp32 R@1",
             "int8→fp32 MAP@R", "median cosine", "fp32 img/s", "int8 img/s", "int8 / fp32"], rows,
            notes=f"{len(runs)} calibration seeds; ± is half the spread over them"))
    if "study" in result:
        rows = []
        for name, row in result["study"].items():
            q = row["quality"]
            rows.append([name, f"{q['cosine']['median']:.4f}", f"{q['cosine']['p01']:.4f}",
                         f"{q['int8']['recall@1'] - q['fp32']['recall@1']:+.3f}",
                         f"{q['int8']['map@r'] - q['fp32']['map@r']:+.3f}", f"{row['speed']['int8']['ratio']:.2f}x",
                         f"{row['quantize_seconds']:.0f}"])
        written.append(write_result("cpu-int8-study", machine, command,
                                    ["recipe (224 px, seed 0)", "median cosine", "1st pct cosine", "Δ R@1", "Δ MAP@R",
                                     "int8 / fp32 img/s", "quantize s"], rows))
    if "throughput" in result:
        rows = [[name, f"{row['bare_images_per_s']:.0f}", f"{row['build_images_per_s']:.0f}", f"{row['ratio']:.2f}"]
                for name, row in result["throughput"].items() if name != "profile"]
        profile = result["throughput"]["profile"]
        written.append(write_result(
            "cpu-build", machine, command, ["model", "bare loop img/s", "index build img/s", "build / bare"], rows,
            notes=f"profile (224 px fp32): start-up with the command's imports {profile['startup_seconds']} s, "
                  f"decoding alone {profile['decode_images_per_s_1_thread']} img/s on 1 thread and "
                  f"{profile['decode_images_per_s_2_threads']} on 2, the session alone "
                  f"{profile['session_images_per_s']} img/s"))
    if "threads" in result:
        rows = []
        for size, row in result["threads"].items():
            rows += [[f"{size} px", name, f"{value:.0f}"] for name, value in row["session_images_per_s"].items()]
            rows += [[f"{size} px", f"{name}, default threads", f"{value:.0f}"]
                     for name, value in row["session_images_per_s_by_batch"].items()]
            rows += [[f"{size} px", f"decoding alone, {name}", f"{value:.0f}"]
                     for name, value in row["decode_images_per_s"].items()]
            rows += [[f"{size} px", f"build_index fp32, {name}", f"{value:.0f}"]
                     for name, value in row["build_images_per_s"].items()]
        written.append(write_result("cpu-threads", machine, command, ["size", "what", "img/s"], rows,
                                    notes=f"{next(iter(result['threads'].values()))['cores']} cores"))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[128, 224])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=["int8", "study", "throughput", "threads"],
                        choices=["int8", "study", "throughput", "threads"])
    parser.add_argument("--work", help="the catalogue, models and indexes (default: a new temporary folder)")
    parser.add_argument("--out", help="results JSON")
    parser.add_argument("--save", metavar="MACHINE", help="also write the tables to benchmarks/results/ for MACHINE")
    parser.add_argument("--tables-from", metavar="JSON",
                        help="write the tables of an earlier run's --out (with --save)")
    args = parser.parse_args()
    if args.tables_from:
        for path in save_tables(json.loads(Path(args.tables_from).read_text()), args.save or "cpu-2core"):
            print(f"wrote {path}")
        return
    work = Path(args.work or tempfile.mkdtemp(prefix="cpu-throughput-"))
    work.mkdir(parents=True, exist_ok=True)
    import onnxruntime

    script = Path(sys.argv[0]).resolve().relative_to(Path(__file__).resolve().parents[1])
    result = {"command": " ".join([".venv/bin/python", str(script), *sys.argv[1:]]),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "cores": len(__import__("os").sched_getaffinity(0)), "onnxruntime": onnxruntime.__version__}
    if "int8" in args.parts:
        result["int8"] = {str(size): int8_rows(work, size, args.seeds, args.rounds) for size in args.sizes}
    if "study" in args.parts:
        result["study"] = study_rows(work, args.rounds)
    if "throughput" in args.parts:
        result["throughput"] = throughput_rows(work, args.sizes, args.rounds)
    if "threads" in args.parts:
        result["threads"] = {str(size): threads_rows(work, size, args.rounds) for size in args.sizes}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.save:
        for path in save_tables(result, args.save):
            print(f"wrote {path}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
