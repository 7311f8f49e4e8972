"""What the gallery commands share: the index folder (INDEX_DIR or ``--index``), the option groups of the index writers
(reading and embedding, the Ray engine, ``--gallery-root``), running a writer under the command line's names, and
how a command ends (one line and the next command, or the summary as JSON). No command here."""

from __future__ import annotations

import contextlib
import functools
import json
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from retrieval.cli.config_options import command_option, command_options, config_options
from retrieval.cli.errors import option_flag, option_message, option_text
from retrieval.cli.index_options import ENGINE, INGEST, IndexOptions
from retrieval.cli.options import apply_options
from retrieval.gallery_option import GalleryRoot
from retrieval.utils.printable import printable_path
from retrieval.utils.sizes import size_text

F = TypeVar("F", bound=Callable)


def index_folder(command: F) -> F:
    """The index folder of an ``index`` subcommand: INDEX_DIR, or ``--index`` as ``search`` and ``serve`` name it."""

    @functools.wraps(command)
    def run(*args: Any, index_dir: str | None = None, index_flag: str | None = None, **kwargs: Any) -> Any:
        if index_dir is not None and index_flag is not None and Path(index_dir).resolve() != Path(index_flag).resolve():
            raise click.UsageError(f"two index folders given, {index_dir} and --index {index_flag}: give one")
        if index_dir is None and index_flag is None:
            raise click.UsageError("give the index folder: INDEX_DIR (or --index INDEX_DIR)")
        return command(*args, index_dir=index_dir if index_dir is not None else index_flag, **kwargs)

    run = command_option(IndexOptions, "index_flag")(run)
    # an argument, not an option: the folder given first, as `retrieval index stats INDEX`
    return click.argument("index_dir", type=click.Path(file_okay=False, exists=True), required=False)(run)


json_option = command_options(IndexOptions, "as_json")  # --json: the whole summary as JSON
# how the index writers read and embed images: --batch-size, --workers, --shard-size, --max-pixels, --gpu
ingest_options = command_options(IndexOptions, *INGEST)


def engine_options(func: F) -> F:
    """--engine and the Ray cluster options, collected into one ``engine`` dict argument."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        kwargs["engine"] = {name: kwargs.pop(name) for name in ENGINE}
        return func(*args, **kwargs)

    return command_options(IndexOptions, *ENGINE)(wrapper)


def gallery_root_option(func: F) -> F:
    """--gallery-root, as ``GalleryRoot`` declares it."""
    return apply_options(func, config_options(GalleryRoot))


def ingest_settings(batch_size: int, workers: int | None, shard_size: int, max_pixels: int | None,
                    engine: dict | None = None) -> Any:
    """The writers' ``IngestOptions`` from the command line's values (the Ray ones from ``engine_options``)."""
    from retrieval.data.decode import DEFAULT_MAX_PIXELS
    from retrieval.index.embedding.engine import IngestOptions, RayOptions

    engine = engine or {}
    ray = None
    if engine.get("engine") == "ray":
        ray = RayOptions(address=engine["ray_address"], actors=engine["ray_actors"],
                         gpus_per_actor=engine["ray_gpus_per_actor"], cpus_per_actor=engine["ray_cpus_per_actor"])
    return IngestOptions(batch_size=batch_size, workers=workers, shard_size=shard_size,
                         max_pixels=max_pixels or DEFAULT_MAX_PIXELS, engine=engine.get("engine", "local"), ray=ray)


# RayOptions' fields, which the command line's options name ray_<field>
RAY_FIELDS = ("address", "actors", "gpus_per_actor", "cpus_per_actor")


def run_writer(command: Callable[..., dict], index_dir: str, *args: Any, **kwargs: Any) -> dict:
    """Run an index writer (``build_index``, ``add_images``, ``repair_index``, ``upgrade_index``) under the command
    line's names: the Ray options are ``--ray-*``, an error that another command fixes ends with that command, and
    what reaches stdout while it runs goes to stderr (Ray forwards its workers' and raylet's lines to the driver's
    stdout, which holds only the command's result: its --json)."""
    from retrieval.errors import ParameterError
    from retrieval.index.writing.records import FinishedIndexError, LabelRuleMismatch, NothingToRepairError

    folder = shlex.quote(str(index_dir))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            summary = command(*args, **kwargs)
        return labels_hint_shown(summary)
    except ParameterError as exc:
        if exc.param in RAY_FIELDS:
            raise exc.renamed(f"ray_{exc.param}") from exc
        if not isinstance(exc, LabelRuleMismatch):
            raise
        context = click.get_current_context()
        raise click.ClickException(f"{option_message(context.command, exc)}: retrieval index repair {folder} "
                                   f"--label-from {exc.given}") from exc
    except FinishedIndexError as exc:
        raise click.ClickException(f"{exc} (`retrieval index add {folder} --images ...`, or another --out; to "
                                   f"re-embed it with another model: `retrieval index upgrade {folder} --model "
                                   "NEW.onnx`)") from exc
    except NothingToRepairError as exc:
        raise click.ClickException(f"{exc}: `retrieval index build --model ... --images ... --out {folder}`") from exc


def finish(summary: dict, as_json: bool, line: str, next_step: str | None = None) -> None:
    """How an index command ends: one line for people and the next command to run, or the summary as JSON."""
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
        return
    click.echo(line)
    if next_step:
        click.echo(f"next: {next_step}")


def problems(errors: int, duplicates: int) -> str:
    """The images a writer could not read or skipped, for its one line."""
    return f"{errors} could not be read, {duplicates} duplicates skipped"


def labels_hint_shown(summary: dict) -> dict:
    """``summary`` with its labels' hint (a manifest without labels: the column that looks like them) in this
    command's words (--label-column); left out on a command that cannot take that option (`index add` reads the
    index's own column)."""
    labels = summary.get("labels") if isinstance(summary, dict) else None
    if not isinstance(labels, dict) or not labels.get("hint"):
        return summary
    command = click.get_current_context().command
    if option_flag(command, "label_column") is None:
        labels.pop("hint")
    else:
        labels["hint"] = option_text(command, labels["hint"])
    return summary


def labels_text(summary: dict) -> str:
    """The index's labels, for a writer's one line (a manifest without labels: why, and the fix)."""
    labels = summary.get("labels") or {}
    if not labels.get("classes"):
        return f"no labels: {labels['hint']}" if labels.get("hint") else "no labels"
    column = labels.get("label_column")
    if column is not None:  # hostile folders: the name as text, bounded
        return f"{labels['classes']} classes from the manifest's {printable_path(column, 64)} column"
    return f"{labels['classes']} classes by --label-from {labels['from']}"


def serve_next(index_dir: str) -> str:
    """The next command after an index is written: serve it, or search it."""
    return f"retrieval serve --index {index_dir}   (or: retrieval search --index {index_dir} IMAGE)"


def one_line(text: str | None) -> str:
    """A reason on one printable line (an exception's text may span several, or quote a hostile name)."""
    from retrieval.index.sources import printable_path

    return printable_path(" ".join((text or "unknown error").split()))


def budget_text(budget: dict | None) -> str:
    """What the budgets chose and measured, for the one-line summaries of build and stats."""
    if not budget:
        return ""
    parts = []
    if budget.get("max_index_memory") is not None:
        parts.append(f"about {size_text(budget['estimated_bytes'])} of --max-index-memory "
                     f"{size_text(budget['max_index_memory'])}")
    if budget.get("max_query_ms") is not None:
        met = "within" if budget.get("latency_met") else "OVER"
        parts.append(f"{budget['latency_ms']:.2f} ms per query, {met} --max-query-ms {budget['max_query_ms']:g}")
    return "; " + ", ".join(parts)
