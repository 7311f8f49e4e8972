"""`retrieval index build|add|remove|repair`: writing a gallery index.

The writers lock the index folder: a second writer is refused at once.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Callable, Iterable
from typing import Any

import click

from retrieval.cli.config_options import command_option, command_options, config_options
from retrieval.cli.errors import OptionCommand, option_flag
from retrieval.cli.index_columns import check_manifest_columns, record_display, shown_columns
from retrieval.cli.index_common import (
    budget_text,
    engine_options,
    finish,
    gallery_root_option,
    index_folder,
    ingest_options,
    ingest_settings,
    json_option,
    labels_text,
    one_line,
    problems,
    run_writer,
    serve_next,
)
from retrieval.cli.index_milvus import sync_options
from retrieval.cli.index_options import ENGINE, IndexOptions
from retrieval.cli.options import apply_options
from retrieval.near_duplicates import DuplicateCheck

FAILED_SHOWN = 10  # unreadable images a writer names; `index stats --failed` lists every one
SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
              "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}
# the build options that only a build from images reads (the Ray ones included)
IMAGE_BUILD_OPTIONS = ("split", "label_from", "label_column", "batch_size", "workers", "max_pixels", *ENGINE)
# the build options that shape the folder's faiss index (none of a build into a Milvus collection)
FAISS_BUILD_OPTIONS = ("index_key", "max_index_memory", "max_query_ms", "gpu")


def _parse_size(text: str | None) -> int | None:
    """``4G``, ``512M``, ``1.5GiB`` or bytes -> bytes (binary units: what free and top show)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a size; write e.g. 4G, 512M or 1.5GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def _print_failed(summary: dict, errors: int) -> None:
    """The index's images that could not be read, by name (the first ``FAILED_SHOWN`` in the catalogue's order,
    which may be earlier runs' after an add), and where the rest are listed."""
    from retrieval.index.sources import printable_path

    shown = (summary.get("error_examples") or [])[:FAILED_SHOWN]
    if not errors or not shown:
        return
    click.echo(f"could not be read ({summary['errors']} in the index):")
    for failure in shown:
        click.echo(f"  {printable_path(failure['path'] or '?')}: {one_line(failure['error'])}")
    rest = summary["errors"] - len(shown)
    listing = f"retrieval index stats {shlex.quote(str(summary['index_dir']))} --failed"
    click.echo(f"  ... and {rest} more: {listing}" if rest > 0 else f"  (again: {listing})")


@click.command("build", cls=OptionCommand)
@command_option(IndexOptions, "build_model")
@command_option(IndexOptions, "build_images")
@command_options(IndexOptions, "embeddings", "allow_outside_paths", "build_out", "index_key")
@command_option(IndexOptions, "max_index_memory", callback=lambda _c, _p, value: _parse_size(value))
@command_options(IndexOptions, "max_query_ms", "split", "label_from", "label_column", "display_columns",
                 "text_columns")
@ingest_options
@engine_options
@command_options(IndexOptions, "build_milvus", "build_collection", "index_type")
@json_option
def build_command(
    model, images, embeddings, allow_outside_paths, out, index_key, max_index_memory, max_query_ms, split, label_from,
    label_column, display_columns, text_columns, batch_size, workers, shard_size, max_pixels, gpu, engine, milvus,
    collection, index_type, as_json,
) -> None:
    """Embed every image with the model and build the index (--images, --model), or build it from embeddings you
    already have (--embeddings); rerun it (or `index repair OUT`) to finish an interrupted build. With --engine ray
    --milvus URI --collection NAME the vectors go into that Milvus collection instead of the folder."""
    from retrieval.index import build_index
    from retrieval.index.writing.keyword_build import parse_text_columns

    _check_build_source(model, images, embeddings, allow_outside_paths)
    check_manifest_columns(images, display_columns)
    place = _build_place(milvus, collection, index_type, embeddings, engine)
    options = ingest_settings(batch_size, workers, shard_size, max_pixels, engine)
    if place is not None:
        summary = run_writer(build_index, out, images, out, model=model, split=split, label_from=label_from,
                             options=options, milvus=place, milvus_index_type=index_type, label_column=label_column)
        _record_text_tower(summary, out, model, as_json)
        record_display(out, display_columns, summary)
        if not as_json:
            _print_failed(summary, summary["errors"])
        finish(summary, as_json,
               f"indexed {summary['indexed']} images into the Milvus collection {collection} "
               f"({summary['vectors_in']['physical']}, {summary['index_key']}; {labels_text(summary)}; "
               f"{problems(summary['errors'], summary['duplicates'])}) in {summary['seconds']:.0f} s; "
               f"{summary['index_dir']} holds its catalogue, no vectors",
               f"retrieval serve --milvus {shlex.quote(milvus)} --collection {collection}")
        return
    options = dataclasses.replace(options, policy=dataclasses.replace(
        options.policy, max_index_memory=max_index_memory, max_query_ms=max_query_ms))
    if embeddings is not None and text_columns:
        raise click.UsageError("--text-columns builds with --images; for a build from --embeddings, run `retrieval "
                               "index text OUT --text-columns COLUMNS` once it is built")
    if embeddings is not None:
        _build_from_embeddings(embeddings, out, index_key, gpu, options, as_json, allow_outside_paths,
                               display_columns)
        return
    summary = run_writer(build_index, out, images, out, model=model, index_key=index_key, split=split, gpu=gpu,
                         options=options, label_from=label_from, text_columns=parse_text_columns(text_columns),
                         label_column=label_column)
    _record_text_tower(summary, out, model, as_json)
    record_display(out, display_columns, summary)
    if not as_json:
        _print_failed(summary, summary["errors"])
    finish(summary, as_json,
           f"indexed {summary['indexed']} images into {summary['index_dir']} ({summary['index_key']}, "
           f"{labels_text(summary)}; {problems(summary['errors'], summary['duplicates'])}) in "
           f"{summary['seconds']:.0f} s{budget_text(summary.get('budget'))}; results show: "
           f"{shown_columns(summary['display_columns'])}", serve_next(summary["index_dir"]))


def _record_text_tower(summary: dict, index_dir: str, model: str, as_json: bool) -> None:
    """Record the text tower the model names beside it (`retrieval export --pretrained` writes one), as `retrieval
    index text` would, into the index and ``summary["text_model"]``; a tower that cannot be used is one warning."""
    from retrieval.index.sources import printable_path
    from retrieval.text.sibling_text import record_named_text_model

    recorded = record_named_text_model(index_dir, model)
    if recorded is None:
        return
    summary["text_model"] = recorded
    if not as_json:
        click.echo(f"recorded the text model {printable_path(recorded['text_model_path'])} (named by the model): "
                   f"retrieval search --index {shlex.quote(str(index_dir))} --text \"a red apple\"")
    # the recorded tower adapted to this gallery goes here, after it is recorded and before the summary is shown
    from retrieval.text.gallery_index import adapt_recorded, adaptation_sentence

    adaptation = adapt_recorded(index_dir, recorded["text_model_path"])
    summary["gallery_adaptation"] = adaptation
    if adaptation_sentence(adaptation):
        click.echo("text model:" + adaptation_sentence(adaptation).removeprefix(";"), err=True)


def _build_place(milvus: str | None, collection: str | None, index_type: str | None, embeddings: str | None,
                 engine: dict) -> Any:
    """The collection a Ray build writes into (--milvus, --collection), checked before any work; None: the folder."""
    if milvus is None and collection is None:
        if index_type is not None:
            raise click.UsageError("--index-type is the Milvus collection's vector index: give it with --milvus and "
                                   "--collection (the folder's faiss index is --index-key)")
        return None
    if (milvus is None) != (collection is None):
        raise click.UsageError("give --milvus URI and --collection NAME together")
    if embeddings is not None:
        raise click.UsageError("--milvus builds from --images with --engine ray; for --embeddings, build the folder "
                               "and push it (`retrieval index push OUT --milvus URI --collection NAME`)")
    given = options_given(FAISS_BUILD_OPTIONS)
    if given:
        raise click.UsageError(f"{', '.join(given)} shape the folder's faiss index, which a build into a Milvus "
                               "collection does not make: leave them out (--index-type chooses the collection's)")
    from retrieval.index.milvus.milvus_build import check_build_place
    from retrieval.index.milvus.milvus_collection import MilvusPlace

    place = MilvusPlace.checked(milvus, collection)
    check_build_place(place, engine.get("engine", "local"))
    return place


def options_given(names: Iterable[str]) -> list[str]:
    """The flags of ``names`` that the command line gave (not defaults, not a config file)."""
    context = click.get_current_context()
    return [option_flag(context.command, name) or name for name in names
            if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]


def _check_build_source(model: str | None, images: str | None, embeddings: str | None,
                        allow_outside_paths: bool = False) -> None:
    """One of the two ways to build: images embedded by a model, or embeddings someone already has."""
    if embeddings is not None:
        if images is not None or model is not None:
            raise click.UsageError("--embeddings builds from vectors you already have, with no model: leave out "
                                   "--images and --model (or leave out --embeddings to embed images with a model)")
        given = options_given(IMAGE_BUILD_OPTIONS)
        if given:
            raise click.UsageError(f"{', '.join(given)} apply to a build from images, not to one from --embeddings: "
                                   "leave them out")
        return
    if images is None or model is None:
        missing = " and ".join(flag for flag, value in (("--images", images), ("--model", model)) if value is None)
        raise click.UsageError(f"missing {missing}: give --images and --model (the images, embedded by the model), "
                               "or --embeddings DIR (vectors you already have)")
    if allow_outside_paths:  # an image build catalogues the files it lists itself
        raise click.UsageError("--allow-outside-paths applies to a build from --embeddings (the paths its metadata "
                               "names), not to one from --images: leave it out")


def _build_from_embeddings(embeddings: str, out: str, index_key: str, gpu: bool, options: Any, as_json: bool,
                           allow_outside_paths: bool = False, display_columns: str | None = None) -> None:
    """`index build --embeddings`: the index of vectors someone already has, and its summary."""
    from retrieval.index import build_from_embeddings

    summary = build_from_embeddings(embeddings, out, index_key=index_key, gpu=gpu, options=options,
                                    allow_outside_paths=allow_outside_paths)
    record_display(out, display_columns, summary)
    classes = summary["labels"]["classes"]
    labels = f"{classes} classes from the label column" if classes else "no labels"
    folder = shlex.quote(summary["index_dir"])
    finish(summary, as_json,
           f"indexed {summary['indexed']} {summary['embedding_dim']}-d embeddings of {summary['embeddings_dir']} into "
           f"{summary['index_dir']} ({summary['index_key']}, {labels}; no model: it is searched with embeddings) "
           f"in {summary['seconds']:.0f} s{budget_text(summary.get('budget'))}",
           f"retrieval index stats {folder}   (or: retrieval serve --index {folder}, then POST /search with an "
           "\"embedding\")")


def duplicate_check_options(func: Callable) -> Callable:
    """--duplicates and --duplicate-threshold, as ``DuplicateCheck`` declares them."""
    return apply_options(func, config_options(DuplicateCheck))


@click.command("add", cls=OptionCommand)
@index_folder
@sync_options(checks_new_images=True)
@command_options(IndexOptions, "add_images", "recorded_model", "split", "label_from")
@ingest_options
@engine_options
@duplicate_check_options
@gallery_root_option
@json_option
def add_command(index_dir, images, model, split, label_from, batch_size, workers, shard_size, max_pixels, gpu,
                engine, duplicates, duplicate_threshold, gallery_root, as_json, check_new=None) -> None:
    """Add images (a folder, one image or a manifest) to an existing index without rebuilding it; new images that
    nearly copy an indexed one are reported (--duplicates skip leaves them out)."""
    from retrieval.index import add_images

    given = {"duplicates": duplicates, "duplicate_threshold": duplicate_threshold}
    check = DuplicateCheck(**{name: value for name, value in given.items() if value is not None})  # checked first
    summary = run_writer(add_images, index_dir, index_dir, images, model=model, split=split, gpu=gpu,
                         options=ingest_settings(batch_size, workers, shard_size, max_pixels, engine),
                         label_from=label_from, duplicates=check, gallery_root=gallery_root, check_new=check_new)
    added = summary["this_run"]
    near, next_step = summary.get("near_duplicates"), serve_next(summary["index_dir"])
    found = ""
    if near and near["found"]:
        found = (f"; {near['found']} near-duplicates of indexed images (cosine >= {near['threshold']:g}) "
                 f"{'skipped' if near['skipped'] else 'added'}")
        if not as_json:
            _print_near_duplicates(near)
        folder = shlex.quote(summary["index_dir"])
        if not near["skipped"] and near["found"] > len(near["examples"]):
            next_step = (f"retrieval index duplicates {folder} --threshold {near['threshold']:g}   (every group, "
                         "with the ids to remove)")
        elif not near["skipped"]:
            ids = ",".join(str(example["id"]) for example in near["examples"])
            next_step = f"retrieval index remove {folder} --ids {ids}   (or add with --duplicates skip)"
    if not as_json:
        _print_failed(summary, added["errors"])  # this run's failures; older ones are listed only with new ones
    finish(summary, as_json,
           f"added {added['added']} images to {summary['index_dir']} ({labels_text(summary)}; "
           f"{problems(added['errors'], added['duplicates'])}{found}); it now holds {summary['indexed']}", next_step)


def _print_near_duplicates(near: dict) -> None:
    """The near-duplicates `index add` found, each with the indexed image it copies (the first ``examples``)."""
    from retrieval.index.sources import printable_path

    for example in near["examples"]:
        click.echo(f"  near-duplicate  id={example['id']} {printable_path(example['path'] or '?')}  ~  "
                   f"id={example['duplicate_of']} {printable_path(example['duplicate_of_path'] or '?')}  "
                   f"(cosine {example['similarity']:.3f})")
    if near["found"] > len(near["examples"]):
        click.echo(f"  ... and {near['found'] - len(near['examples'])} more (--json lists the first "
                   f"{len(near['examples'])})")


@click.command("remove", cls=OptionCommand)
@index_folder
@sync_options()
@command_options(IndexOptions, "ids", "paths")
@gallery_root_option
@json_option
def remove_command(index_dir, ids, paths, gallery_root, as_json) -> None:
    """Remove images (by catalogue id or path); HNSW indexes are rebuilt from the shards. A gallery that moved with
    the index (or to --gallery-root) is followed first, so --paths name the images where they are now."""
    from retrieval.index import remove_images

    try:
        id_list = [int(part) for part in ids.split(",") if part.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"--ids must be comma-separated integers, got {ids!r}") from exc
    if not id_list and not paths:
        raise click.UsageError("give --ids and/or --paths")
    summary = remove_images(index_dir, ids=id_list, paths=paths, gallery_root=gallery_root)
    finish(summary, as_json, f"removed {len(summary['removed_ids'])} images from {summary['index_dir']}; "
                             f"{summary['indexed']} remain indexed", f"retrieval index stats {summary['index_dir']}")


@click.command("repair", cls=OptionCommand)
@index_folder
@command_options(IndexOptions, "recorded_model", "rebuild", "relabel")
@ingest_options
@engine_options
@gallery_root_option
@json_option
def repair_command(index_dir, model, rebuild, label_from, batch_size, workers, shard_size, max_pixels, gpu, engine,
                   gallery_root, as_json) -> None:
    """Finish an interrupted build/add, or mend an index whose faiss part and catalogue disagree.

    Embeds only images that no shard holds, then checks that faiss holds exactly the indexed images. With
    --label-from, first relabels the gallery's images by that rule.
    """
    from retrieval.index import repair_index

    summary = run_writer(repair_index, index_dir, index_dir, model=model, rebuild=rebuild, gpu=gpu,
                         options=ingest_settings(batch_size, workers, shard_size, max_pixels, engine),
                         label_from=label_from, gallery_root=gallery_root)
    relabelled = (f"relabelled {summary['labels']['relabelled']} images, now {labels_text(summary)}; "
                  if "labels" in summary else "")
    if not as_json:
        _print_failed(summary, summary["errors"])
    finish(summary, as_json, f"repaired {summary['index_dir']}: {relabelled}{summary['vectors']} images searchable "
                             f"({summary['faiss']}; {problems(summary['errors'], summary['duplicates'])})",
           serve_next(summary["index_dir"]))
