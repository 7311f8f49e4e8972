"""`retrieval results run|report`: the results grid (``retrieval.train.grid_runner``), which writes docs/results.json
(the app's Results tab), its figures, and the generated parts of docs/RESULTS.md (the prose around them is kept).

    retrieval results run                          # the whole grid, 1.5-2 h in one process on 2 cores
    retrieval results run --shard 0/2 &            # or in two processes (about 80 min here), then
    retrieval results run --shard 1/2; wait
    retrieval results report                       # ... writes the documents from the finished runs
    retrieval results run --tables loop,symm --seeds 0,1,2 --runs artifacts/quality

Run it from the repository's root: the run folders and the data paths in the documents are written relative to it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from retrieval.analysis.results import RESULTS_COMMAND
from retrieval.cli.errors import OptionGroup
from retrieval.cli.options import apply_options
from retrieval.serve.defaults import DEFAULT_RESULTS, DEMO_DIR

DEFAULT_RUNS = Path("artifacts/quality")
DEFAULT_SEEDS = (0, 1, 2)


def _words(values: tuple[str, ...]) -> list[str]:
    """Repeated and comma-separated values alike: ``--tables loop,symm`` = ``--tables loop --tables symm``."""
    return [word for value in values for word in value.split(",") if word]


GRID_OPTIONS = [
    click.option("--tables", multiple=True, metavar="ID[,ID...]",
                 help="only these tables, by id (default: all; an unknown id lists them)."),
    click.option("--seeds", multiple=True, metavar="S[,S...]", help="seeds of every cell (default: 0,1,2)."),
    click.option("--datasets", multiple=True, metavar="KEY[,KEY...]",
                 help="only these datasets (default: each table's own)."),
    click.option("--runs", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_RUNS, show_default=True,
                 help="run folders, one per cell and seed."),
    click.option("--emoji-data", type=click.Path(file_okay=False, path_type=Path), default=DEMO_DIR / "data" / "emoji",
                 show_default=True, help="rendered emoji data (made here when missing; `make demo` uses the same "
                                         "folder)."),
    click.option("--feature-cache", help="backbone feature cache (default ~/.cache/retrieval/features)."),
    click.option("--markdown", type=click.Path(dir_okay=False, path_type=Path),
                 default=DEFAULT_RESULTS.parent / "RESULTS.md",
                 help="the Markdown document whose generated parts (between its `<!-- results: ID -->` markers) "
                      "are rewritten; its prose is kept (default: docs/RESULTS.md)."),
    click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=DEFAULT_RESULTS,
                 help="the results JSON, the app's Results tab (default: docs/results.json)."),
    click.option("--figures", type=click.Path(file_okay=False, path_type=Path),
                 default=DEFAULT_RESULTS.parent / "results", help="folder of the figures (default: docs/results)."),
    click.option("--cells", multiple=True, metavar="PATTERN",
                 help="only cells whose folder name matches one of these shell patterns (repeatable)."),
    click.option("--skip-cells", multiple=True, metavar="PATTERN",
                 help="leave out cells whose folder name matches one of these patterns, e.g. '*sinkhorn*' "
                      "(repeatable)."),
]


def grid_options(func):
    return apply_options(func, GRID_OPTIONS)


@click.group("results", cls=OptionGroup)
def results_group() -> None:
    """The results grid: do the papers' methods help on real images available offline?"""


@results_group.command("run", needs="train")
@grid_options
@click.option("--list", "list_runs", is_flag=True, help="print each run's command and whether it is done.")
@click.option("--shard", default="0/1", show_default=True, metavar="K/N",
              help="run only every N-th run from the K-th (e.g. 0/2 and 1/2 in two processes, one per core); writes "
                   "no documents: run `retrieval results report` afterwards to write them.")
@click.option("--threads", type=click.IntRange(min=1), help="torch threads (default: torch's own; 1 with --shard).")
def run_command(list_runs: bool, shard: str, threads: int | None, **options) -> None:
    """Train every cell not yet finished (resumable), then write the documents."""
    try:
        part = tuple(int(v) for v in shard.split("/"))
        if len(part) != 2 or not 0 <= part[0] < part[1]:
            raise ValueError
    except ValueError:
        raise click.BadParameter(f"must be K/N with 0 <= K < N, got {shard!r}", param_hint="--shard") from None
    threads = threads or (1 if part[1] > 1 else None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    run_grid_command(train=True, list_runs=list_runs, shard=part, **options)


@results_group.command("report")
@grid_options
def report_command(**options) -> None:
    """Train nothing: write the documents from the finished runs (a cell needs all its seeds)."""
    run_grid_command(train=False, **options)


def run_grid_command(tables: tuple[str, ...], seeds: tuple[str, ...], datasets: tuple[str, ...], runs: Path,
                     emoji_data: Path, feature_cache: str | None, markdown: Path, json_path: Path, figures: Path,
                     cells: tuple[str, ...], skip_cells: tuple[str, ...], train: bool, list_runs: bool = False,
                     shard: tuple[int, int] = (0, 1)) -> None:
    """What ``run`` and ``report`` share: choose the tables, then list, run a shard, or run and write."""
    from retrieval.analysis.grid import TABLE_IDS, TABLES, default_datasets
    from retrieval.train.grid_runner import finished_report, plan, run_grid, train_command

    table_ids = _words(tables) or TABLE_IDS
    unknown = sorted(set(table_ids) - set(TABLE_IDS))
    if unknown:
        raise click.BadParameter(f"no table {', '.join(unknown)}; choose from {', '.join(TABLE_IDS)}",
                                 param_hint="--tables")
    try:
        seed_list = [int(s) for s in _words(seeds)] or list(DEFAULT_SEEDS)
    except ValueError as exc:
        raise click.BadParameter(f"seeds are integers: {exc}", param_hint="--seeds") from None
    if len(set(seed_list)) < 3:
        click.echo("note: fewer than 3 seeds; standard deviations will be rough", err=True)
    chosen = [t for t in TABLES if t.id in table_ids]
    if datasets:
        keys = _words(datasets)
        chosen = [dataclasses.replace(t, datasets=tuple(d for d in t.datasets if d in keys)) for t in chosen]
    specs = default_datasets(emoji_data.resolve())
    patterns = tuple(cells) or ("*",), tuple(skip_cells)
    if list_runs:
        for run in plan(chosen, specs, seed_list, runs, *patterns):
            cfg = run.config(feature_cache)
            done = "done" if finished_report(run.out, cfg) else "todo"
            click.echo(f"{done}  {run.out}  {train_command(cfg).replace('--seed S', f'--seed {run.seed}')}")
        return
    if any("emoji" in t.datasets for t in chosen) and not (emoji_data / "manifest.csv").is_file():
        from retrieval.data.emoji import prepare_emoji

        click.echo(f"rendering the emoji data set into {emoji_data}")
        prepare_emoji(emoji_data)
    if shard[1] > 1:
        results = run_grid(chosen, specs, seed_list, runs, feature_cache, shard=shard, cells=patterns[0],
                           skip_cells=patterns[1])
        click.echo(f"shard {shard[0]}/{shard[1]}: {results['setup']['runs']} runs done; run `retrieval results "
                   "report` to write the documents")
        return
    every_table = table_ids == TABLE_IDS
    command = RESULTS_COMMAND + ("" if every_table else " --tables " + ",".join(table_ids))
    results = run_grid(chosen, specs, seed_list, runs, feature_cache, markdown, json_path, figures,
                       cells=patterns[0], skip_cells=patterns[1], train=train, command=command)
    click.echo(f"{results['setup']['runs']} runs; training time {results['setup']['train_seconds_total']:.0f} s; "
               f"wrote {markdown} and {json_path}")
