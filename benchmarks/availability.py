"""Availability under attack, on loopback: /health's worst answer, an ordinary search's time and the server's peak
memory while one client (or many) sends what used to freeze the server. docs/SECURITY.md "Availability" has the
results and the exact commands.

    python benchmarks/availability.py --url http://127.0.0.1:7860 --pid PID --attack nested-json

Attacks (each bounded in time, loopback only; each attacking client sends from a loopback address of its own):
  nested-json     one 42 MB body of nested empty arrays to POST /search/batch, repeated by 2 clients
  abandoned       8 clients send 64 copies of a 16-megapixel lossless WebP each and hang up after 3 s
  big-png         8 clients send 64 x 40-megapixel PNGs each and wait for their answer
  waiting-json    16 clients send 43 MB JSON batches at once (base64 images)
  big-answers     8 clients ask 64 embeddings x k=1000 at once
  gradio-bodies   32 clients send 1 MiB Gradio call bodies (nested arrays) to /gradio_api/queue/join
  rerank-abandoned  8 clients send 8-embedding batches re-ranked by kreciprocal (1,000 candidates, k1 = k2 = 100)
                  and hang up after 3 s
  rerank-batches  8 clients send 64-embedding batches re-ranked by dba (1,000 candidates, k = 100) and wait
  dba-searches    8 clients send single searches re-ranked by dba (1,000 candidates, k = 100) and wait
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

MB = 2**20


def webp_16mp() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4000, 4000), (20, 120, 220)).save(buffer, format="WEBP", lossless=True)
    return buffer.getvalue()


def png_40mp() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (6324, 6324), (200, 30, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


def noise_png(side: int = 400, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=0)
    return buffer.getvalue()


def nested_json(size: int) -> bytes:
    return b'{"queries": [' + b",".join([b"[[[]]]"] * (size // 7)) + b"]}"


def gradio_nested(size: int) -> bytes:
    return b'{"data": [' + b",".join([b"[[[]]]"] * (size // 7)) + b'], "fn_index": 0, "session_hash": "x"}'


class Attack:
    """Clients each running ``one(client)`` in a loop until ``seconds`` have passed; counts what they got."""

    def __init__(self, clients: int, seconds: float, one: Callable[[httpx.Client], str]) -> None:
        self.clients, self.seconds, self.one = clients, seconds, one
        self.outcomes: dict[str, int] = {}
        self._lock = threading.Lock()

    def _client(self, number: int, deadline: float) -> None:
        # each client from a loopback address of its own (127.0.0.2, ...), as distinct clients would come: a server
        # that bounds what one address may hold sees eight of them, not one
        address = f"127.0.0.{2 + number % 250}"
        while time.monotonic() < deadline:
            transport = httpx.HTTPTransport(local_address=address)
            with httpx.Client(timeout=httpx.Timeout(60.0), transport=transport) as client:
                try:
                    outcome = self.one(client)
                except httpx.TimeoutException:
                    outcome = "hung up"
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
            with self._lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def run(self) -> None:
        deadline = time.monotonic() + self.seconds
        threads = [threading.Thread(target=self._client, args=(number, deadline), daemon=True)
                   for number in range(self.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.seconds + 120)


def attack(url: str, name: str, seconds: float, clients: int | None = None) -> Attack:
    """The named attack against ``url``, not yet run."""
    if name == "nested-json":
        body = nested_json(42 * MB)
        return Attack(clients or 2, seconds, lambda c: str(c.post(
            f"{url}/search/batch", content=body, headers={"content-type": "application/json"}).status_code))
    if name == "abandoned":
        files = [("image", ("q.webp", webp_16mp(), "image/webp"))] * 64

        def hang_up(client: httpx.Client) -> str:
            return str(client.post(f"{url}/search/batch", files=files, timeout=3.0).status_code)

        return Attack(clients or 8, seconds, hang_up)
    if name == "big-png":
        files = [("image", ("q.png", png_40mp(), "image/png"))] * 64
        return Attack(clients or 8, seconds, lambda c: str(c.post(f"{url}/search/batch", files=files).status_code))
    if name == "waiting-json":
        image = base64.b64encode(noise_png()).decode()
        body = json.dumps({"queries": [{"image": image}] * 64}).encode()
        return Attack(clients or 16, seconds, lambda c: str(c.post(
            f"{url}/search/batch", content=body, headers={"content-type": "application/json"}).status_code))
    if name == "big-answers":
        dim = httpx.get(f"{url}/health").json()["embedding_dim"]
        queries = [{"embedding": np.random.default_rng(i).normal(size=dim).tolist()} for i in range(64)]
        return Attack(clients or 8, seconds, lambda c: str(c.post(
            f"{url}/search/batch?k=1000", json={"queries": queries}).status_code))
    if name == "gradio-bodies":
        body = gradio_nested(MB - 64)
        return Attack(clients or 32, seconds, lambda c: str(c.post(
            f"{url}/gradio_api/queue/join", content=body, headers={"content-type": "application/json"}).status_code))
    if name in RERANKED:
        queries, rerank, timeout = RERANKED[name]
        dim = httpx.get(f"{url}/health").json()["embedding_dim"]
        rows = np.random.default_rng(3).normal(size=(queries, dim))
        if name == "dba-searches":
            route, body = "/search?k=10", {"embedding": rows[0].tolist(), "rerank": rerank}
        else:
            route, body = "/search/batch?k=10", {"queries": [{"embedding": r.tolist()} for r in rows], "rerank": rerank}
        return Attack(clients or 8, seconds, lambda c: str(c.post(f"{url}{route}", json=body,
                                                                   timeout=timeout).status_code))
    raise SystemExit(f"unknown attack {name!r}")


COSTLIEST_KRECIPROCAL = {"method": "kreciprocal", "candidates": 1000, "k1": 100, "k2": 100}
COSTLIEST_DBA = {"method": "dba", "candidates": 1000, "k": 100}
RERANKED = {"rerank-abandoned": (8, COSTLIEST_KRECIPROCAL, 3.0), "rerank-batches": (64, COSTLIEST_DBA, 60.0),
            "dba-searches": (1, COSTLIEST_DBA, 60.0)}  # queries, re-ranking, the client's timeout
ATTACKS = ("nested-json", "abandoned", "big-png", "waiting-json", "big-answers", "gradio-bodies", *RERANKED)


def timed_requests(send: Callable[[httpx.Client], httpx.Response], every_s: float, stop: threading.Event,
                   times: list[float], failures: list[str]) -> None:
    """``send`` every ``every_s`` until ``stop``, as a well-behaved client would: each time to the answer recorded
    (a failure counts its time too)."""
    with httpx.Client(timeout=120) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                status = send(client).status_code
                if status != 200:
                    failures.append(f"HTTP {status}")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            times.append(time.monotonic() - started)
            stop.wait(every_s)


def measure(url: str, pid: int | None, name: str, seconds: float, clients: int | None = None) -> dict:
    """Run one attack while /health and an ordinary search are timed; the server's peak memory from /proc."""
    load = attack(url, name, seconds, clients)
    dim = httpx.get(f"{url}/health").json()["embedding_dim"]
    vector = np.random.default_rng(1).normal(size=dim).tolist()
    idle = peak = None
    if pid is not None:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        idle = _status_mb(pid, "VmRSS")
    stop = threading.Event()
    health: tuple[list[float], list[str]] = ([], [])
    search: tuple[list[float], list[str]] = ([], [])
    probes = [threading.Thread(target=timed_requests, args=(lambda c: c.get(f"{url}/health"), 0.05, stop, *health)),
              threading.Thread(target=timed_requests, args=(
                  lambda c: c.post(f"{url}/search?k=5", json={"embedding": vector}), 0.5, stop, *search))]
    for probe in probes:
        probe.start()
    started = time.monotonic()
    load.run()
    elapsed = time.monotonic() - started
    stop.set()
    for probe in probes:
        probe.join(130)
    if pid is not None:
        peak = _status_mb(pid, "VmHWM")
    return {"attack": name, "seconds": round(elapsed, 1), "outcomes": load.outcomes,
            "health_worst_s": round(max(health[0], default=float("inf")), 3), "health_failures": len(health[1]),
            "search_worst_s": round(max(search[0], default=float("inf")), 3), "searches": len(search[0]),
            "search_failures": search[1][:3], "peak_up_mb": None if idle is None else round(peak - idle)}


def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, help="the server's process id (its peak memory is read from /proc)")
    parser.add_argument("--attack", choices=(*ATTACKS, "all"), default="all")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int)
    args = parser.parse_args()
    for name in ATTACKS if args.attack == "all" else (args.attack,):
        print(json.dumps(measure(args.url, args.pid, name, args.seconds, args.clients)), flush=True)
        time.sleep(3)


if __name__ == "__main__":
    main()
