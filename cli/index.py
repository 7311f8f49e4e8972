"""`retrieval index`: the group of the gallery-index commands, gathered from the modules that hold them by job, and the
two gallery commands that stand beside it on the command line (``retrieval.cli.main`` adds them there).

- writing (``retrieval.cli.index_write``): `index build`, `index add`, `index remove`, `index repair`;
- a new model (``retrieval.cli.index_upgrade``): `index upgrade`, `index compare`, and `retrieval compare`;
- reading (``retrieval.cli.index_inspect``): `index stats`, `index export`;
- searching by text (``retrieval.cli.index_text``): `index text`, the text model `search --text` and `serve` use;
- what answers show (``retrieval.cli.index_columns``): `index columns`, the display columns (a title, a price);
- Milvus (``retrieval.cli.index_milvus``): `index push`, and the collection kept in step by `add`, `remove`, `upgrade`;
- searching (``retrieval.cli.search``): `retrieval search`;
- curation (``retrieval.cli.curation``, added by ``retrieval.cli.main``): `index duplicates`, `index audit`.

Their options are declared once, in ``retrieval.cli.index_options``.
"""

from __future__ import annotations

import sys

import click

from retrieval.cli.errors import OptionGroup
from retrieval.cli.index_columns import columns_command
from retrieval.cli.index_inspect import export_command, stats_command
from retrieval.cli.index_milvus import push_command
from retrieval.cli.index_text import text_command
from retrieval.cli.index_upgrade import compare_command, index_compare_command, upgrade_command
from retrieval.cli.index_write import add_command, build_command, remove_command, repair_command
from retrieval.cli.search import search_command

__all__ = ["compare_command", "index_group", "search_command"]


@click.group("index", cls=OptionGroup)
def index_group() -> None:
    """Build, update and inspect a gallery index (faiss + SQLite catalogue)."""


for _command in (build_command, add_command, upgrade_command, index_compare_command, remove_command, repair_command,
                 stats_command, export_command, push_command, text_command, columns_command):
    index_group.add_command(_command)

if __name__ == "__main__":
    sys.exit(index_group())
