"""``retrieval index upgrade`` against ``retrieval index build`` on the same gallery and model, with a server
answering throughout.

    .venv/bin/python benchmarks/upgrade.py [--images 2000] [--commit-every 256] [--convs 2]

A gallery of ``--images`` 64 px PNGs (20 classes, each a colour under noise) is built with an old model (a real ONNX
file: ``--convs`` 3x3 convolutions of 64 channels, a projection and an L2 norm at 16 px, as the index tests use), then
upgraded twice, each time from a fresh copy of the built index: to a model declared compatible (mixed: published
every ``--commit-every`` images) and to one that is not (swap: published at the end). Meanwhile one client thread
of an in-process ``SearchService`` (as ``retrieval serve`` runs it, the folder polled every 50 ms) searches by image
bytes back to back (k = 10). Reported: images/s of the build and of each upgrade (the upgrade in a separate
process, as the command runs), and for the searches during each upgrade: answers, failed and short ones, the states
swapped in, p50/p99 latency against the same client before the upgrade.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def gallery(folder: Path, count: int) -> None:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    colours = rng.integers(0, 256, (20, 3))
    for n in range(count):
        label = n % 20
        pixels = 0.7 * rng.integers(0, 256, (64, 64, 3)) + 0.3 * colours[label]
        (folder / f"c{label:02d}").mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="PNG")
        (folder / f"c{label:02d}" / f"{n:06d}.png").write_bytes(buffer.getvalue())


def serve_while(index: Path, query: bytes, command: list[str], new_hash: str) -> dict:
    """Search the index back to back before and while ``command`` runs; the answers' counts and latencies. The
    searches run in a thread other than the main one, as a server's requests do (faiss' OpenMP search is slower
    from the main thread while onnxruntime's pool spins: 16 ms against 0.9 ms on 300 vectors here)."""
    from retrieval.serve.service import SearchService

    service = SearchService(index, reload_interval_s=0.05)
    baseline, during, failures, short = [], [], [], 0

    def warm() -> None:
        for n in range(220):  # 20 warm-up calls, then the baseline
            started = time.perf_counter()
            service.search(query, k=10)
            if n >= 20:
                baseline.append(time.perf_counter() - started)

    warmer = threading.Thread(target=warm)
    warmer.start()
    warmer.join()
    first_generation = service.generation
    done = threading.Event()

    def ask() -> None:
        nonlocal short
        while not done.is_set():
            started = time.perf_counter()
            try:
                count = len(service.search(query, k=10).results)
                short += count != 10
                during.append(time.perf_counter() - started)
            except Exception as exc:  # noqa: BLE001  (counted)
                failures.append(repr(exc))

    client = threading.Thread(target=ask)
    client.start()
    started = time.perf_counter()
    process = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    upgrade_s = time.perf_counter() - started
    deadline = time.monotonic() + 30
    while service.current().index.model_hash != new_hash and time.monotonic() < deadline:
        time.sleep(0.01)
    final_after_s = time.perf_counter() - started - upgrade_s
    done.set()
    client.join()
    swapped = service.generation - first_generation
    served_new = service.current().index.model_hash == new_hash
    service.close()

    def ms(values, q):
        return round(1000 * statistics.quantiles(values, n=100)[q - 1], 2) if len(values) >= 2 else None

    return {"summary": json.loads(process.stdout), "wall_s": round(upgrade_s, 1), "new_model_served": served_new,
            "new_model_served_after_s": round(final_after_s, 2), "answers": len(during), "failed": len(failures),
            "short": short, "states_swapped_in": swapped,
            "p50_ms_before": ms(baseline, 50), "p99_ms_before": ms(baseline, 99),
            "p50_ms_during": ms(during, 50), "p99_ms_during": ms(during, 99), "failures": failures[:3]}


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--commit-every", type=int, default=256)
    parser.add_argument("--convs", type=int, default=2)
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    record_tables("upgrade", args.save)

    from embedders import write_projection_onnx

    from retrieval.index import IngestOptions, build_index, load_model

    work = Path(tempfile.mkdtemp(prefix="upgrade-bench-"))
    gallery(work / "g", args.images)
    old = write_projection_onnx(work / "old.onnx", seed=0, convs=args.convs)
    new = write_projection_onnx(work / "new.onnx", seed=0, convs=args.convs, drift=0.3,
                                compatible_with=(load_model(old).model_hash,))
    other = write_projection_onnx(work / "other.onnx", dim=32, seed=5, convs=args.convs)
    started = time.perf_counter()
    build_index(work / "g", work / "built", model=old, options=IngestOptions(workers=2, progress=False))
    build_s = time.perf_counter() - started
    results = {"images": args.images, "build_images_per_s": round(args.images / build_s, 1)}
    query = next((work / "g" / "c00").iterdir()).read_bytes()
    for name, model in (("compatible", new), ("incompatible", other)):
        index = work / name
        shutil.copytree(work / "built", index)
        # --force: the random projections are timed, whatever the index's labels measure of them
        command = [sys.executable, "-m", "retrieval", "index", "upgrade", str(index), "--model", str(model),
                   "--commit-every", str(args.commit_every), "--workers", "2", "--force", "--json"]
        serving = serve_while(index, query, command, load_model(model).model_hash)
        summary = serving.pop("summary")
        results[name] = {"mode": summary["mode"], "upgrade_images_per_s": round(args.images / summary["seconds"], 1),
                         **serving}
    print(json.dumps(results, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
