"""`--where` on the command line: a filter that does not parse and one naming a column the index lacks are both a
bad value of the option (exit 2, click's usage error), and a filter matching nothing says how values compare."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from retrieval.cli.main import main


def where_commands() -> list[str]:
    """Every command of `retrieval` that takes --where, by its full name."""
    found = []

    def walk(command, names: list[str]) -> None:
        if any(getattr(p, "name", None) == "where" for p in command.params):
            found.append(" ".join(names))
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*names, name])

    walk(main, [])
    return found


def test_search_is_the_command_that_takes_where():
    """The tests below cover every command with --where; a new one must join them."""
    assert where_commands() == ["search"]


@pytest.mark.parametrize(("where", "problem"), [
    ('label == "x"', "compare with one '=', not '=='"),
    ("colour = 'red'", "no column 'colour' in this index; the columns are: id, path, label"),
])
def test_a_bad_filter_is_a_usage_error_that_names_the_problem(artifacts, where, problem):
    result = CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "--where", where,
                                       str(artifacts.query_paths[0])])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--where': " in result.output and problem in result.output, result.output
    assert "Traceback" not in result.output and "FilterError" not in result.output, result.output


def test_a_filter_matching_nothing_says_how_paths_and_labels_compare(artifacts):
    from retrieval.index import Index

    with Index.open(artifacts.index_dir) as index:
        indexed, path = len(index), index.filter_table.example("path")
    result = CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "--where",
                                       f'label = "{artifacts.labels[0].upper()}x" or path = "/no/such.png"',
                                       str(artifacts.query_paths[0])])
    assert result.exit_code == 0, result.output
    assert f"--where matches 0 of {indexed} indexed images" in result.output, result.output
    assert "relative to the gallery" in result.output and f'path = "{path}"' in result.output, result.output
    assert "labels exactly" in result.output, result.output


def test_a_filter_matching_some_images_gives_no_hint(artifacts):
    result = CliRunner().invoke(main, ["search", "--index", str(artifacts.index_dir), "--where",
                                       f'label = "{artifacts.labels[0]}"', str(artifacts.query_paths[0])])
    assert result.exit_code == 0, result.output
    assert "--where matches " in result.output and "relative to the gallery" not in result.output, result.output
