"""Measuring a server under attack: ``ServerProcess`` (``retrieval serve`` in a process of its own, its memory read
from /proc) and ``HealthProbe`` (GET /health polled from a thread). Both only record: the test asserts what they
measured in its own thread, since an assert inside a helper thread does not fail pytest."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from serve_fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]


def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024


class ServerProcess:
    """``retrieval serve`` on a loopback port in a process of its own, for the time of a ``with`` block."""

    def __init__(self, index_dir: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "retrieval", "serve", "--index", str(index_dir), "--port",
                        str(self.port), "--reload-interval", "0", *args]
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        # its log goes to a file: a pipe nobody reads fills up, and then every log line blocks the server
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=self.log,
                                        env=os.environ | {"PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"the server did not start: {self.stderr()[-3000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def stderr(self) -> str:
        """What the server has logged so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def rss_mb(self) -> float:
        """Resident memory now."""
        return _status_mb(self.process.pid, "VmRSS")

    def reset_peak(self) -> float:
        """Restart the peak (VmHWM) from the memory held now, which it returns."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")
        return self.rss_mb()

    def peak_mb(self) -> float:
        """The most resident memory since the last ``reset_peak``."""
        return _status_mb(self.process.pid, "VmHWM")


class HealthProbe:
    """Polls ``GET /health`` every ``interval_s`` from a thread; ``latencies`` (seconds, a failed or timed-out probe
    counts as ``timeout_s``) and ``failures`` are read once the ``with`` block has ended."""

    def __init__(self, url: str, interval_s: float = 0.05, timeout_s: float = 30.0) -> None:
        self.url, self.interval_s, self.timeout_s = url, interval_s, timeout_s
        self.latencies: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    status = client.get(f"{self.url}/health").status_code
                    if status != 200:
                        self.failures.append(f"HTTP {status}")
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                self.latencies.append(time.monotonic() - started)
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 5)

    @property
    def worst(self) -> float:
        """The slowest answer (or failure) seen."""
        return max(self.latencies, default=float("inf"))
