"""One process, one port: the HTTP API with the Gradio app mounted at ``/``, run by uvicorn."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import gradio as gr
import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.routing import Mount
from starlette.types import Scope

from retrieval.index.query_embedder import load_model
from retrieval.index.searchable.opening import index_place
from retrieval.serve.admission import LengthRequired
from retrieval.serve.api import create_api
from retrieval.serve.collector import freeze_after_startup
from retrieval.serve.config import ServerConfig
from retrieval.serve.defaults import PUBLIC_PATHS
from retrieval.serve.exposure import ConfigError, check_exposure
from retrieval.serve.observability import configure_logging, outermost
from retrieval.serve.report_files import load_report
from retrieval.serve.routes import leaf_routes
from retrieval.serve.security import (
    AllowedHosts,
    BearerToken,
    LoginRequired,
    SafePageHeaders,
    SameOriginOnly,
    request_cookies,
)
from retrieval.serve.service import SearchService
from retrieval.serve.ui import UI_CSS, build_ui
from retrieval.serve.upload_cache import (
    GRADIO_API_PREFIX,
    UploadedFilesOnly,
    UploadPruner,
    UploadRecords,
    lock_file_access,
    use_upload_folder,
)

log = logging.getLogger(__name__)

UI_PATH = "/"
GRADIO_CONCURRENCY = 4  # Gradio events running at once; more wait in its queue
GRADIO_QUEUE = 64


UI_CONNECTIONS = 32  # the browser's own connections (page, assets, Gradio queue) on top of the API's


def build_app(config: ServerConfig, service: SearchService | None = None) -> tuple[FastAPI, SearchService]:
    """The FastAPI app (API routes first, then the Gradio UI at ``/``) and the service behind it.

    Refuses (serve.exposure.ExposureError) a non-loopback host without authentication unless ``insecure``.
    """
    check_exposure(config.host, config.api_token, config.ui_auth, config.ui, config.insecure)
    check_report(config.report)
    service = service or SearchService(
        index_place(config.index_dir, config.milvus, config.collection),
        embedder=load_model(config.model) if config.model is not None else None,
        max_batch=config.max_batch,
        max_wait_ms=config.max_wait_ms,
        max_upload_bytes=config.max_upload_bytes,
        max_pixels=config.max_pixels,
        reload_interval_s=config.reload_interval_s,
        gallery_root=config.gallery_root,
        text_model=config.text_model,
    )
    app = create_api(service, concurrency=config.concurrency, max_queue=config.max_queue, observe=config.observe)
    # The token covers every route of the API app (the JSON API, its OpenAPI document, /docs and its assets) but
    # PUBLIC_PATHS; the Gradio app mounted below has its own login.
    api_routes = [route for route in leaf_routes(app.routes) if getattr(route, "path", None) not in PUBLIC_PATHS]

    def is_api_call(path: str) -> bool:
        return any(route.path_regex.match(path) for route in api_routes)

    if config.ui:
        upload_dir = use_upload_folder(config.upload_dir)  # before the Blocks exist: they read it when built
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
            auth=config.ui_auth or None,
            show_error=False,  # only gr.Error messages reach the client: other errors name server paths
            footer_links=["settings"],  # no "Use via API" to Gradio's internal API: the page links our JSON API docs
        )
        lock_file_access(blocks)
        UploadPruner(blocks, upload_dir, config.upload_max_age_s, config.upload_cache_bytes,
                     config.upload_prune_interval_s).attach(app)
        app.add_middleware(UploadedFilesOnly, records=UploadRecords(blocks), max_upload_bytes=config.max_upload_bytes)
        if config.ui_auth:
            app.add_middleware(LoginRequired, logged_in=gradio_login_check(app), protected=is_gradio_action)
    # Outermost last: host check, origin check, then CORS (answers preflights, so a 401 still carries its headers),
    # then the token.
    if config.api_token:
        app.add_middleware(BearerToken, token=config.api_token, protected=is_api_call)
    # The parent's own CORSMiddleware: Gradio then adds none of its own (see gr.mount_gradio_app).
    app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])
    app.add_middleware(SameOriginOnly, allowed=config.cors_origins, events_prefix=GRADIO_API_PREFIX)
    app.add_middleware(AllowedHosts, bind_host=config.host, allowed_names=config.allowed_hosts)
    app.add_middleware(LengthRequired)  # a chunked body is refused before uvicorn parses its chunks on the loop
    app.add_middleware(SafePageHeaders)  # outside the security layers: their refusals carry the headers too
    outermost(app)  # the request log and metrics in front of all: what the layers above refuse is counted too
    freeze_after_startup(app)  # a full garbage collection then walks only what requests allocate
    return app, service


def check_report(report: Path | None) -> None:
    """Refuse (ConfigError) a ``--report`` that is not a run report: its folder is what the page may open. A value
    the page leaves out of it (a number too large to read) is a warning that names its file and field."""
    if report is None:
        return
    try:
        opened = load_report(report)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--report: {exc}") from exc
    for problem in opened.problems:
        log.warning("--report %s: %s", report, problem)


def is_gradio_action(method: str, path: str) -> bool:
    """Every POST to the Gradio app's API (events, uploads, cancel, reset): none may run without the login."""
    return method == "POST" and path.startswith(GRADIO_API_PREFIX)


def gradio_login_check(app: FastAPI) -> Callable[[Scope], bool]:
    """Whether a request carries the login cookie of the Gradio app mounted in ``app``, as Gradio's own
    ``get_current_user`` reads it. Refuses to serve (RuntimeError) if this Gradio version keeps logins elsewhere."""
    gradio_app = next(route.app for route in app.routes if isinstance(route, Mount) and hasattr(route.app, "tokens"))
    cookie_id, tokens = getattr(gradio_app, "cookie_id", None), getattr(gradio_app, "tokens", None)
    if not isinstance(cookie_id, str) or not isinstance(tokens, dict):
        raise RuntimeError(f"gradio {gr.__version__} keeps its logins in another form; refusing to serve without "
                           "a login check on its cancel/reset routes (pin the gradio version in pyproject.toml)")

    def logged_in(scope: Scope) -> bool:
        cookies = request_cookies(scope)
        token = cookies.get(f"access-token-{cookie_id}") or cookies.get(f"access-token-unsecure-{cookie_id}")
        return token is not None and tokens.get(token) is not None

    return logged_in


def serve(config: ServerConfig) -> None:
    """Block serving until interrupted (Ctrl-C)."""
    app, service = build_app(config)
    described = service.describe()
    text = described["text_model"]
    text_line = (f"text search on: text model {text['text_model_path']} (text_model_hash {text['text_model_hash']})"
                 if text is not None else "text search off: " + (described.get("text_model_problem") or
                                                                 "no text model (--text-model TEXT.onnx, or "
                                                                 "`retrieval index text`)"))
    print(
        f"serving {described['vectors']} images from "
        f"{service.place}: UI and API on "
        f"http://{config.host}:{config.port}/ (API docs at /docs)\n{config.access_summary()}\n{text_line}",
        flush=True,
    )
    # uvicorn shuts down gracefully on SIGTERM, then raises the signal again: as SystemExit, so that the
    # `finally` below and the atexit hooks (the private upload folder is removed) still run.
    signal.signal(signal.SIGTERM, lambda signum, _: sys.exit(128 + signum))
    restore_logging = configure_logging(config.log_level, config.log_format)
    try:
        # Request bodies are read before the search queue: cap the connections in flight so that the memory
        # held by uploads is bounded too (beyond it uvicorn answers 503).
        # uvicorn logs through our handler (log_config=None) and without its access log: ours has the request id
        # Forwarded headers only from the proxies the operator named: uvicorn's default trusts them from 127.0.0.1
        uvicorn.run(app, host=config.host, port=config.port, log_level=uvicorn_level(config.log_level),
                    log_config=None, access_log=False, limit_concurrency=connection_limit(config),
                    proxy_headers=config.forwarded_allow_ips is not None,
                    forwarded_allow_ips=config.forwarded_allow_ips)
    finally:
        service.close()
        restore_logging()


def uvicorn_level(level: str) -> str:
    """uvicorn's own level: its start-up lines at info repeat our start message, so info shows its warnings."""
    return "warning" if level == "info" else level


def connection_limit(config: ServerConfig) -> int:
    """Connections uvicorn keeps open at once (beyond them it answers 503): the API's and the browser's."""
    return config.concurrency + config.max_queue + UI_CONNECTIONS
