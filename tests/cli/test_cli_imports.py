"""What the command line loads and sets up: no torch unless a command trains or embeds, every data set registered on
import of the catalogue, the library's notices on stderr."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from retrieval.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
# Runs first in the fresh process: on the first import of torch, it notes which lines of ours led to it and prints
# them (JSON, null for none) as the last line of stdout.
TORCH_TRIPWIRE = f"""
import atexit, json, sys, traceback

class TorchTripwire:
    chain = None

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and TorchTripwire.chain is None:
            TorchTripwire.chain = [f"{{frame.filename[len({str(ROOT)!r}) + 1:]}}:{{frame.lineno}}"
                                   for frame in traceback.extract_stack() if frame.filename.startswith({str(ROOT)!r})]
        return None

sys.meta_path.insert(0, TorchTripwire())
atexit.register(lambda: print(json.dumps(TorchTripwire.chain)))
"""


def run_fresh(code: str) -> tuple[str, list[str] | None]:
    """Run ``code`` in a fresh interpreter: its stdout, and the lines of ours that first imported torch (or None)."""
    result = subprocess.run([sys.executable, "-c", TORCH_TRIPWIRE + textwrap.dedent(code)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    out, _, chain = result.stdout.rstrip("\n").rpartition("\n")
    return out, json.loads(chain)


@pytest.mark.parametrize(
    "statement",
    [
        "import retrieval.cli.main",
        "from retrieval.train import TrainConfig; TrainConfig.from_sources(epochs=2).to_dict()",
        "from retrieval.data import prepare_emoji",  # `retrieval data prepare emoji` renders without torch
    ],
)
def test_the_command_line_and_what_its_light_commands_use_load_no_torch(statement):
    _, chain = run_fresh(statement)
    assert chain is None, f"{statement!r} imported torch through " + " -> ".join(chain)


# Help that lists what torch modules register (the backbones, the losses) may import torch to show it; no other may.
HELP_MAY_IMPORT_TORCH = {"train"}


def test_help_of_every_command_loads_no_torch():
    """``retrieval --help`` and every (sub)command's ``--help``, one after the other in one fresh process (those of
    ``HELP_MAY_IMPORT_TORCH`` last)."""
    out, chain = run_fresh(f"""
        import contextlib, io, json, sys
        import click
        from retrieval.cli.main import main

        def command_paths(group, prefix=()):
            for name, command in sorted(group.commands.items()):
                yield (*prefix, name)
                if isinstance(command, click.Group):
                    yield from command_paths(command, (*prefix, name))

        report = {{"(import)": {{"code": 0, "usage": True, "torch": "torch" in sys.modules}}}}
        for path in sorted([(), *command_paths(main)], key=lambda path: " ".join(path) in {HELP_MAY_IMPORT_TORCH!r}):
            shown = io.StringIO()
            with contextlib.redirect_stdout(shown):
                code = main.main([*path, "--help"], prog_name="retrieval", standalone_mode=False)
            report[" ".join(path)] = {{"code": code, "usage": shown.getvalue().startswith("Usage: retrieval"),
                                       "torch": "torch" in sys.modules}}
        print(json.dumps(report))
    """)
    report = json.loads(out)
    assert {"", "train", "evaluate", "index build", "search", "serve", "export", "data prepare"} <= set(report)
    assert all(entry["code"] == 0 and entry["usage"] for entry in report.values()), report
    loading = [path or "--help" for path, entry in report.items()
               if entry["torch"] and path not in HELP_MAY_IMPORT_TORCH]
    assert not loading, f"{loading[0]} imported torch through " + " -> ".join(chain)


def test_the_catalogue_lists_every_data_set_on_import():
    """The loaders register themselves when imported: ``retrieval.data.catalog`` imports them all, so its ``DATASETS``
    is complete without going through the package's lazy names (it was empty before)."""
    out, _ = run_fresh("""
        import json
        from retrieval.data.catalog import DATASETS
        first = DATASETS.names()
        from retrieval.data import builtin, emoji, official  # every loader module
        print(json.dumps([first, DATASETS.names()]))
    """)
    first, complete = json.loads(out)
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
        logging.getLogger("another.library").info("another library's info")  # keeps its level (WARNING)
        click.echo("the output")

    yield "noisy"
    del main.commands["noisy"]


@pytest.mark.parametrize(
    ("options", "shown"),
    [([], ["an info notice", "a warning"]), (["-v"], ["a debug notice", "an info notice", "a warning"]),
     (["--quiet"], ["a warning"])],
)
def test_notices_go_to_stderr_as_plain_lines_at_the_chosen_level(noisy_command, options, shown):
    root, library = logging.getLogger(), logging.getLogger("retrieval")
    before = (list(root.handlers), library.level)
    result = CliRunner().invoke(main, [*options, noisy_command])
    assert result.exit_code == 0, result.output
    assert result.stdout == "the output\n"
    assert result.stderr.splitlines() == shown
    assert (root.handlers, library.level) == before  # set up for the command only


WEB_STACK = ("starlette", "fastapi", "gradio", "uvicorn", "httpx")


def test_the_command_line_and_training_load_no_web_stack():
    """A training machine may lack the web stack: with its packages unimportable in a fresh process, the command line
    imports, ``train --help`` and ``index --help`` work, and the serving defaults read without the service."""
    code = f"""
        import sys
        sys.modules.update(dict.fromkeys({list(WEB_STACK)!r}))
        from retrieval.cli.main import main
        from retrieval.serve.defaults import DEFAULT_INDEX_DIR
        for path in (["train"], ["index"], ["evaluate"]):
            assert main.main([*path, "--help"], prog_name="retrieval", standalone_mode=False) == 0
        print(sorted(m for m in sys.modules if m.split(".")[0] in {list(WEB_STACK)!r} and sys.modules[m]))
    """
    out, _ = run_fresh(code)
    assert out.rstrip().endswith("[]")
