"""`retrieval index build|add|remove|repair|stats` and `retrieval search`: the gallery index on the command line.

The writers (build, add, remove, repair) lock the index folder: a second writer is refused at once.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
import sys
from pathlib import Path

import click

from retrieval.cli.config_options import config_options
from retrieval.cli.errors import OptionCommand, OptionGroup, option_flag, option_message, where_problem
from retrieval.cli.help_text import default_max_pixels, image_extensions, lazy_help_option
from retrieval.cli.options import apply_options, rerank_config, rerank_options
from retrieval.gallery_option import GalleryRoot
from retrieval.near_duplicates import DuplicateCheck
from retrieval.options import TRUSTED_MODEL
from retrieval.sizes import size_text
from retrieval.workers import DEFAULT_WORKERS_TEXT


def images_help() -> str:
    return (f"a folder (searched recursively for {image_extensions()}), a manifest.csv (path,label[,split]) or a "
            ".parquet file with the same columns.")


def index_folder(command):
    """The index folder of an ``index`` subcommand: INDEX_DIR, or ``--index`` as ``search`` and ``serve`` name it."""
    folder = click.Path(file_okay=False, exists=True)

    @functools.wraps(command)
    def run(*args, index_dir=None, index_flag=None, **kwargs):
        if index_dir is not None and index_flag is not None and Path(index_dir).resolve() != Path(index_flag).resolve():
            raise click.UsageError(f"two index folders given, {index_dir} and --index {index_flag}: give one")
        if index_dir is None and index_flag is None:
            raise click.UsageError("give the index folder: INDEX_DIR (or --index INDEX_DIR)")
        return command(*args, index_dir=index_dir if index_dir is not None else index_flag, **kwargs)

    run = click.option("--index", "index_flag", type=folder, metavar="INDEX_DIR",
                       help="the index folder, as `retrieval search` and `retrieval serve` name it (or give it as "
                            "INDEX_DIR).")(run)
    return click.argument("index_dir", type=folder, required=False)(run)


def _ingest_options(
    batch_size: int, workers: int | None, shard_size: int, max_pixels: int | None, engine: dict | None = None
):
    from retrieval.data.decode import DEFAULT_MAX_PIXELS
    from retrieval.index.engine import IngestOptions, RayOptions

    engine = engine or {}
    ray = None
    if engine.get("engine") == "ray":
        ray = RayOptions(
            address=engine["ray_address"],
            actors=engine["ray_actors"],
            gpus_per_actor=engine["ray_gpus_per_actor"],
            cpus_per_actor=engine["ray_cpus_per_actor"],
        )
    return IngestOptions(
        batch_size=batch_size,
        workers=workers,
        shard_size=shard_size,
        max_pixels=max_pixels or DEFAULT_MAX_PIXELS,
        engine=engine.get("engine", "local"),
        ray=ray,
    )


# RayOptions' fields, which the command line's options name ray_<field>
RAY_FIELDS = ("address", "actors", "gpus_per_actor", "cpus_per_actor")


def _write(command, index_dir, *args, **kwargs) -> dict:
    """Run an index writer (``build_index``, ``add_images``, ``repair_index``) under the command line's names: the
    Ray options are ``--ray-*``, and an error that another command fixes ends with that command."""
    from retrieval.errors import ParameterError
    from retrieval.index.writer import FinishedIndexError, LabelRuleMismatch, NothingToRepairError

    folder = shlex.quote(str(index_dir))
    try:
        return command(*args, **kwargs)
    except ParameterError as exc:
        if exc.param in RAY_FIELDS:
            raise exc.renamed(f"ray_{exc.param}") from exc
        if not isinstance(exc, LabelRuleMismatch):
            raise
        context = click.get_current_context()
        raise click.ClickException(f"{option_message(context.command, exc)}: retrieval index repair {folder} "
                                   f"--label-from {exc.given}") from exc
    except FinishedIndexError as exc:
        raise click.ClickException(f"{exc} (`retrieval index add {folder} --images ...`, or another --out; to "
                                   f"re-embed it with another model: `retrieval index upgrade {folder} --model "
                                   "NEW.onnx`)") from exc
    except NothingToRepairError as exc:
        raise click.ClickException(f"{exc}: `retrieval index build --model ... --images ... --out {folder}`") from exc


json_option = click.option("--json", "as_json", is_flag=True, help="print the whole summary as JSON (for programs).")


def _finish(summary: dict, as_json: bool, line: str, next_step: str | None = None) -> None:
    """How an index command ends: one line for people and the next command to run, or the summary as JSON."""
    if as_json:
        click.echo(json.dumps(summary, indent=2, default=str))
        return
    click.echo(line)
    if next_step:
        click.echo(f"next: {next_step}")


def _problems(errors: int, duplicates: int) -> str:
    return f"{errors} could not be read, {duplicates} duplicates skipped"


FAILED_SHOWN = 10  # unreadable images a writer names; `index stats --failed` lists every one


def _one_line(text: str | None) -> str:
    """A reason on one printable line (an exception's text may span several, or quote a hostile name)."""
    from retrieval.index.sources import printable_path

    return printable_path(" ".join((text or "unknown error").split()))


def _print_failed(summary: dict, errors: int) -> None:
    """The index's images that could not be read, by name (the first ``FAILED_SHOWN`` in the catalogue's order,
    which may be earlier runs' after an add), and where the rest are listed."""
    from retrieval.index.sources import printable_path

    shown = (summary.get("error_examples") or [])[:FAILED_SHOWN]
    if not errors or not shown:
        return
    click.echo(f"could not be read ({summary['errors']} in the index):")
    for failure in shown:
        click.echo(f"  {printable_path(failure['path'] or '?')}: {_one_line(failure['error'])}")
    rest = summary["errors"] - len(shown)
    listing = f"retrieval index stats {shlex.quote(str(summary['index_dir']))} --failed"
    click.echo(f"  ... and {rest} more: {listing}" if rest > 0 else f"  (again: {listing})")


def _labels(summary: dict) -> str:
    labels = summary.get("labels") or {}
    if not labels.get("classes"):
        return "no labels"
    return f"{labels['classes']} classes by --label-from {labels['from']}"


def _serve_next(index_dir: str) -> str:
    return f"retrieval serve --index {index_dir}   (or: retrieval search --index {index_dir} IMAGE)"


split_option = click.option("--split", default=None, help="with a manifest: index only the rows of this split.")


def _label_help() -> str:
    from retrieval.index.sources import LABEL_RULES

    return ("where an image's label comes from: " + "; ".join(f"{name}: {text}" for name, text in LABEL_RULES.items())
            + ". `index add` keeps the index's rule.")


label_option = lazy_help_option("--label-from", metavar="parent|top|manifest|none", default=None,
                                help_text=_label_help)
relabel_option = lazy_help_option(
    "--label-from", metavar="parent|top|manifest|none", default=None,
    help_text=lambda: "relabel the index's gallery images by this rule (labels only, nothing is re-embedded); "
                      + _label_help().removesuffix(" `index add` keeps the index's rule."))


def ingest_options(func):
    options = [
        click.option("--batch-size", default=64, show_default=True, help="images per embedding batch."),
        click.option(
            "--workers", type=int, default=None, help=f"decoding workers (default: {DEFAULT_WORKERS_TEXT})."
        ),
        click.option(
            "--shard-size", default=4096, show_default=True, help="images per shard (the unit of resumption)."
        ),
        lazy_help_option(
            "--max-pixels",
            type=int,
            default=None,
            help_text=lambda: f"refuse images with more pixels (decompression bombs); default {default_max_pixels()}.",
        ),
        click.option(
            "--gpu", is_flag=True, help="train/search faiss on the GPU (needs faiss-gpu and a GPU)."
        ),
    ]
    return apply_options(func, options)


def engine_options(func):
    """--engine and the Ray cluster options, collected into one ``engine`` dict argument."""
    options = [
        click.option(
            "--engine",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help="local: decode + embed in this process; ray: Ray Data on a Ray cluster (pip install 'ray[data]').",
        ),
        click.option(
            "--ray-address",
            default="auto",
            show_default=True,
            help="auto (the running cluster, see `ray start`), local (start Ray here), ray://HOST:PORT or HOST:PORT.",
        ),
        click.option("--ray-actors", default=1, show_default=True, help="embedding actors (each loads the model)."),
        click.option(
            "--ray-gpus-per-actor",
            default=0.0,
            show_default=True,
            help="GPUs per embedding actor (onnxruntime CUDA provider when onnxruntime-gpu is installed).",
        ),
        click.option(
            "--ray-cpus-per-actor", default=1.0, show_default=True, help="CPUs (onnxruntime threads) per actor."
        ),
    ]
    names = ("engine", "ray_address", "ray_actors", "ray_gpus_per_actor", "ray_cpus_per_actor")

    def wrapper(*args, **kwargs):
        kwargs["engine"] = {name: kwargs.pop(name) for name in names}
        return func(*args, **kwargs)

    wrapper = functools.update_wrapper(wrapper, func)
    return apply_options(wrapper, options)


@click.group("index", cls=OptionGroup)
def index_group() -> None:
    """Build, update and inspect a gallery index (faiss + SQLite catalogue)."""


@index_group.command("build")
@click.option("--model", type=click.Path(dir_okay=False),
              help=f"exported .onnx embedder (with --images). {TRUSTED_MODEL}")
@lazy_help_option("--images", type=click.Path(), help_text=images_help)
@click.option("--embeddings", type=click.Path(), metavar="DIR",
              help="instead of --images and --model: build from vectors you already have, with no images and no "
                   "model; DIR holds embeddings/*.npy (or clip-retrieval's img_emb/*.npy) and optionally "
                   "metadata/*.parquet with the same rows, as `retrieval index export --format npy` writes "
                   "(docs/INDEX.md). The index is searched with embeddings.")
@click.option("--allow-outside-paths", is_flag=True,
              help="with --embeddings: catalogue metadata paths that resolve outside DIR (or the gallery folder its "
                   "_export.json records) too: absolute, with .. or through a symlink. Refused by default, as a "
                   "server sends every catalogued file to whoever searches.")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="index folder (resumes if interrupted)."
)
@click.option(
    "--index-key",
    default="auto",
    show_default=True,
    help="auto | Flat | HNSW32 | IVF{K},Flat | IVF{K},PQ{m} | any faiss factory key ({K}, {m} filled in).",
)
@click.option("--max-index-memory", metavar="SIZE", callback=lambda _c, _p, v: _parse_size(v),
              help="with --index-key auto: the best index whose estimated RAM fits, e.g. 4G, 512M (as autofaiss "
                   "does; `index stats` shows the choice).")
@click.option("--max-query-ms", type=click.FloatRange(min=0, min_open=True), metavar="MS",
              help="tune the search settings (nprobe, efSearch) for the best recall whose median time per query "
                   "stays under MS milliseconds.")
@split_option
@label_option
@ingest_options
@engine_options
@json_option
def build_command(
    model, images, embeddings, allow_outside_paths, out, index_key, max_index_memory, max_query_ms, split, label_from,
    batch_size, workers, shard_size, max_pixels, gpu, engine, as_json,
) -> None:
    """Embed every image with the model and build the index (--images, --model), or build it from embeddings you
    already have (--embeddings); rerun it (or `index repair OUT`) to finish an interrupted build."""
    import dataclasses

    from retrieval.index import build_index

    _check_build_source(model, images, embeddings, allow_outside_paths)
    options = _ingest_options(batch_size, workers, shard_size, max_pixels, engine)
    options = dataclasses.replace(options, policy=dataclasses.replace(
        options.policy, max_index_memory=max_index_memory, max_query_ms=max_query_ms))
    if embeddings is not None:
        _build_from_embeddings(embeddings, out, index_key, gpu, options, as_json, allow_outside_paths)
        return
    summary = _write(
        build_index,
        out,
        images,
        out,
        model=model,
        index_key=index_key,
        split=split,
        gpu=gpu,
        options=options,
        label_from=label_from,
    )
    if not as_json:
        _print_failed(summary, summary["errors"])
    _finish(summary, as_json,
            f"indexed {summary['indexed']} images into {summary['index_dir']} ({summary['index_key']}, "
            f"{_labels(summary)}; {_problems(summary['errors'], summary['duplicates'])}) in {summary['seconds']:.0f} s"
            f"{_budget_text(summary.get('budget'))}", _serve_next(summary["index_dir"]))


# the build options that only a build from images reads (the Ray ones included)
IMAGE_BUILD_OPTIONS = ("split", "label_from", "batch_size", "workers", "max_pixels", "engine",
                       *(f"ray_{name}" for name in RAY_FIELDS))


def _check_build_source(model: str | None, images: str | None, embeddings: str | None,
                        allow_outside_paths: bool = False) -> None:
    """One of the two ways to build: images embedded by a model, or embeddings someone already has."""
    if embeddings is not None:
        if images is not None or model is not None:
            raise click.UsageError("--embeddings builds from vectors you already have, with no model: leave out "
                                   "--images and --model (or leave out --embeddings to embed images with a model)")
        context = click.get_current_context()
        given = [option_flag(context.command, name) or name for name in IMAGE_BUILD_OPTIONS
                 if context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE]
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


def _build_from_embeddings(embeddings: str, out: str, index_key: str, gpu: bool, options, as_json: bool,
                           allow_outside_paths: bool = False) -> None:
    """`index build --embeddings`: the index of vectors someone already has, and its summary."""
    from retrieval.index import build_from_embeddings

    summary = build_from_embeddings(embeddings, out, index_key=index_key, gpu=gpu, options=options,
                                    allow_outside_paths=allow_outside_paths)
    classes = summary["labels"]["classes"]
    labels = f"{classes} classes from the label column" if classes else "no labels"
    folder = shlex.quote(summary["index_dir"])
    _finish(summary, as_json,
            f"indexed {summary['indexed']} {summary['embedding_dim']}-d embeddings of {summary['embeddings_dir']} into "
            f"{summary['index_dir']} ({summary['index_key']}, {labels}; no model: it is searched with embeddings) "
            f"in {summary['seconds']:.0f} s{_budget_text(summary.get('budget'))}",
            f"retrieval index stats {folder}   (or: retrieval serve --index {folder}, then POST /search with an "
            "\"embedding\")")


SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
              "G": 2**30, "GB": 2**30, "GIB": 2**30, "T": 2**40, "TB": 2**40, "TIB": 2**40}


def _parse_size(text: str | None) -> int | None:
    """``4G``, ``512M``, ``1.5GiB`` or bytes -> bytes (binary units: what free and top show)."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in SIZE_UNITS or float(match.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is not a size; write e.g. 4G, 512M or 1.5GiB")
    return int(float(match.group(1)) * SIZE_UNITS[unit])


def _budget_text(budget: dict | None) -> str:
    """What the budgets chose and measured, for the one-line summaries of build and stats."""
    if not budget:
        return ""
    parts = []
    if budget.get("max_index_memory") is not None:
        parts.append(f"about {size_text(budget['estimated_bytes'])} of --max-index-memory "
                     f"{size_text(budget['max_index_memory'])}")
    if budget.get("max_query_ms") is not None:
        met = "within" if budget.get("latency_met") else "OVER"
        parts.append(f"{budget['latency_ms']:.2f} ms per query, {met} --max-query-ms {budget['max_query_ms']:g}")
    return "; " + ", ".join(parts)


def gallery_root_option(func):
    """--gallery-root, as ``GalleryRoot`` declares it."""
    return apply_options(func, config_options(GalleryRoot))


def duplicate_check_options(func):
    """--duplicates and --duplicate-threshold, as ``DuplicateCheck`` declares them."""
    return apply_options(func, config_options(DuplicateCheck))


@index_group.command("add")
@index_folder
@lazy_help_option("--images", required=True, type=click.Path(), help_text=images_help)
@click.option("--model", type=click.Path(dir_okay=False),
              help=f"default: the model recorded in index.json. {TRUSTED_MODEL}")
@split_option
@label_option
@ingest_options
@engine_options
@duplicate_check_options
@gallery_root_option
@json_option
def add_command(index_dir, images, model, split, label_from, batch_size, workers, shard_size, max_pixels, gpu,
                engine, duplicates, duplicate_threshold, gallery_root, as_json) -> None:
    """Add images (a folder, one image or a manifest) to an existing index without rebuilding it; new images that
    nearly copy an indexed one are reported (--duplicates skip leaves them out)."""
    from retrieval.index import add_images

    given = {"duplicates": duplicates, "duplicate_threshold": duplicate_threshold}
    check = DuplicateCheck(**{name: value for name, value in given.items() if value is not None})  # checked first
    summary = _write(
        add_images,
        index_dir,
        index_dir,
        images,
        model=model,
        split=split,
        gpu=gpu,
        options=_ingest_options(batch_size, workers, shard_size, max_pixels, engine),
        label_from=label_from,
        duplicates=check,
        gallery_root=gallery_root,
    )
    added = summary["this_run"]
    near, next_step = summary.get("near_duplicates"), _serve_next(summary["index_dir"])
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
    _finish(summary, as_json,
            f"added {added['added']} images to {summary['index_dir']} ({_labels(summary)}; "
            f"{_problems(added['errors'], added['duplicates'])}{found}); it now holds {summary['indexed']}", next_step)


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


@index_group.command("upgrade")
@index_folder
@click.option("--model", type=click.Path(dir_okay=False, exists=True),
              help="the new model (.onnx); default: the one of the upgrade under way, which this run resumes. "
                   f"{TRUSTED_MODEL}")
@click.option("--order", type=click.Choice(["random", "uncertain", "id"]), default="random", show_default=True,
              help="which images are re-embedded first: random (measured best), uncertain (the old embeddings whose "
                   "neighbours disagree with their label, or lie farthest, first) or id (catalogue order). It "
                   "matters only for a model declared compatible, whose vectors are served as they come.")
@click.option("--commit-every", type=click.IntRange(min=1), default=4096, show_default=True,
              help="images re-embedded between two publishes of a compatible model's upgrade (each publish rewrites "
                   "the faiss part; a server swaps in each).")
@click.option("--native", is_flag=True,
              help="re-embed into the new model's own embedding (a swap, faiss rebuilt in its size) even where its "
                   "compatible output, a projection into the old space, could serve the old index as it goes.")
@ingest_options
@gallery_root_option
@json_option
def upgrade_command(index_dir, model, order, commit_every, native, batch_size, workers, shard_size, max_pixels, gpu,
                    gallery_root, as_json) -> None:
    """Re-embed the gallery with a new model while servers keep answering (resumable: run it again after a stop).

    A model declared compatible with the index's (trained with --compatible-with it) serves at once and its vectors
    replace the old ones batch by batch; a new embedding size does so through the model's compatible output, its
    projection into the old space (--native: into its own size instead, a swap). Any other model's vectors are
    written beside the old ones and swapped in at the end. Either way index.json then names the new model (and the
    output its vectors came from) and the old vectors are deleted."""
    from retrieval.index.upgrade import upgrade_index

    if gpu:
        raise click.BadParameter("the upgrade searches and trains faiss on the CPU", param_hint="--gpu")
    summary = _write(upgrade_index, index_dir, index_dir, model=model, order=order, commit_every=commit_every,
                     options=_ingest_options(batch_size, workers, shard_size, max_pixels, {}), native=native,
                     gallery_root=gallery_root)
    if summary["mode"] == "none":
        _finish(summary, as_json, f"{summary['index_dir']} already uses model {summary['model_hash']}: nothing to do")
        return
    through = (f", through its compatible output {summary['model_output']} into the old "
               f"{summary['embedding_dim']}-d space" if summary.get("model_output_space") else "")
    how = (f"served as it came (declared compatible{through})" if summary["mode"] == "mixed"
           else f"swapped in at the end ({summary['embedding_dim']}-d vectors, faiss rebuilt)")
    unreadable = f"; {summary['unreadable']} unreadable now, left out" if summary["unreadable"] else ""
    _finish(summary, as_json,
            f"upgraded {summary['index_dir']} to model {summary['model_hash']}: {summary['reembedded']} images "
            f"re-embedded, {how}{unreadable}; {summary['deleted_shards']} shards of the old vectors deleted"
            + (_measured_line(summary.get("compatibility")) if summary["mode"] == "mixed" else ""),
            _serve_next(summary["index_dir"]))


def _measured_line(measured: dict | None) -> str:
    """A mixed upgrade's second line: how well new queries met the old vectors, as the model's training measured."""
    from retrieval.compatibility import compatibility_sentence

    if measured is None:
        return ("\nmeasured compatibility: none recorded with the model (`retrieval evaluate --checkpoint NEW "
                "--gallery-model OLD` measures it)")
    return f"\nmeasured when the model was trained: {compatibility_sentence(measured)}"


def comparison_options(func):
    """--sample, -k, --workers and --json of the two model comparisons."""
    return apply_options(func, [
        click.option("--sample", type=click.IntRange(min=2), default=2000, show_default=True,
                     help="images compared (seeded sample); exact neighbours among them, sample^2 work per model."),
        click.option("-k", "k", type=click.IntRange(min=1), default=10, show_default=True,
                     help="neighbours per image."),
        click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True, help="decoding threads."),
        json_option,
    ])


@index_group.command("compare")
@index_folder
@click.option("--model", required=True, type=click.Path(dir_okay=False, exists=True),
              help="the model (.onnx) to compare with the index's own, e.g. a fine-tuned one before an upgrade. "
                   f"{TRUSTED_MODEL}")
@comparison_options
def index_compare_command(index_dir, model, sample, k, workers, as_json) -> None:
    """How much MODEL changes the gallery's neighbourhoods, no labels needed: for each sampled image, the share of
    its k nearest images under the index's model that stay among its k nearest under MODEL. With labels, each
    model's Recall@1 on the same images too."""
    from retrieval.index import load_model
    from retrieval.index.compare import compare_with_index

    summary = compare_with_index(index_dir, load_model(model), sample=sample, k=k, workers=workers)
    _show_comparison(summary, as_json, f"of {index_dir}", "the index's model", Path(model).name)


def _show_comparison(summary: dict, as_json: bool, where: str, old_name: str, new_name: str) -> None:
    """A model comparison for people (the overlap, each model's Recall@1 with labels, the images changed most)."""
    from retrieval.index.sources import printable_path

    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    overlap = summary["overlap"]
    click.echo(f"{summary['images']} images {where}: their {summary['k']} nearest neighbours under {new_name} "
               f"overlap those under {old_name} by {overlap['mean']:.2f} on average (median {overlap['median']:.2f}, "
               f"10 % of images at most {overlap['p10']:.2f}; {overlap['share_below_half']:.0%} keep fewer than half)")
    if summary["labels"]:
        old, new = summary["labels"]["old"], summary["labels"]["new"]
        click.echo(f"with the folders' labels: Recall@1 {old['recall@1']:.3f} ({old_name}) -> "
                   f"{new['recall@1']:.3f} ({new_name})")
    click.echo("changed most:")
    for item in summary["most_changed"]:
        click.echo(f"  {item['overlap']:.2f}  {printable_path(item['path'], limit=None)}")


@click.command("compare", cls=OptionCommand)
@click.option("--model", required=True, type=click.Path(dir_okay=False, exists=True),
              help=f"the new model (.onnx). {TRUSTED_MODEL}")
@click.option("--baseline", required=True, type=click.Path(dir_okay=False, exists=True),
              help="the model to compare it with (.onnx): the one serving now, or the pretrained backbone exported "
                   "(trusted input too).")
@click.option("--images", required=True, type=click.Path(exists=True),
              help="a folder of images (searched recursively; sub-folders are labels where there are any).")
@comparison_options
def compare_command(model, baseline, images, sample, k, workers, as_json) -> None:
    """How much MODEL changes the neighbourhoods of any folder's images against BASELINE, no labels needed (with
    sub-folders as labels, each model's Recall@1 too). For an index's own gallery: retrieval index compare."""
    from retrieval.index import load_model
    from retrieval.index.compare import compare_on_folder, model_names

    summary = compare_on_folder(images, load_model(baseline), load_model(model), sample=sample, k=k, workers=workers)
    # runs/a/model.onnx and runs/b/model.onnx must not both read "model.onnx"
    names = model_names(baseline, model, summary["old_model_hash"], summary["new_model_hash"])
    _show_comparison(summary, as_json, f"in {images}", *names)


@index_group.command("remove")
@index_folder
@click.option("--ids", default="", help="comma-separated catalogue ids.")
@click.option("--paths", multiple=True,
              help="image path as the tools print it: relative to the gallery, from the working folder, or absolute "
                   "(repeatable).")
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
    _finish(summary, as_json, f"removed {len(summary['removed_ids'])} images from {summary['index_dir']}; "
                              f"{summary['indexed']} remain indexed", f"retrieval index stats {summary['index_dir']}")


@index_group.command("repair")
@index_folder
@click.option("--model", type=click.Path(dir_okay=False),
              help=f"default: the model recorded in index.json. {TRUSTED_MODEL}")
@click.option("--rebuild", is_flag=True, help="rebuild the faiss part from the shards instead of updating it.")
@relabel_option
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

    summary = _write(
        repair_index,
        index_dir,
        index_dir,
        model=model,
        rebuild=rebuild,
        gpu=gpu,
        options=_ingest_options(batch_size, workers, shard_size, max_pixels, engine),
        label_from=label_from,
        gallery_root=gallery_root,
    )
    relabelled = (f"relabelled {summary['labels']['relabelled']} images, now {_labels(summary)}; "
                  if "labels" in summary else "")
    if not as_json:
        _print_failed(summary, summary["errors"])
    _finish(summary, as_json, f"repaired {summary['index_dir']}: {relabelled}{summary['vectors']} images searchable "
                              f"({summary['faiss']}; {_problems(summary['errors'], summary['duplicates'])})",
            _serve_next(summary["index_dir"]))


@index_group.command("stats")
@index_folder
@click.option("--queries", default=500, show_default=True, help="sampled queries for recall and latency.")
@click.option("--failed", is_flag=True,
              help="instead: list every image that could not be read (or listed), with why; an unfinished build's "
                   "too.")
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
    _finish(stats, as_json,
            f"{stats['index_dir']}: {stats['vectors']} images, {stats['index_key']}, "
            f"{stats['size_on_disk_bytes']['total'] / 2**20:.1f} MiB; recall@{k} {recall:.3f} against exact search, "
            f"p50 {stats['latency']['p50_ms']:.2f} ms per query ({stats['errors']} files could not be read; "
            f"--failed lists them){_budget_text(stats.get('budget'))}",
            _serve_next(stats["index_dir"]) if stats["model"].get("source") != "embeddings" else
            f"retrieval serve --index {stats['index_dir']}   (then POST /search with an \"embedding\": no model)")


def _list_failed(index_dir: str, as_json: bool) -> None:
    """`index stats --failed`: every image the index could not read or list, one a line (JSON: one array)."""
    from retrieval.index.sources import printable_path
    from retrieval.index.stats import failed_images

    count = 0
    for count, failure in enumerate(failed_images(index_dir), start=1):  # streamed: a gallery may have millions
        if as_json:
            click.echo(("[" if count == 1 else ",") + json.dumps(failure))
        else:
            click.echo(f"{printable_path(failure['path'] or '?', limit=None)}: {_one_line(failure['error'])}")
    if as_json:
        click.echo("[]" if count == 0 else "]")
    elif count == 0:
        click.echo(f"every image of {index_dir} could be read")


@index_group.command("export")
@index_folder
@click.option("--format", "fmt", type=click.Choice(["parquet", "npy"], case_sensitive=False), default="parquet",
              show_default=True,
              help="parquet: one table with an embedding column (pandas, vector databases); npy: embeddings/*.npy + "
                   "metadata/*.parquet in the same row order (autofaiss, clip-retrieval's layout).")
@click.option("--out", required=True, type=click.Path(),
              help="FILE.parquet (one file, --format parquet) or a folder of part files; written under a temporary "
                   "name and renamed into place when complete.")
@click.option("--overwrite", is_flag=True,
              help="replace --out if it is a file or an earlier export folder (never another folder).")
@click.option("--rows-per-file", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="rows per part file of a folder export.")
@click.option("--absolute-paths", is_flag=True,
              help="write the catalogue's absolute paths instead of paths relative to the gallery (as the API shows).")
@json_option
def export_command(index_dir, fmt, out, overwrite, rows_per_file, absolute_paths, as_json) -> None:
    """Write the searchable images' ids, paths, labels, metadata and embeddings as parquet or npy files that pandas,
    autofaiss and vector databases read as they are (removed, duplicate and unreadable images are left out)."""
    import shlex

    from retrieval.index.table_export import export_index

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
    _finish(summary, as_json,
            f"exported {summary['rows']} images ({summary['embedding_dim']}-d float32 embeddings, {model}) from "
            f"{summary['index_dir']} to {where} as {summary['format']} "
            f"({files} file{'s' if files != 1 else ''}, {size_text(size)})", next_step)


def _check_k(_ctx: click.Context, _param: click.Parameter, k: int) -> int:
    """-k within the range every search accepts (``retrieval.index.search.check_k``), before the model loads."""
    from retrieval.index.search import check_k

    try:
        return check_k(k)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc


def _check_where(_ctx: click.Context, _param: click.Parameter, where: str | None):
    """--where parsed before the index and the model load (``retrieval.index.filters``)."""
    if where is None:
        return None
    from retrieval.index.filters import FilterError, parse_filter

    try:
        return parse_filter(where)
    except FilterError as exc:
        raise click.BadParameter(where_problem(exc)) from exc


def _where_summary(index, matching: int) -> str:
    """How many indexed images --where matches; for none, how paths and labels are compared, with the index's own."""
    summary = f"--where matches {matching} of {len(index)} indexed images"
    if matching or not len(index):
        return summary
    return f"{summary}: no image matches, so every result list is empty. {index.filter_table.no_match_hint()}"


DEFAULT_MAX_QUERIES = 1000  # query images one search takes: a folder given by mistake is refused, not embedded
QUERY_BATCH = 32  # queries decoded and embedded together, so that a folder's images are never all held at once


@click.command("search", cls=OptionCommand)
@click.option("--index", "index_dir", required=True, type=click.Path(file_okay=False, exists=True))
# No existence check here: a query that cannot be opened is answered with its reason, as an undecodable one is.
@click.argument("images", nargs=-1, required=True, type=click.Path())
@click.option("-k", "k", type=int, default=10, show_default=True, callback=_check_k, help="results per query.")
@click.option("--max-queries", type=click.IntRange(min=1), default=DEFAULT_MAX_QUERIES, show_default=True,
              help="the most query images one search takes, each image in a folder counted; more are refused "
                   "before the model loads.")
@click.option("--model", type=click.Path(dir_okay=False),
              help=f"default: the model recorded in index.json. {TRUSTED_MODEL}")
@click.option("--exclude-self", is_flag=True,
              help="leave out the gallery image that is the query itself (the same file bytes), as the app and the "
                   "API do.")
@click.option("--where", "where", metavar="EXPR", callback=_check_where,
              help='search only the gallery images whose catalogue columns match, e.g. --where \'label = "cat" and '
                   'price < 20\' (columns: id, path, label and a manifest\'s own, such as split; = != < <= > >=, '
                   'in (...), and, or, not).')
@click.option("--gpu", is_flag=True, help="search on the GPU (needs faiss-gpu and a GPU).")
@gallery_root_option
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table.")
@rerank_options
def search_command(index_dir, images, k, max_queries, model, exclude_self, where, gpu, gallery_root, as_json,
                   **options) -> None:
    """Find the k most similar gallery images to each query IMAGE (a folder: every image in it, recursively, sorted
    by path). A query that cannot be read is named with the reason, the others are answered, and the command then
    exits with status 1. --rerank re-orders each query's shortlist (docs/INDEX.md, "Re-ranking")."""
    from retrieval.index import Index, ModelMismatchError, load_model
    from retrieval.index.sources import printable_path
    from retrieval.rerank_defaults import gallery_filled

    rerank = rerank_config(options)
    queries = _query_list(images, max_queries)
    try:
        opened = Index.open(index_dir, embedder=load_model(model) if model else None, gpu=gpu,
                            gallery_root=gallery_root)
    except ModelMismatchError as exc:
        raise click.ClickException(f"{exc}: retrieval index upgrade {shlex.quote(str(index_dir))} --model "
                                   f"{shlex.quote(str(model))}") from exc
    with opened as index:
        if where is not None:
            matching = len(index.matching_ids(where))  # a column the index lacks fails here, before embedding
            if not as_json:
                click.echo(_where_summary(index, matching))
        # the sizes not given follow the gallery (docs/INDEX.md, "Neighbourhood sizes")
        rerank, defaults = gallery_filled(rerank, index.rerank_neighbourhood)
        answers = _answers(index, queries, k, exclude_self, where, rerank)
    if as_json:
        click.echo(json.dumps(answers, indent=2))
    else:
        for answer in answers:
            click.echo(printable_path(answer["query"], limit=None))
            if "error" in answer:
                click.echo(f"  cannot search with it: {answer['error']}")
                continue
            if answer.get("excluded_self") is not None:
                click.echo(f"  (left out: id={answer['excluded_self']}, the query itself)")
            if rerank.active:
                sizes = ", ".join(f"{name} = {value}" for name, value in rerank.params().items()
                                  if name != "candidates")
                chosen = f"; the sizes not given from the gallery: {defaults}" if defaults else ""
                click.echo(f"  re-ranked by {rerank.method}, the top {rerank.candidates} ({sizes}{chosen}); score = "
                           "cosine, then the re-ranking's score")
            for rank, r in enumerate(answer["results"], 1):  # names may hold newlines or bytes that are not UTF-8
                label = None if r["label"] is None else printable_path(r["label"], limit=None)
                path = printable_path(r["path"], limit=None)
                reranked = f"  {r['rerank_score']:+.4f}" if "rerank_score" in r else ""
                click.echo(f"  {rank:3d}  {r['score']:+.4f}{reranked}  id={r['id']}  label={label}  {path}")
    failed = [a for a in answers if "error" in a]
    if failed:
        shown = ", ".join(printable_path(a["query"]) for a in failed[:3])
        raise click.ClickException(f"{len(failed)} of {len(answers)} queries could not be read ({shown}); the "
                                   "others were answered above")


def _query_list(images: tuple[str, ...], max_queries: int) -> list[tuple[str, str | None]]:
    """The query files in order, each with the reason it cannot be searched (None: not known yet); a folder gives its
    images, found as the index builder finds them and sorted by path. Refuses more than ``max_queries``."""
    from retrieval.data.formats import IMAGE_EXTENSIONS
    from retrieval.index.sources import printable_path, walk_folder

    queries: list[tuple[str, str | None]] = []
    for image in images:
        folder = Path(image)
        if not _is_folder(folder):
            queries.append((image, None))  # opened later: a missing or unreadable file is answered with its reason
        else:
            gallery = walk_folder(folder, limit=max_queries - len(queries))
            found = sorted(item.path for item in gallery.items)
            queries.extend((path, None) for path in found)
            queries.extend((error.path, error.error) for error in gallery.errors)
            if not found and not gallery.errors:
                extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
                queries.append((image, f"a folder with no image in it (searched recursively for {extensions}); "
                                       "give a folder that holds images, or image files"))
        if len(queries) > max_queries:
            raise click.UsageError(
                f"more than {max_queries} query images (counting the images in {printable_path(image)}): pass fewer "
                "images or a smaller folder, or raise --max-queries", ctx=click.get_current_context(silent=True))
    return queries


def _is_folder(path: Path) -> bool:
    """Whether a query names a folder; a path that cannot even be looked at is left to the open that names why."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _open_problem(exc: OSError) -> str:
    """Why a query file could not be opened, and what to do about it."""
    if isinstance(exc, FileNotFoundError):
        return "no such file; check the path"
    if isinstance(exc, PermissionError):
        return "not readable (permission denied); make it readable by this user"
    return f"cannot be opened ({exc.strerror or exc}); check that it is a readable image file"


def _answers(index, queries: list[tuple[str, str | None]], k: int, exclude_self: bool, where=None,
             rerank=None) -> list[dict]:
    """Each query's answer, in order: its results (and the id left out as the query itself), or the reason it
    cannot be searched. Each file is opened once (hashed, then decoded, as the index builder does); the readable
    queries are embedded ``QUERY_BATCH`` at a time."""
    answers = []
    for start in range(0, len(queries), QUERY_BATCH):
        answers.extend(_answer_batch(index, queries[start:start + QUERY_BATCH], k, exclude_self, where, rerank))
    return answers


def _answer_batch(index, queries: list[tuple[str, str | None]], k: int, exclude_self: bool, where=None,
                  rerank=None) -> list[dict]:
    """``_answers`` for one batch of queries: decoded, embedded together and searched."""
    from retrieval.data.decode import ImageDecodeError, open_regular_file, read_image
    from retrieval.index.gallery_file import file_digest

    answers, images, digests = [], [], []
    for query, problem in queries:
        answer = {"query": _resolved(query)}
        try:
            if problem is not None:
                answer["error"] = problem
            else:
                with open_regular_file(query) as handle:
                    sha256, _ = file_digest(handle)
                    handle.seek(0)
                    images.append(read_image(handle).image)
                digests.append(sha256)
        except ImageDecodeError as exc:
            answer["error"] = str(exc)
        except OSError as exc:
            answer["error"] = _open_problem(exc)
        answers.append(answer)
    readable = [a for a in answers if "error" not in a]
    embeddings = index.embedder.embed(images) if images else []
    for answer, sha256, embedding in zip(readable, digests, embeddings, strict=True):
        row = index.indexed_by_sha256(sha256) if exclude_self else None
        excluded = None if row is None else int(row["id"])
        found = index.search(embedding[None], k, exclude_ids=() if excluded is None else (excluded,), where=where,
                             rerank=rerank)[0]
        # path: the spelling --where, index remove, the API and the app use; file: where it lies on this machine
        # (its gallery may have moved; None: a path the moved gallery has no place for)
        results = [r.to_dict() | {"path": index.public_path(r.path), "file": index.image_file(r.path)} for r in found]
        answer.update(results=results, excluded_self=excluded)
    return answers


def _resolved(query: str) -> str:
    """The query's absolute path as the answer names it; a path that cannot be resolved (a symlink loop) as given."""
    try:
        return str(Path(query).resolve())
    except (OSError, RuntimeError):
        return str(Path(query).absolute())


if __name__ == "__main__":
    sys.exit(index_group())
