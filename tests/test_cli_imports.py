"""What the command line loads and sets up: no torch unless a command trains or embeds, every data set registered on
import of the catalogue, the library's notices on stderr."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap

import click
import pytest
from click.testing import CliRunner
from retrieval.cli.main import main


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize(
    "statement",
    [
        "import retrieval.cli.main",
        "from retrieval.train import TrainConfig; TrainConfig.from_sources(epochs=2).to_dict()",
    ],
)
def test_the_command_line_and_the_train_config_load_no_torch(statement):
    out = run_fresh(f"""
        import sys
        {statement}
        print(sorted(name for name in sys.modules if name.split(".")[0] in ("torch", "torchvision")))
    """)
    assert out.strip() == "[]", f"{statement!r} imported {out.strip()}"


def test_help_of_every_command_loads_no_torch():
    """``retrieval --help`` and every (sub)command's ``--help``, one after the other in one fresh process."""
    out = run_fresh("""
        import contextlib, io, json, sys
        import click
        from retrieval.cli.main import main

        def command_paths(group, prefix=()):
            for name, command in sorted(group.commands.items()):
                yield (*prefix, name)
                if isinstance(command, click.Group):
                    yield from command_paths(command, (*prefix, name))

        report = {"(import)": {"code": 0, "usage": True, "torch": "torch" in sys.modules}}
        for path in [(), *command_paths(main)]:
            shown = io.StringIO()
            with contextlib.redirect_stdout(shown):
                code = main.main([*path, "--help"], prog_name="retrieval", standalone_mode=False)
            report[" ".join(path)] = {"code": code, "usage": shown.getvalue().startswith("Usage: retrieval"),
                                      "torch": "torch" in sys.modules}
        print(json.dumps(report))
    """)
    report = json.loads(out)
    assert {"", "train", "evaluate", "index build", "search", "serve", "export", "data prepare"} <= set(report)
    assert all(entry["code"] == 0 and entry["usage"] for entry in report.values()), report
    loading = [path or "--help" for path, entry in report.items() if entry["torch"]]
    assert not loading, f"torch was imported first by: {loading[0]}"


def test_the_catalogue_lists_every_data_set_on_import():
    """The loaders register themselves when imported: ``retrieval.data.catalog`` imports them all, so its ``DATASETS``
    is complete without going through the package's lazy names (it was empty before)."""
    first, complete = json.loads(run_fresh("""
        import json
        from retrieval.data.catalog import DATASETS
        first = DATASETS.names()
        from retrieval.data import builtin, emoji, official  # every loader module
        print(json.dumps([first, DATASETS.names()]))
    """))
    assert first == complete
    assert {"folder", "csv", "cub", "cars196", "sop", "inshop", "emoji", "fashion-mnist", "digits"} <= set(first)


@pytest.fixture
def noisy_command():
    """A command that reports one notice per level through the library's loggers."""

    @main.command("noisy")
    def noisy() -> None:
        log = logging.getLogger("retrieval.noisy")
        log.debug("a debug notice")
        log.info("an info notice")
        log.warning("a warning")
        click.echo("the output")

    yield "noisy"
    del main.commands["noisy"]


@pytest.mark.parametrize(
    ("options", "shown"),
    [([], ["an info notice", "a warning"]), (["-v"], ["a debug notice", "an info notice", "a warning"]),
     (["--quiet"], ["a warning"])],
)
def test_notices_go_to_stderr_as_plain_lines_at_the_chosen_level(noisy_command, options, shown):
    logger = logging.getLogger("retrieval")
    handlers, level = list(logger.handlers), logger.level
    result = CliRunner().invoke(main, [*options, noisy_command])
    assert result.exit_code == 0, result.output
    assert result.stdout == "the output\n"
    assert result.stderr.splitlines() == shown
    assert (logger.handlers, logger.level) == (handlers, level)  # set up for the command only
