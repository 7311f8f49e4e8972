"""A Milvus Lite server in its own process: the Milvus API on a loopback port, reached over HTTP as a cluster is
(a Milvus Lite file can be opened by one process only; a server is shared by many). ``LiteServer`` can be stopped
and started again on the same port and data, as a Milvus restart is."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from serve_fixtures import free_port

from retrieval.index.milvus.milvus_collection import MilvusPlace, connect


class LiteServer:
    """``milvus-lite server`` over ``data_dir`` on one loopback port: ``start()``, ``stop()``, ``start()`` again."""

    def __init__(self, data_dir: Path, ready_s: float = 60) -> None:
        self.data_dir, self.ready_s = data_dir, ready_s
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        """Start it and wait until it answers; its URI."""
        self.process = subprocess.Popen(
            [str(Path(sys.executable).with_name("milvus-lite")), "server", "--data-dir", str(self.data_dir),
             "--host", "127.0.0.1", "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.ready_s
        while True:
            try:
                client = connect(MilvusPlace.checked(self.uri, "probe"), timeout_s=2)
                client.list_collections()
                client.close()
                return self.uri
            except Exception:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.5)

    def stop(self) -> None:
        """Stop it (its data stays in ``data_dir``)."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        self.process = None


@contextlib.contextmanager
def milvus_lite_server(data_dir: Path, ready_s: float = 60) -> Iterator[str]:
    """Start ``milvus-lite server`` on a free port, wait until it answers, yield its URI; stopped on exit."""
    server = LiteServer(data_dir, ready_s)
    server.start()
    try:
        yield server.uri
    finally:
        server.stop()
