"""``retrieval serve``: the search API and the Gradio UI on one port (``python app.py`` runs the same)."""

from __future__ import annotations

from pathlib import Path

import click

from retrieval.cli.errors import OptionCommand
from retrieval.index.live import RELOAD_INTERVAL_S
from retrieval.serve.defaults import (
    API_TOKEN_ENV,
    DEFAULT_HOST,
    DEFAULT_INDEX_DIR,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_PORT,
    DEFAULT_REPORT,
    DEFAULT_RESULTS,
    DEFAULT_UPLOAD_CACHE_BYTES,
    DEFAULT_UPLOAD_MAX_AGE_S,
    LOG_FORMATS,
    LOG_LEVELS,
    MIN_TOKEN_CHARS,
    PUBLIC_PATHS,
    missing_artifacts_message,
)


@click.command("serve", cls=OptionCommand)
@click.option(
    "--index",
    "index_dir",
    type=click.Path(file_okay=False),
    default=None,
    help=f"index folder (`retrieval index build`); default: {DEFAULT_INDEX_DIR} from `make demo`.",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help=f"report.json of `retrieval train`/`evaluate` for the Evaluation tab; default: {DEFAULT_REPORT} "
    "when serving the default index.",
)
@click.option(
    "--results",
    type=click.Path(dir_okay=False),
    default=None,
    help=f"results grid (retrieval results run) for the Results tab; default: {DEFAULT_RESULTS.name} of this "
    "project when serving the default (demo) index. Without one the tab is left out.",
)
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="interface to bind (loopback by default). Any other host needs --token-file (and --auth-file unless "
    "--no-ui), or --insecure.",
)
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--max-upload-mb",
    default=DEFAULT_MAX_UPLOAD_BYTES / 2**20,
    show_default=True,
    type=float,
    help="largest accepted image upload (larger: HTTP 413).",
)
@click.option(
    "--max-pixels",
    default=DEFAULT_MAX_PIXELS,
    show_default=True,
    type=int,
    help="largest accepted image in pixels (decompression-bomb guard, HTTP 400).",
)
@click.option(
    "--concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(1, 256),
    help="API searches running at once; more wait in a queue.",
)
@click.option(
    "--max-batch",
    default=32,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="largest micro-batch of query images embedded together.",
)
@click.option(
    "--max-wait-ms",
    default=5.0,
    show_default=True,
    type=click.FloatRange(0, 1000),
    help="how long a micro-batch waits for more queries that are already on their way.",
)
@click.option(
    "--reload-interval",
    default=RELOAD_INTERVAL_S,
    show_default=True,
    type=click.FloatRange(0, 3600),
    help="seconds between checks of the index folder: once a writer (`retrieval index add/remove/...`) finishes, "
    "the server swaps in the new index without a restart; 0 turns it off.",
)
@click.option("--no-ui", is_flag=True, help="serve the HTTP API only.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help=f"file whose first line is the bearer token every API call must send (`Authorization: Bearer TOKEN`; "
    f"{', '.join(PUBLIC_PATHS)} stays open for load balancers); at least {MIN_TOKEN_CHARS} characters. Or set "
    f"{API_TOKEN_ENV}. Never on the command line: `ps` shows it to every user.",
)
@click.option(
    "--auth-file",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="file of `user:password` lines (blank lines and # comments skipped): the Gradio app asks for one of "
    "these logins. Keep it readable by you only (chmod 600).",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="serve a non-loopback --host without authentication (anyone who reaches the port can search).",
)
@click.option(
    "--cors-origin",
    "cors_origins",
    multiple=True,
    metavar="ORIGIN",
    help="another web origin (e.g. https://app.example.com) whose pages may call this server from a browser; "
    "repeatable. Requests from any other origin get 403.",
)
@click.option(
    "--allowed-host",
    "allowed_hosts",
    multiple=True,
    metavar="NAME",
    help="a host name clients reach the server by (e.g. search.example.com, the name nginx passes on); "
    "repeatable. localhost and IP addresses are always answered; any other Host header gets 400 (a web page "
    "could otherwise point its own name at this server: DNS rebinding).",
)
@click.option(
    "--forwarded-allow-ips",
    default=None,
    metavar="IPS",
    help="the proxy in front of the server (comma-separated IP addresses or networks, e.g. 127.0.0.1 for "
    "deploy/nginx.conf on this machine): from it the client address (access log) and scheme are taken from "
    "X-Forwarded-For/-Proto. Default: no proxy, those headers are ignored (any client could forge them).",
)
@click.option(
    "--upload-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="the Gradio app's upload and cache folder, this server's alone (its old files are deleted); default: a "
    "new private folder per start, removed at exit.",
)
@click.option(
    "--upload-max-age",
    default=DEFAULT_UPLOAD_MAX_AGE_S,
    show_default=True,
    type=click.FloatRange(1, None),
    help="seconds an uploaded or cached file is kept.",
)
@click.option(
    "--upload-cache-mb",
    default=DEFAULT_UPLOAD_CACHE_BYTES / 2**20,
    show_default=True,
    type=click.FloatRange(1, None),
    help="the upload folder's size bound; beyond it the oldest files are deleted.",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS),
    default="info",
    show_default=True,
    help="the server's log lines on stderr: info adds one access-log line per request (request id, method, route, "
    "status, milliseconds, client; never bodies or tokens).",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="json: one object per line (for a log shipper).",
)
def serve_command(
    index_dir, report, results, host, port, max_upload_mb, max_pixels, concurrency, max_batch, max_wait_ms,
    reload_interval, no_ui, token_file, auth_file, insecure, cors_origins, allowed_hosts, forwarded_allow_ips,
    upload_dir, upload_max_age, upload_cache_mb, log_level, log_format,
) -> None:
    """Search service: HTTP API (POST /search, /items/{id}, /stats, /health, /metrics) and the Gradio UI at /."""
    from retrieval.serve.security import ConfigError, check_exposure, read_api_token, read_auth_file, readable_by_others
    from retrieval.serve.server import ServerConfig, serve

    try:
        api_token = read_api_token(token_file)
        ui_auth = read_auth_file(auth_file) if auth_file else None
        check_exposure(host, api_token, ui_auth, not no_ui, insecure)  # before anything loads
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    for secrets_file in (token_file, auth_file):
        if secrets_file and readable_by_others(secrets_file):
            click.echo(f"warning: {secrets_file} is readable by other users; `chmod 600 {secrets_file}`", err=True)

    if index_dir is None:  # the demo: its run report and this project's results grid belong to it
        index_dir = DEFAULT_INDEX_DIR
        if report is None and DEFAULT_REPORT.is_file():
            report = DEFAULT_REPORT
        if results is None and DEFAULT_RESULTS.is_file():
            results = DEFAULT_RESULTS
    index_path = Path(index_dir)
    if not (index_path / "index.json").is_file():
        raise click.ClickException(missing_artifacts_message(index_path))
    config = ServerConfig(
        index_dir=index_path,
        report=Path(report) if report else None,
        results=Path(results) if results else None,
        host=host,
        port=port,
        max_upload_bytes=int(max_upload_mb * 2**20),
        max_pixels=max_pixels,
        concurrency=concurrency,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        reload_interval_s=reload_interval or None,
        ui=not no_ui,
        api_token=api_token,
        ui_auth=ui_auth,
        insecure=insecure,
        cors_origins=tuple(origin.rstrip("/") for origin in cors_origins),
        allowed_hosts=tuple(allowed_hosts),
        forwarded_allow_ips=forwarded_allow_ips,
        upload_dir=Path(upload_dir) if upload_dir else None,
        upload_max_age_s=upload_max_age,
        upload_cache_bytes=int(upload_cache_mb * 2**20),
        log_level=log_level,
        log_format=log_format,
    )
    try:
        serve(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
