"""One process, one port: the HTTP API with the Gradio app mounted at ``/``, run by uvicorn."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI

from serve.api import create_api
from serve.defaults import (
    DEFAULT_HOST,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_PORT,
    DEFAULT_RESULTS,
)
from serve.service import SearchService
from serve.ui import UI_CSS, build_ui

UI_PATH = "/"
GRADIO_CONCURRENCY = 4  # Gradio events running at once; more wait in its queue
GRADIO_QUEUE = 64


@dataclass
class ServerConfig:
    index_dir: Path
    report: Path | None = None
    results: Path | None = DEFAULT_RESULTS
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    concurrency: int = 8
    max_queue: int = 64
    max_batch: int = 32
    max_wait_ms: float = 5.0
    ui: bool = True


UI_CONNECTIONS = 32  # the browser's own connections (page, assets, Gradio queue) on top of the API's


def build_app(config: ServerConfig, service: SearchService | None = None) -> tuple[FastAPI, SearchService]:
    """The FastAPI app (API routes first, then the Gradio UI at ``/``) and the service behind it."""
    service = service or SearchService(
        config.index_dir,
        max_batch=config.max_batch,
        max_wait_ms=config.max_wait_ms,
        max_upload_bytes=config.max_upload_bytes,
        max_pixels=config.max_pixels,
    )
    app = create_api(service, concurrency=config.concurrency, max_queue=config.max_queue)
    if config.ui:
        blocks, example_dir = build_ui(service, config.report, results=config.results)
        blocks.queue(default_concurrency_limit=GRADIO_CONCURRENCY, max_size=GRADIO_QUEUE)
        app = gr.mount_gradio_app(
            app,
            blocks,
            path=UI_PATH,
            allowed_paths=[str(example_dir)],
            max_file_size=config.max_upload_bytes,
            css=UI_CSS,
            server_name=config.host,
            server_port=config.port,
        )
    return app, service


def serve(config: ServerConfig) -> None:
    """Block serving until interrupted (Ctrl-C)."""
    app, service = build_app(config)
    print(
        f"serving {service.describe()['vectors']} images from {config.index_dir}: UI and API on "
        f"http://{config.host}:{config.port}/ (API docs at /docs)",
        flush=True,
    )
    try:
        # Request bodies are read before the search queue: cap the connections in flight so that the memory
        # held by uploads is bounded too (beyond it uvicorn answers 503).
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning",
                    limit_concurrency=config.concurrency + config.max_queue + UI_CONNECTIONS)
    finally:
        service.close()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class BackgroundServer:
    """uvicorn in a thread on a loopback port (tests and the load benchmark)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host, self.port = host, port or free_port(host)
        self.server = uvicorn.Server(uvicorn.Config(app, host=self.host, port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
