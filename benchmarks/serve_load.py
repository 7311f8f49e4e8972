"""Load test of the search server over loopback: N concurrent clients, a fixed number of image searches.

    .venv/bin/python benchmarks/serve_load.py --index artifacts/demo/index            # starts the server
    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:7860 --images DIR  # a running one
    .venv/bin/python benchmarks/serve_load.py --fixture                               # a small digits index
    .venv/bin/python benchmarks/serve_load.py --fixture --observability-cost 6        # metrics + access log on/off
    .venv/bin/python benchmarks/serve_load.py --fixture --batch-compare 6 --batch-size 32  # /search vs /search/batch

Each client uploads gallery images to ``POST /search`` (multipart) in a loop; the run is bounded by
``--searches`` and ``--time-limit``. Prints p50/p99 latency, throughput and errors as JSON.

``--observability-cost ROUNDS`` serves the index twice in one process, with ``/metrics`` and the access log (written
to a file, as a server's stderr would be) and without them (``ServerConfig(observe=False)``), and loads them in
interleaved rounds (on, off, off, on, ...) while a scraper reads ``/metrics`` every ``--scrape-interval`` seconds:
the ratio of the medians is the cost of observing.

``--batch-compare ROUNDS`` sends the same ``--batch-size`` N images, in interleaved rounds on one server, as N
``POST /search`` calls one after another (one client), as N clients at once (one ``/search`` each, which the
micro-batcher may merge) and as one ``POST /search/batch`` of N, ``--repeats`` times per round each; it prints the
images/s of each and the model calls each made per N images.
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


def observability_cost(
    index_dir: Path,
    images: list[bytes],
    rounds: int,
    clients: int,
    searches: int,
    k: int,
    time_limit_s: float,
    log_format: str = "text",
    scrape_interval_s: float = 1.0,
    max_batch: int = 32,
) -> dict[str, Any]:
    """Throughput with metrics + access log (on) and without (off), in interleaved rounds on one shared service."""
    import logging

    import httpx

    from retrieval.serve.observability import ACCESS_LOGGER, TEXT_FORMAT, JsonFormatter
    from retrieval.serve.server import ServerConfig, build_app

    log_file = Path(tempfile.mkdtemp(prefix="serve-access-")) / "access.log"
    handler = logging.FileHandler(log_file)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    access = logging.getLogger(ACCESS_LOGGER)
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False  # the file only, as `retrieval serve` writes its own handler's lines only
    config = ServerConfig(index_dir=index_dir, ui=False, reload_interval_s=None, max_batch=max_batch)
    on_app, service = build_app(config)
    off_app, _ = build_app(ServerConfig(index_dir=index_dir, ui=False, observe=False), service=service)
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with serving(on_app) as on_url, serving(off_app) as off_url:
        urls = {"on": on_url, "off": off_url}
        warm = {mode: run_load(url, images, clients, min(32, searches), k, time_limit_s)  # both servers warm
                for mode, url in urls.items()}
        for round_ in range(rounds):
            order = ("on", "off") if round_ % 2 == 0 else ("off", "on")  # ABBA: drift cancels out
            for mode in order:
                stop = threading.Event()
                scraper = threading.Thread(target=_scrape_until, args=(urls["on"], stop, scrape_interval_s))
                if mode == "on":
                    scraper.start()
                runs[mode].append(run_load(urls[mode], images, clients, searches, k, time_limit_s))
                stop.set()
                if mode == "on":
                    scraper.join()
        metrics = httpx.get(f"{on_url}/metrics", timeout=10).text
    service.close()
    access.removeHandler(handler)
    handler.close()
    counted = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                  if line.startswith('retrieval_http_requests_total{method="POST",route="/search",status="200"}'))
    served_on = sum(run["completed"] for run in runs["on"]) + warm["on"]["completed"]
    lines = sum(1 for _ in log_file.open())

    pairs = [round(on["throughput_per_s"] / off["throughput_per_s"], 3) for on, off in zip(runs["on"], runs["off"],
                                                                                          strict=True)]

    def median(mode: str, key: str) -> float:
        return float(np.median([run[key] for run in runs[mode]]))

    return {
        "rounds": rounds,
        "clients": clients,
        "searches_per_round": searches,
        "log_format": log_format,
        "scrape_interval_s": scrape_interval_s,
        "throughput_per_s": {mode: [run["throughput_per_s"] for run in runs[mode]] for mode in runs},
        "p50_ms": {mode: [run["p50_ms"] for run in runs[mode]] for mode in runs},
        "errors": {mode: sum(run["errors"] for run in runs[mode]) for mode in runs},
        "median_throughput_per_s": {mode: median(mode, "throughput_per_s") for mode in runs},
        "median_p50_ms": {mode: median(mode, "p50_ms") for mode in runs},
        "throughput_ratio_on_off": round(median("on", "throughput_per_s") / median("off", "throughput_per_s"), 3),
        # each round's on/off pair ran back to back: the median of their ratios is the least drift-prone figure
        "pair_ratios_on_off": pairs,
        "median_pair_ratio_on_off": round(float(np.median(pairs)), 3),
        "p50_ratio_on_off": round(median("on", "p50_ms") / median("off", "p50_ms"), 3),
        "searches_counted_by_metrics": counted,
        "searches_served_with_metrics": served_on,
        "access_log_lines": lines,
        "access_log_bytes": log_file.stat().st_size,
    }


def batch_compare(
    index_dir: Path,
    images: list[bytes],
    rounds: int,
    batch_size: int,
    k: int,
    repeats: int = 3,
    max_batch: int = 32,
) -> dict[str, Any]:
    """Images/s of N single searches (one after another, and N clients at once) vs one batch of N, interleaved."""
    import httpx

    from retrieval.serve.server import ServerConfig, build_app

    app, service = build_app(ServerConfig(index_dir=index_dir, ui=False, reload_interval_s=None, max_batch=max_batch))
    chosen = [images[i % len(images)] for i in range(batch_size)]
    files = [("image", (f"q{i}.png", data)) for i, data in enumerate(chosen)]
    speeds: dict[str, list[float]] = {"single": [], "concurrent": [], "batch": []}
    calls = dict.fromkeys(speeds, 0)
    errors = dict.fromkeys(speeds, 0)
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:

        def single() -> int:
            return sum(http.post(f"/search?k={k}", files={"image": ("q.png", data)}).status_code != 200
                       for data in chosen)

        def concurrent() -> int:
            return run_load(url, chosen, batch_size, batch_size, k, 120.0)["errors"]

        def batch() -> int:
            response = http.post(f"/search/batch?k={k}", files=files)
            if response.status_code != 200:
                return batch_size
            return sum("error" in answer for answer in response.json()["results"])

        modes = {"single": single, "concurrent": concurrent, "batch": batch}
        for run in modes.values():  # warm-up: sessions, the model's first calls at each batch size
            run()
        for round_ in range(rounds):
            order = list(modes) if round_ % 2 == 0 else list(reversed(modes))  # ABC CBA: drift cancels out
            for mode in order:
                batcher = service.current().batcher  # one state's counter, before and after
                before = batcher.calls
                began = time.perf_counter()
                errors[mode] += sum(modes[mode]() for _ in range(repeats))
                speeds[mode].append(round(batch_size * repeats / (time.perf_counter() - began), 2))
                calls[mode] += batcher.calls - before
    service.close()
    median = {mode: float(np.median(values)) for mode, values in speeds.items()}
    return {
        "rounds": rounds,
        "batch_size": batch_size,
        "repeats_per_round": repeats,
        "k": k,
        "max_batch": max_batch,
        "images_per_s": speeds,
        "median_images_per_s": median,
        "speedup_batch_vs_single": round(median["batch"] / median["single"], 2),
        "speedup_batch_vs_concurrent": round(median["batch"] / median["concurrent"], 2),
        "model_calls_per_n_images": {mode: round(calls[mode] / (rounds * repeats), 2) for mode in calls},
        "errors": errors,
    }


def _scrape_until(url: str, stop: threading.Event, interval_s: float) -> None:
    """GET /metrics every ``interval_s`` seconds until ``stop`` is set (a Prometheus far keener than the usual 15 s)."""
    import httpx

    with httpx.Client(base_url=url, timeout=10) as http:
        while not stop.wait(interval_s):
            http.get("/metrics").raise_for_status()


def fixture_index(root: Path, image_size: int, images: int = 200) -> Path:
    """A small real index: scikit-learn's digits embedded by EfficientNet-Lite0 (offline weights) in ONNX."""
    import torch

    from retrieval.data.synthetic import write_digits
    from retrieval.export import export_embedder
    from retrieval.index import IngestOptions, build_index
    from retrieval.models import create_embedder

    torch.manual_seed(0)
    model = create_embedder("efficientnet_lite0", embedding_dim=32, pretrained=True).eval()
    model.config = model.config.with_fields({"input_size": image_size})
    export_embedder(model, root / "model.onnx", verify=False, log=lambda _: None)
    write_digits(root / "gallery", images)
    options = IngestOptions(batch_size=16, workers=0, progress=False)
    build_index(root / "gallery", root / "index", model=root / "model.onnx", options=options)
    return root / "index"


def gallery_images(index_dir: Path, count: int = 64) -> list[bytes]:
    from retrieval.index.catalogue_reader import CatalogueReader

    with CatalogueReader(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.sample(count)
    return [Path(r["path"]).read_bytes() for r in rows if Path(r["path"]).is_file()]


def main() -> None:
    from results_io import SAVE_HELP, record_tables  # benchmarks/ is on the path when run
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
    parser.add_argument("--observability-cost", type=int, metavar="ROUNDS", default=0,
                        help="measure /metrics + the access log on vs off in ROUNDS interleaved rounds (API only)")
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="with --observability-cost: the access log's format")
    parser.add_argument("--scrape-interval", type=float, default=1.0,
                        help="with --observability-cost: seconds between two scrapes of /metrics")
    parser.add_argument("--batch-compare", type=int, metavar="ROUNDS", default=0,
                        help="N single /search calls vs one /search/batch of N, in ROUNDS interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=32, help="with --batch-compare: N, the images per batch")
    parser.add_argument("--repeats", type=int, default=3, help="with --batch-compare: each mode's runs per round")
    parser.add_argument("--save", metavar="MACHINE", help=SAVE_HELP)
    args = parser.parse_args()
    name = "observability" if args.observability_cost else "batch-queries" if args.batch_compare else "serve-load"
    record_tables(name, args.save)

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
    images = gallery_images(index_dir)
    if args.batch_compare:
        result = batch_compare(index_dir, images, args.batch_compare, args.batch_size, args.k, args.repeats,
                               args.max_batch)
        print(json.dumps(result, indent=2))
        return
    if args.observability_cost:
        result = observability_cost(index_dir, images, args.observability_cost, args.clients, args.searches, args.k,
                                    args.time_limit, args.log_format, args.scrape_interval, args.max_batch)
        print(json.dumps(result, indent=2))
        return
    app, service = build_app(ServerConfig(index_dir=index_dir, ui=args.ui, max_batch=args.max_batch))
    with serving(app) as url:
        run_load(url, images, args.clients, min(32, args.searches), args.k, args.time_limit)  # warm-up
        result = run_load(url, images, args.clients, args.searches, args.k, args.time_limit)
    result |= {"index": service.describe(), "batcher": service.current().batcher.stats()}
    service.close()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
