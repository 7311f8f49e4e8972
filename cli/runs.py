"""`retrieval runs compare RUN...`: training runs side by side (``retrieval.analysis.runs``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from retrieval.cli.errors import OptionGroup


@click.group("runs", cls=OptionGroup)
def runs_group() -> None:
    """Look at training runs (the folders `retrieval train --out` wrote)."""


@runs_group.command("compare")
@click.argument("runs", nargs=-1, required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--out", "png", type=click.Path(dir_okay=False, path_type=Path), default=Path("runs-compare.png"),
              show_default=True, help="the PNG of the learning curves side by side.")
@click.option("--json", "as_json", is_flag=True, help="print the comparison as JSON (for programs).")
def compare_command(runs: tuple[Path, ...], png: Path, as_json: bool) -> None:
    """Compare runs: the configuration that differs, the final metrics, and one PNG of their learning curves."""
    from retrieval.analysis.runs import comparison, format_table, load_run, plot_curves, unique_names

    loaded = [load_run(path) for path in runs]
    unique_names(loaded)
    plot_curves(loaded, png)
    if as_json:
        click.echo(json.dumps({**comparison(loaded), "plot": str(png)}, indent=2))
        return
    click.echo(format_table(loaded))
    click.echo(f"\nlearning curves: {png}")
