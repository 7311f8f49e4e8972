"""`retrieval index stats|export`: reading a gallery index without changing it (its numbers, the images it could not
read, its rows and vectors as files other tools read)."""

from __future__ import annotations

import json
import re
import shlex

import click

from retrieval.cli.config_options import command_option, command_options
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import budget_text, finish, index_folder, json_option, one_line, serve_next
from retrieval.cli.index_options import IndexOptions
from retrieval.utils.sizes import size_text


@click.command("stats", cls=OptionCommand)
@index_folder
@command_options(IndexOptions, "queries", "failed")
@json_option
def stats_command(index_dir, queries, failed, as_json) -> None:
    """Counts, index type and parameters, size on disk, recall vs exact search, p50/p99 latency."""
    from retrieval.index import index_stats

    if failed:
        _list_failed(index_dir, as_json)
        return
    stats = index_stats(index_dir, queries=queries)
    k = max(int(key.split("_")[1]) for key in stats if re.fullmatch(r"recall_(\d+)_at_\1", key))
    recall = stats[f"recall_{k}_at_{k}"]
    finish(stats, as_json,
           f"{stats['index_dir']}: {stats['vectors']} images, {stats['index_key']}, "
           f"{stats['size_on_disk_bytes']['total'] / 2**20:.1f} MiB; recall@{k} {recall:.3f} against exact search, "
           f"p50 {stats['latency']['p50_ms']:.2f} ms per query ({stats['errors']} files could not be read; "
           f"--failed lists them){budget_text(stats.get('budget'))}{_no_match_text(stats.get('text_no_match'))}",
           serve_next(stats["index_dir"]) if stats["model"].get("source") != "embeddings" else
           f"retrieval serve --index {stats['index_dir']}   (then POST /search with an \"embedding\": no model)")


def _no_match_text(no_match: dict | None) -> str:
    """The text queries' "no good match" floor in a sentence (None: the index records no text model)."""
    if no_match is None:
        return ""
    if not no_match["calibrated"]:
        return f"; text queries: no \"no good match\" floor ({no_match['problem']})"
    return (f"; text queries scoring under {no_match['floor']:.3f} say \"no good match\" (calibrated on "
            f"{no_match.get('images', '?')} images: the {no_match.get('quantile', '?')} quantile of "
            f"{no_match.get('texts', '?')} everyday texts' best scores)")


def _list_failed(index_dir: str, as_json: bool) -> None:
    """`index stats --failed`: every image the index could not read or list, one a line (JSON: one array)."""
    from retrieval.index.sources import printable_path
    from retrieval.index.stats import failed_images

    count = 0
    for count, failure in enumerate(failed_images(index_dir), start=1):  # streamed: a gallery may have millions
        if as_json:
            click.echo(("[" if count == 1 else ",") + json.dumps(failure))
        else:
            click.echo(f"{printable_path(failure['path'] or '?', limit=None)}: {one_line(failure['error'])}")
    if as_json:
        click.echo("[]" if count == 0 else "]")
    elif count == 0:
        click.echo(f"every image of {index_dir} could be read")


@click.command("export", cls=OptionCommand)
@index_folder
@command_option(IndexOptions, "fmt", case_sensitive=False)
@command_options(IndexOptions, "export_out", "overwrite", "rows_per_file", "absolute_paths")
@json_option
def export_command(index_dir, fmt, out, overwrite, rows_per_file, absolute_paths, as_json) -> None:
    """Write the searchable images' ids, paths, labels, metadata and embeddings as parquet or npy files that pandas,
    autofaiss and vector databases read as they are (removed, duplicate and unreadable images are left out)."""
    from retrieval.index.formats.table_export import export_index

    summary = export_index(index_dir, out, fmt, overwrite=overwrite, rows_per_file=rows_per_file,
                           absolute_paths=absolute_paths)
    where = summary["out"]
    if summary["format"] == "npy":
        next_step = (f"autofaiss build_index --embeddings {shlex.quote(where + '/embeddings')} --metric_type ip   "
                     f"(rows: {shlex.quote(where + '/metadata')})")
    else:
        next_step = "python -c " + shlex.quote(f"import pandas; print(pandas.read_parquet({json.dumps(where)}).head())")
    files, size = len(summary["files"]), summary["bytes"]
    model = f"model_hash {summary['model_hash']}" if summary["model_hash"] else "no model: built from embeddings"
    finish(summary, as_json,
           f"exported {summary['rows']} images ({summary['embedding_dim']}-d float32 embeddings, {model}) from "
           f"{summary['index_dir']} to {where} as {summary['format']} "
           f"({files} file{'s' if files != 1 else ''}, {size_text(size)})", next_step)
