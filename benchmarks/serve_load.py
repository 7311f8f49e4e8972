"""Load test of the search server over loopback: N concurrent clients, a fixed number of image searches.

    .venv/bin/python benchmarks/serve_load.py --index artifacts/demo/index            # starts the server
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:7860 --images DIR  # a running one
    .venv/bin/python benchmarks/serve_load.py --fixture                               # a small digits index

Each client uploads gallery images to ``POST /search`` (multipart) in a loop; the run is bounded by
``--searches`` and ``--time-limit``. Prints p50/p99 latency, throughput and errors as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


def run_load(
    url: str,
    images: list[bytes],
    clients: int = 16,
    searches: int = 200,
    k: int = 10,
    time_limit_s: float = 120.0,
) -> dict[str, Any]:
    """``searches`` uploads spread over ``clients`` threads (one HTTP connection each)."""
    import httpx

    if not url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        raise ValueError(f"the load test only targets loopback servers, got {url}")
    lock = threading.Lock()
    next_search = [0]
    latencies: list[float] = []
    errors: list[str] = []
    deadline = time.monotonic() + time_limit_s
    start = threading.Barrier(clients)

    def client_loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as http:
            start.wait()
            while time.monotonic() < deadline:
                with lock:
                    n = next_search[0]
                    if n >= searches:
                        return
                    next_search[0] += 1
                began = time.perf_counter()
                try:
                    response = http.post(
                        f"/search?k={k}", files={"image": ("q.png", images[n % len(images)])}
                    )
                    ok = response.status_code == 200 and len(response.json()["results"]) > 0
                    problem = None if ok else f"HTTP {response.status_code}: {response.text[:200]}"
                except httpx.HTTPError as exc:
                    problem = f"{type(exc).__name__}: {exc}"
                elapsed = (time.perf_counter() - began) * 1000
                with lock:
                    (errors.append(problem) if problem else latencies.append(elapsed))

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    times = np.array(latencies) if latencies else np.array([np.nan])
    return {
        "clients": clients,
        "searches": searches,
        "k": k,
        "completed": len(latencies),
        "errors": len(errors),
        "error_examples": errors[:5],
        "wall_s": round(wall, 3),
        "throughput_per_s": round(len(latencies) / wall, 2),
        "p50_ms": round(float(np.percentile(times, 50)), 2),
        "p99_ms": round(float(np.percentile(times, 99)), 2),
        "mean_ms": round(float(times.mean()), 2),
    }


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free loopback port, for the time of the block; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def fixture_index(root: Path, image_size: int, images: int = 200) -> Path:
    """A small real index: scikit-learn's digits embedded by EfficientNet-Lite0 (offline weights) in ONNX."""
    import torch

    from retrieval.data.synthetic import write_digits
    from retrieval.export import export_embedder
    from retrieval.index import IngestOptions, build_index
    from retrieval.models import create_embedder

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=32, pretrained=True).eval()
    model.config["input_size"] = image_size
    export_embedder(model, root / "model.onnx", verify=False, log=lambda _: None)
    write_digits(root / "gallery", images)
    options = IngestOptions(batch_size=16, workers=0, progress=False)
    build_index(root / "gallery", root / "index", model=root / "model.onnx", options=options)
    return root / "index"


def gallery_images(index_dir: Path, count: int = 64) -> list[bytes]:
    from retrieval.index.catalogue import CatalogueReader

    with CatalogueReader(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.sample(count)
    return [Path(r["path"]).read_bytes() for r in rows if Path(r["path"]).is_file()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", type=Path, help="start a server (API only) on this index")
    source.add_argument("--url", help="a running server on loopback")
    source.add_argument("--fixture", action="store_true", help="build a small digits index and serve it")
    parser.add_argument("--images", type=Path, help="with --url: a folder of query images")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--searches", type=int, default=200)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--time-limit", type=float, default=300)
    parser.add_argument("--max-batch", type=int, default=32, help="micro-batch size (1 = no batching)")
    parser.add_argument("--image-size", type=int, default=64, help="with --fixture: the model's input size")
    parser.add_argument(
        "--ui", action="store_true", help="mount the Gradio UI too, as `retrieval serve` does"
    )
    args = parser.parse_args()

    if args.url:
        if not args.images:
            parser.error("--url needs --images (a folder of query images)")
        images = [
            p.read_bytes() for p in sorted(args.images.rglob("*")) if p.suffix.lower() in (".png", ".jpg")
        ]
        print(
            json.dumps(
                run_load(args.url, images, args.clients, args.searches, args.k, args.time_limit), indent=2
            )
        )
        return
    from retrieval.serve.server import ServerConfig, build_app

    index_dir = args.index
    if args.fixture:
        index_dir = fixture_index(Path(tempfile.mkdtemp(prefix="serve-load-")), args.image_size)
    app, service = build_app(ServerConfig(index_dir=index_dir, ui=args.ui, max_batch=args.max_batch))
    images = gallery_images(index_dir)
    with serving(app) as url:
        run_load(url, images, args.clients, min(32, args.searches), args.k, args.time_limit)  # warm-up
        result = run_load(url, images, args.clients, args.searches, args.k, args.time_limit)
    result |= {"index": service.describe(), "batcher": service.batcher.stats()}
    service.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
