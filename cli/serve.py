"""``retrieval serve``: the search API and the Gradio UI on one port (``python app.py`` runs the same).

The options are made from ``ServerConfig``'s declarations (serve/config.py); the few fields the command line takes
in another form are ``COMMAND_FORMS``: each one's option and its conversion into the field.
"""

from __future__ import annotations

import functools
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from retrieval.cli.config_options import click_option, default_text, option_values
from retrieval.cli.errors import OptionCommand
from retrieval.cli.options import apply_options
from retrieval.options import declared_options
from retrieval.serve.config import MIB, ServerConfig
from retrieval.serve.defaults import DEFAULT_INDEX_DIR, DEFAULT_REPORT, DEFAULT_RESULTS, missing_artifacts_message
from retrieval.serve.exposure import (
    ConfigError,
    check_exposure,
    read_api_token,
    read_auth_file,
    readable_by_others,
)

DECLARED = {declared.name: declared for declared in declared_options(ServerConfig)}


@dataclass(frozen=True)
class CommandForm:
    """A ``ServerConfig`` field declared ``command_line=False``: the command's own option for it (at the declared
    flag, with the declared help) and how that option's value becomes the field's."""

    option: Callable
    convert: Callable[[Any], Any]  # the option's value (None when not given) -> the field's (None: its default)


def own_option(name: str, **attrs: Any) -> Callable:
    """The click option, made by hand, of field ``name``: its declared flag and help, with ``attrs`` for the form."""
    declared = DECLARED[name]
    shown = default_text(declared)
    return click.option(declared.flag, name, help=declared.spec.help + (f" [default: {shown}]" if shown else ""),
                        **attrs)


def mib_to_bytes(mib: float | None) -> int | None:
    """MiB as the command line takes them -> bytes as the server counts them."""
    return None if mib is None else int(mib * MIB)


def read_logins(path: str | None) -> list[tuple[str, str]] | None:
    """The Gradio app's logins from ``--auth-file``, or None when it is not given."""
    return read_auth_file(path) if path else None


SECRET_FILE = click.Path(dir_okay=False, exists=True)
COMMAND_FORMS: dict[str, CommandForm] = {
    # a secret never on the command line itself: `ps` shows every process's arguments to every user
    "api_token": CommandForm(own_option("api_token", type=SECRET_FILE), read_api_token),  # None: the environment's
    "ui_auth": CommandForm(own_option("ui_auth", type=SECRET_FILE), read_logins),
    # people count uploads and caches in MiB, the server in bytes
    "max_upload_bytes": CommandForm(own_option("max_upload_bytes", type=float), mib_to_bytes),
    "upload_cache_bytes": CommandForm(own_option("upload_cache_bytes", type=click.FloatRange(1, None)),
                                      mib_to_bytes),
}
SERVE_OPTIONS = [click_option(declared) if declared.spec.command_line else COMMAND_FORMS[name].option
                 for name, declared in DECLARED.items()]


def server_values(options: dict[str, Any]) -> dict[str, Any]:
    """The options given as ``ServerConfig`` field values (the others are left to its defaults)."""
    plain = {name: value for name, value in options.items() if name not in COMMAND_FORMS}
    values = option_values(ServerConfig, {}, plain)
    for name, form in COMMAND_FORMS.items():
        if (value := form.convert(options.get(name))) is not None:
            values[name] = value
    return values


@click.command("serve", cls=OptionCommand)
@functools.partial(apply_options, options=SERVE_OPTIONS)
def serve_command(**options: Any) -> None:
    """Search service: HTTP API (POST /search, /items/{id}, /stats, /health, /metrics) and the Gradio UI at /."""
    try:
        values = server_values(options)
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if "milvus" in values and "index_dir" not in values:  # the collection is served: no folder
        values["index_dir"] = Path(str(values.get("collection") or ""))
    if "index_dir" not in values:  # the demo: its run report and this project's results grid belong to it
        values["index_dir"] = DEFAULT_INDEX_DIR
        if "report" not in values and DEFAULT_REPORT.is_file():
            values["report"] = DEFAULT_REPORT
        if "results" not in values and DEFAULT_RESULTS.is_file():
            values["results"] = DEFAULT_RESULTS
    try:
        config = ServerConfig(**values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        check_exposure(config.host, config.api_token, config.ui_auth, config.ui, config.insecure)  # before loading
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    for secrets_file in (options.get("api_token"), options.get("ui_auth")):
        if secrets_file and readable_by_others(secrets_file):
            click.echo(f"warning: {secrets_file} is readable by other users; `chmod 600 {secrets_file}`", err=True)

    from retrieval.index.query_embedder import ModelMismatchError
    from retrieval.index.searchable.opening import index_place

    if index_place(config.index_dir, config.milvus, config.collection).is_missing():  # a folder without index.json
        raise click.ClickException(missing_artifacts_message(config.index_dir))
    from retrieval.serve.server import serve  # Gradio and uvicorn: only once the settings are known to be good

    try:
        serve(config)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc
    except ModelMismatchError as exc:  # --model is not the index's, nor declared compatible with it
        raise click.ClickException(f"{exc}: retrieval index upgrade {shlex.quote(str(config.index_dir))} --model "
                                   f"{shlex.quote(str(config.model))}") from exc
