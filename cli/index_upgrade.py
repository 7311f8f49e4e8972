"""`retrieval index upgrade|compare` and `retrieval compare`: moving a gallery to a new model, and measuring first how
much a new model changes its neighbourhoods."""

from __future__ import annotations

import json
from pathlib import Path

import click

from retrieval.cli.config_options import command_options
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import (
    finish,
    gallery_root_option,
    index_folder,
    ingest_options,
    ingest_settings,
    json_option,
    run_writer,
    serve_next,
)
from retrieval.cli.index_milvus import sync_options
from retrieval.cli.index_options import IndexOptions


@click.command("upgrade", cls=OptionCommand)
@index_folder
@sync_options(switch=True)
@command_options(IndexOptions, "upgrade_model", "order", "commit_every", "native", "force")
@ingest_options
@gallery_root_option
@json_option
def upgrade_command(index_dir, model, order, commit_every, native, force, batch_size, workers, shard_size, max_pixels,
                    gpu, gallery_root, as_json) -> None:
    """Re-embed the gallery with a new model while servers keep answering (resumable: run it again after a stop).

    A model declared compatible with the index's (trained with --compatible-with it) serves at once and its vectors
    replace the old ones batch by batch; a new embedding size does so through the model's compatible output, its
    projection into the old space (--native: into its own size instead, a swap). Any other model's vectors are
    written beside the old ones and swapped in at the end. Either way index.json then names the new model (and the
    output its vectors came from) and the old vectors are deleted.

    Before it begins, a compatible model its training measured not compatible is refused, and so is a model that
    searches the index's own labels worse than its vectors do (measured on a sample of them; --force goes on). A
    text model recorded for the old space is turned off where the new vectors leave that space, saying how to
    re-fit it."""
    from retrieval.index.writing.upgrade import upgrade_index

    if gpu:
        raise click.BadParameter("the upgrade searches and trains faiss on the CPU", param_hint="--gpu")
    summary = run_writer(upgrade_index, index_dir, index_dir, model=model, order=order, commit_every=commit_every,
                         options=ingest_settings(batch_size, workers, shard_size, max_pixels, {}), native=native,
                         gallery_root=gallery_root, force=force)
    if summary["mode"] == "none":
        finish(summary, as_json, f"{summary['index_dir']} already uses model {summary['model_hash']}: nothing to do")
        return
    through = (f", through its compatible output {summary['model_output']} into the old "
               f"{summary['embedding_dim']}-d space" if summary.get("model_output_space") else "")
    how = (f"served as it came (declared compatible{through})" if summary["mode"] == "mixed"
           else f"swapped in at the end ({summary['embedding_dim']}-d vectors, faiss rebuilt)")
    unreadable = f"; {summary['unreadable']} unreadable now, left out" if summary["unreadable"] else ""
    finish(summary, as_json,
           f"upgraded {summary['index_dir']} to model {summary['model_hash']}: {summary['reembedded']} images "
           f"re-embedded, {how}{unreadable}; {summary['deleted_shards']} shards of the old vectors deleted"
           + (_measured_line(summary.get("compatibility"), summary.get("int8")) if summary["mode"] == "mixed" else "")
           + _checked_lines(summary, index_dir, model), serve_next(summary["index_dir"]))


def _checked_lines(summary: dict, index_dir: str, model: str | None) -> str:
    """What the upgrade measured on the index's labels before it began, what --force went past, and the text
    model's fate (off: the commands that re-fit one)."""
    from retrieval.index.writing.upgrade_checks import labels_sentence
    from retrieval.index.writing.upgrade_text import text_sentence
    from retrieval.text.text_index import text_off_problem

    lines = [f"measured first on the index's labels: {labels_sentence(summary['on_labels'])}"
             if summary.get("on_labels") else "",
             f"measured first: {text_sentence(summary['on_text'])}" if summary.get("on_text") else ""]
    lines += [f"upgraded anyway (--force): {reason}" for reason in summary.get("forced") or []]
    text = summary.get("text_model") or {}
    if text.get("state") == "kept":
        lines.append(f"text search kept: {text['reason']}")
    elif text.get("state") == "off":
        off = text_off_problem(text, index_dir, model or "NEW.onnx")
        lines.append(f"text search is OFF: {off}")
    return "".join(f"\n{line}" for line in lines if line)


def _measured_line(measured: dict | None, int8: dict | None = None) -> str:
    """A mixed upgrade's second line: how well new queries met the old vectors, as the model's training measured (an
    int8 model: as its quantization measured it against its parent)."""
    from retrieval.compatibility import compatibility_sentence, int8_sentence

    if int8 is not None:  # the index's own model quantized: what matters is how close to it int8 stayed
        return f"\nmeasured when it was quantized: {int8_sentence(int8)}"
    if measured is None:
        return ("\nmeasured compatibility: none recorded with the model (`retrieval evaluate --checkpoint NEW "
                "--gallery-model OLD` measures it)")
    return f"\nmeasured when the model was trained: {compatibility_sentence(measured)}"


# --sample, -k, --workers and --json of the two model comparisons
comparison_options = command_options(IndexOptions, "sample", "neighbours", "threads", "as_json")


@click.command("compare", cls=OptionCommand)
@index_folder
@command_options(IndexOptions, "compared_model")
@comparison_options
def index_compare_command(index_dir, model, sample, k, workers, as_json) -> None:
    """How much MODEL changes the gallery's neighbourhoods, no labels needed: for each sampled image, the share of
    its k nearest images under the index's model that stay among its k nearest under MODEL. With labels, each
    model's Recall@1 on the same images too."""
    from retrieval.index import load_model
    from retrieval.index.curation.compare import compare_with_index

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
@command_options(IndexOptions, "new_model", "baseline", "compare_images")
@comparison_options
def compare_command(model, baseline, images, sample, k, workers, as_json) -> None:
    """How much MODEL changes the neighbourhoods of any folder's images against BASELINE, no labels needed (with
    sub-folders as labels, each model's Recall@1 too). For an index's own gallery: retrieval index compare."""
    from retrieval.index import load_model
    from retrieval.index.curation.compare import compare_on_folder, model_names

    summary = compare_on_folder(images, load_model(baseline), load_model(model), sample=sample, k=k, workers=workers)
    # runs/a/model.onnx and runs/b/model.onnx must not both read "model.onnx"
    names = model_names(baseline, model, summary["old_model_hash"], summary["new_model_hash"])
    _show_comparison(summary, as_json, f"in {images}", *names)
