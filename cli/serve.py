"""``retrieval serve``: the search API and the Gradio UI on one port (``python app.py`` runs the same)."""

from __future__ import annotations

from pathlib import Path

import click

from serve.defaults import (
    DEFAULT_HOST,
    DEFAULT_INDEX_DIR,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MAX_UPLOAD_BYTES,
    DEFAULT_PORT,
    DEFAULT_REPORT,
    DEFAULT_RESULTS,
    missing_artifacts_message,
)


@click.command("serve")
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
    default=str(DEFAULT_RESULTS),
    show_default=True,
    help="results grid (benchmarks/quality.py) for the Results tab.",
)
@click.option(
    "--host", default=DEFAULT_HOST, show_default=True, help="interface to bind (loopback by default)."
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
@click.option("--no-ui", is_flag=True, help="serve the HTTP API only.")
def serve_command(
    index_dir, report, results, host, port, max_upload_mb, max_pixels, concurrency, max_batch, max_wait_ms, no_ui
) -> None:
    """Search service: HTTP API (POST /search, /items/{id}, /stats, /health) and the Gradio UI at /."""
    from serve.server import ServerConfig, serve

    if index_dir is None:
        index_dir = DEFAULT_INDEX_DIR
        if report is None and DEFAULT_REPORT.is_file():
            report = DEFAULT_REPORT
    index_path = Path(index_dir)
    if not (index_path / "index.json").is_file():
        raise click.ClickException(missing_artifacts_message(index_path))
    if report is not None and not Path(report).is_file():
        raise click.ClickException(
            f"report {report} not found (`retrieval train` writes RUN_DIR/report.json)"
        )
    serve(
        ServerConfig(
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
            ui=not no_ui,
        )
    )
