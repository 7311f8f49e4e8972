"""Each server setting is declared once (``ServerConfig``'s fields); ``retrieval serve``'s options, their checks and
docs/SERVING.md's table are made from the declarations, and what the command line is given reaches the server."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from retrieval.cli.doc_tables import reference_tables
from retrieval.cli.main import main
from retrieval.cli.serve import COMMAND_FORMS, serve_command
from retrieval.options import declared_options, hint_members
from retrieval.serve.config import MIB, ServerConfig
from retrieval.serve.defaults import API_TOKEN_ENV

DECLARED = declared_options(ServerConfig)
ON_THE_COMMAND_LINE = [d for d in DECLARED if d.spec.command_line]
TOKEN = "t0ken-for-the-tests-0123456789"


@pytest.fixture
def captured_serve(monkeypatch) -> list[ServerConfig]:
    """`retrieval serve` with a serve() that only records the configuration it was given."""
    import retrieval.serve.server

    configs: list[ServerConfig] = []
    monkeypatch.setattr(retrieval.serve.server, "serve", lambda config: configs.append(config))
    monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    return configs


@pytest.fixture
def index_dir(tmp_path) -> Path:
    """A folder the command takes for an index (it only checks that index.json is there before serving)."""
    folder = tmp_path / "index"
    folder.mkdir()
    (folder / "index.json").write_text("{}")
    return folder


def invoke(index_dir: Path, *args: str) -> click.testing.Result:
    """``retrieval serve --index INDEX_DIR ARGS``."""
    return CliRunner().invoke(serve_command, ["--index", str(index_dir), *args])


def test_serve_is_the_commands_serve():
    assert main.commands["serve"] is serve_command


def test_every_field_is_declared_with_a_section_and_help():
    assert [d.name for d in DECLARED] == [f.name for f in dataclasses.fields(ServerConfig)]
    assert all(d.spec.section and d.spec.help.endswith(".") for d in DECLARED), [d.name for d in DECLARED
                                                                                  if not d.spec.help.endswith(".")]


def test_the_command_has_one_option_per_declared_field_and_nothing_else():
    """A field is either made into its option or set by the command's own option of another form (COMMAND_FORMS),
    at the flag its declaration names; every option of the command sets a field."""
    params = {p.name: p for p in serve_command.params if isinstance(p, click.Option)}
    assert set(params) == {d.name for d in DECLARED}
    assert set(COMMAND_FORMS) == {d.name for d in DECLARED if not d.spec.command_line}
    for declared in DECLARED:
        assert declared.flag in params[declared.name].opts, declared.name


def test_the_flags_the_command_had_are_all_there():
    flags = {opt for p in serve_command.params for opt in [*p.opts, *getattr(p, "secondary_opts", [])]}
    assert {"--index", "--report", "--results", "--host", "--port", "--max-upload-mb", "--max-pixels",
            "--concurrency", "--max-batch", "--max-wait-ms", "--reload-interval", "--no-ui", "--token-file",
            "--auth-file", "--insecure", "--cors-origin", "--allowed-host", "--forwarded-allow-ips", "--upload-dir",
            "--upload-max-age", "--upload-cache-mb", "--log-level", "--log-format"} <= flags
    assert "--api-token" not in flags  # a secret on the command line is shown by `ps` to every user


def test_without_options_the_server_gets_the_declared_defaults(captured_serve, index_dir):
    result = invoke(index_dir)
    assert result.exit_code == 0, result.output
    assert captured_serve[-1] == ServerConfig(index_dir=index_dir)


def _cli_samples(declared, tmp_path: Path) -> list[tuple[list[str], object]]:
    """Command-line arguments that set ``declared`` (an option made from its declaration) to a value other than
    its default, and that value."""
    members = [m for m in hint_members(declared.hint) if m is not type(None)]
    flag, default, spec = declared.flag, declared.default, declared.spec
    if members == [bool]:
        return [([flag if not default else f"--no-{flag[2:]}"], not default)]
    if typing.get_origin(members[0]) is tuple:
        return [([flag, "https://a.example", flag, "b.example"], ("https://a.example", "b.example"))]
    if members[0] is Path:
        folder = tmp_path / "given"
        folder.mkdir(exist_ok=True)
        if declared.name == "index_dir":
            (folder / "index.json").write_text("{}")
        given = folder if spec.path == "dir" else folder / "file.json"
        return [([flag, str(given)], given)]
    allowed = spec.allowed()
    if allowed is not None:
        return [([flag, value], value) for value in allowed if value != default]
    if members[0] in (int, float):
        kind = members[0]
        low = spec.low if spec.low is not None else 0
        numbers = [(default or low) * 2, (default or 0) + 1, low + 1, (low + (spec.high or low + 1)) / 2]
        return [([flag, str(kind(n))], kind(n)) for n in numbers if kind(n) != default]
    if declared.name in TOGETHER:  # options that go together are given together, with values they accept
        values = TOGETHER[declared.name](tmp_path)
        return [([flag, value, *partner], value) for value, partner in values]
    return [([flag, text], text) for text in ("localhost", "127.0.0.1") if text != default]


# an option refused alone or with a value of another form: the values to give it, each with its partner
TOGETHER = {
    "milvus": lambda tmp: [(str(tmp / "gallery.db"), ["--collection", "gallery"]),
                           ("http://127.0.0.1:19530", ["--collection", "gallery"])],
    "collection": lambda tmp: [(name, ["--milvus", str(tmp / "gallery.db")]) for name in ("gallery", "Catalogue_2")],
}


@pytest.mark.parametrize("declared", ON_THE_COMMAND_LINE, ids=[d.name for d in ON_THE_COMMAND_LINE])
def test_every_declared_option_reaches_the_server_from_the_command_line(declared, captured_serve, index_dir,
                                                                        tmp_path):
    samples = _cli_samples(declared, tmp_path)
    assert samples, declared.name
    for args, expected in samples:
        result = invoke(index_dir, *args)
        assert result.exit_code == 0, (args, result.output)
        assert getattr(captured_serve[-1], declared.name) == expected, args


def test_the_options_of_another_form_reach_the_server_converted(captured_serve, index_dir, tmp_path):
    """Each COMMAND_FORMS entry: the token and the logins read from their files, MiB counted in bytes."""
    token_file, auth_file = tmp_path / "token", tmp_path / "logins"
    token_file.write_text(TOKEN + "\n")
    auth_file.write_text("# logins\nalice:correct horse\n")
    given = {"api_token": (["--token-file", str(token_file)], TOKEN),
             "ui_auth": (["--auth-file", str(auth_file)], [("alice", "correct horse")]),
             "max_upload_bytes": (["--max-upload-mb", "2.5"], int(2.5 * MIB)),
             "upload_cache_bytes": (["--upload-cache-mb", "3"], 3 * MIB)}
    assert set(given) == set(COMMAND_FORMS)
    for name, (args, expected) in given.items():
        result = invoke(index_dir, *args)
        assert result.exit_code == 0, (args, result.output)
        assert getattr(captured_serve[-1], name) == expected, name


def test_the_token_comes_from_the_environment_without_a_file(captured_serve, index_dir, monkeypatch):
    monkeypatch.setenv(API_TOKEN_ENV, TOKEN)
    result = invoke(index_dir)
    assert result.exit_code == 0, result.output
    assert captured_serve[-1].api_token == TOKEN


def test_zero_turns_the_reload_off(captured_serve, index_dir):
    result = invoke(index_dir, "--reload-interval", "0")
    assert result.exit_code == 0, result.output
    assert not captured_serve[-1].reload_interval_s


RANGED = [d for d in DECLARED if d.spec.low is not None or d.spec.high is not None]


def _outside(declared) -> list[float]:
    spec = declared.spec
    values = [spec.low - 1 if spec.low is not None else None, spec.high + 1 if spec.high is not None else None,
              spec.low if spec.low_open else None, spec.high if spec.high_open else None]
    return [value for value in values if value is not None]


@pytest.mark.parametrize("declared", RANGED, ids=[d.name for d in RANGED])
def test_a_value_outside_the_declared_range_is_refused_by_flag(declared, captured_serve, index_dir):
    kind = int if int in hint_members(declared.hint) else float
    message = f"{declared.flag} must be {declared.spec.range_text()}"
    for value in _outside(declared):
        with pytest.raises(ValueError, match=re.escape(message)):
            ServerConfig(index_dir=index_dir, **{declared.name: kind(value)})
        result = invoke(index_dir, declared.flag, str(kind(value)))
        assert result.exit_code == 2 and message in result.output, (value, result.output)
    assert not captured_serve


def test_the_other_forms_keep_their_ranges(captured_serve, index_dir):
    result = invoke(index_dir, "--upload-cache-mb", "0.5")
    assert result.exit_code == 2 and "--upload-cache-mb" in result.output
    assert not captured_serve


CHOOSING = [d for d in DECLARED if d.spec.choices is not None]


@pytest.mark.parametrize("declared", CHOOSING, ids=[d.name for d in CHOOSING])
def test_a_value_outside_the_declared_choices_is_refused_by_flag(declared, captured_serve, index_dir):
    with pytest.raises(ValueError, match=re.escape(f"{declared.flag} must be one of")):
        ServerConfig(index_dir=index_dir, **{declared.name: "no-such-choice"})
    result = invoke(index_dir, declared.flag, "no-such-choice")
    assert result.exit_code == 2 and declared.flag in result.output
    assert not captured_serve


def test_a_wrong_type_is_named_by_flag(index_dir):
    with pytest.raises(ValueError, match="--port must be a whole number"):
        ServerConfig(index_dir=index_dir, port="80")
    with pytest.raises(ValueError, match="--auth-file must be a list of"):
        ServerConfig(index_dir=index_dir, ui_auth=["alice:secret"])


def test_loose_values_are_read_as_the_declared_type(index_dir):
    config = ServerConfig(index_dir=str(index_dir), cors_origins=["https://app.example/"], allowed_hosts=["a"])
    assert config.index_dir == index_dir and config.cors_origins == ("https://app.example",)
    assert config.allowed_hosts == ("a",)


def test_the_serving_docs_have_the_options_table():
    assert ("docs/SERVING.md", "serve-options", ServerConfig) in reference_tables()
