"""A Milvus Lite server in its own process: the Milvus API on a loopback port, reached over HTTP as a cluster is
(a Milvus Lite file can be opened by one process only; a server is shared by many)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from serve_fixtures import free_port

from retrieval.index.milvus_collection import MilvusPlace, connect


@contextlib.contextmanager
def milvus_lite_server(data_dir: Path, ready_s: float = 60) -> Iterator[str]:
    """Start ``milvus-lite server`` on a free port, wait until it answers, yield its URI; stopped on exit."""
    port = free_port()
    process = subprocess.Popen([str(Path(sys.executable).with_name("milvus-lite")), "server", "--data-dir",
                                str(data_dir), "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    try:
        while True:
            try:
                connect(MilvusPlace.checked(uri, "probe"), timeout_s=2).close()
                break
            except Exception:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise
                time.sleep(0.5)
        yield uri
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
