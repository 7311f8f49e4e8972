"""An index command's stdout holds its result only: what reaches stdout while a writer runs (Ray forwards its workers'
and raylet's lines to the driver's stdout, e.g. "(raylet) A worker died ...") goes to stderr, so --json parses."""

from __future__ import annotations

import json
import sys

import click
from click.testing import CliRunner

from retrieval.cli.index_common import finish, run_writer


def printing_writer(index_dir: str) -> dict:
    print("(raylet) A worker died or was killed while executing a task")  # as Ray's log thread does: sys.stdout
    sys.stdout.write("(pid=1234) a worker's own line\n")
    return {"index_dir": index_dir, "images": 3}


@click.command()
@click.option("--json", "as_json", is_flag=True)
def write(as_json: bool) -> None:
    summary = run_writer(printing_writer, "idx", "idx")
    finish(summary, as_json, f"{summary['images']} images indexed")


def test_a_writers_stdout_lines_go_to_stderr_and_the_json_alone_to_stdout():
    result = CliRunner().invoke(write, ["--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"index_dir": "idx", "images": 3}
    assert "(raylet) A worker died" in result.stderr and "(pid=1234)" in result.stderr


def test_the_line_for_people_stays_on_stdout():
    result = CliRunner().invoke(write, [])
    assert result.stdout == "3 images indexed\n" and "(raylet)" in result.stderr
