"""The index subcommands name the index folder as ``search`` and ``serve`` do (``--index``) or positionally."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import QUICK
from sample_images import write_images

from retrieval.cli.main import main
from retrieval.index import build_index


@pytest.fixture(scope="module")
def small_index(tmp_path_factory):
    root = tmp_path_factory.mktemp("folder_option")
    write_images(root / "g" / "a", 4)
    build_index(root / "g", root / "idx", embedder=FakeEmbedder(), options=QUICK)
    return root / "idx"


@pytest.mark.parametrize("command", ["stats", "export", "remove", "repair", "add", "upgrade", "compare", "duplicates",
                                     "audit"])
def test_every_index_subcommand_takes_the_index_as_search_names_it(command):
    help_text = CliRunner().invoke(main, ["index", command, "--help"]).output
    assert "--index INDEX_DIR" in help_text and "[INDEX_DIR]" in help_text


def test_index_flag_and_positional_folder_give_the_same_answer(small_index):
    positional = CliRunner().invoke(main, ["index", "stats", str(small_index), "--queries", "3", "--json"])
    flagged = CliRunner().invoke(main, ["index", "stats", "--index", str(small_index), "--queries", "3", "--json"])
    assert positional.exit_code == 0 and flagged.exit_code == 0, positional.output + flagged.output
    assert json.loads(positional.output)["vectors"] == json.loads(flagged.output)["vectors"] == 4


def test_no_index_folder_or_two_different_ones_are_usage_errors(small_index, tmp_path):
    missing = CliRunner().invoke(main, ["index", "stats"])
    assert missing.exit_code == 2 and "give the index folder" in missing.output
    tmp_path.joinpath("other").mkdir()
    both = CliRunner().invoke(main, ["index", "stats", str(small_index), "--index", str(tmp_path / "other")])
    assert both.exit_code == 2 and "two index folders given" in both.output
    same = CliRunner().invoke(main, ["index", "stats", str(small_index), "--index", str(small_index), "--queries", "3"])
    assert same.exit_code == 0, same.output
