"""The one ``retrieval`` command line: train, evaluate, losses, backbones and demo here; data, analyze, export,
index, search and serve from their areas' modules (``_register_area_commands``)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from retrieval.cli.config_options import config_options, option_values, parse_params, shared_option
from retrieval.cli.errors import OptionGroup
from retrieval.cli.options import apply_options, rerank_config, rerank_options
from retrieval.compatibility import KEPT
from retrieval.data.resize_modes import PRETRAINED_RESIZE
from retrieval.options import LABEL_COLUMN_HELP, TRUSTED_CHECKPOINT
from retrieval.records.run_config import RunConfig
from retrieval.serve.defaults import DEFAULT_HOST, DEFAULT_PORT
from retrieval.train.config import TrainConfig


class FriendlyErrors(OptionGroup):
    """Turn the library's expected errors into one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (ValueError, FileNotFoundError, FileExistsError, KeyError, RuntimeError) as exc:
            # click's own Exit/Abort are RuntimeErrors in click >= 8.2: let click handle them
            if isinstance(exc, (click.ClickException, click.exceptions.Exit, click.exceptions.Abort)):
                raise
            # the message speaks for itself: no exception class name in front of it
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            raise click.ClickException(str(message)) from exc


@click.group(cls=FriendlyErrors, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="retrieval")
@click.option("--verbose/--quiet", "-v/-q", default=None,
              help="notices on stderr: also the debug ones (-v), or only warnings and errors (-q).")
@click.pass_context
def main(ctx: click.Context, verbose: bool | None) -> None:
    """Image embedding retrieval: train an embedder, evaluate it, export it, index and search a gallery."""
    ctx.call_on_close(show_notices(logging.INFO if verbose is None else logging.DEBUG if verbose else logging.WARNING))


def show_notices(level: int) -> Callable[[], None]:
    """Print the library's notices (``logging`` under ``retrieval``) from ``level`` up on stderr, as plain lines;
    returns the function that undoes it. Other libraries' loggers keep their levels."""
    handler = logging.StreamHandler(sys.stderr)  # the stderr of now: click's test runner swaps it per invocation
    handler.setFormatter(logging.Formatter("%(message)s"))
    root, library = logging.getLogger(), logging.getLogger("retrieval")
    previous_level = library.level
    root.addHandler(handler)  # on the root: a later logging.basicConfig() does nothing, so nothing prints twice
    library.setLevel(level)

    def undo() -> None:
        root.removeHandler(handler)
        library.setLevel(previous_level)

    return undo


# --- train ----------------------------------------------------------------------------------------
TRAIN_COMMAND_OPTIONS = [  # how to run, not what: these are not training settings and stay out of config.json
    click.option("--config", "config_file", type=click.Path(dir_okay=False),
                 help="a TOML or JSON file of training options (the keys of docs/TRAINING.md's table); the options "
                      "given here replace its values."),
    click.option("--nproc", type=int, metavar="N",
                 help="train in N processes on this machine (torchrun; one per GPU on CUDA). Several machines: "
                      "torchrun ... -m retrieval train (docs/SCALE.md)."),
    click.option("--max-restarts", type=int, default=0, show_default=True,
                 help="with --nproc: restart the processes this many times after a failure (from last.pt)."),
    click.option("--json", "as_json", is_flag=True, help="end with the run's summary as JSON (for programs)."),
    click.option("--offline", is_flag=True,
                 help="never touch the network: pretrained weights from torch.hub's / Hugging Face's cache or a "
                      "shipped package only (also RETRIEVAL_OFFLINE=1 or HF_HUB_OFFLINE=1)."),
]


def config_from_options(config_file: str | None, **options: Any) -> TrainConfig:
    """The run's ``TrainConfig``: its defaults, replaced by the config file's values, replaced by the options."""
    from retrieval.train.config import load_config_file

    file_values = load_config_file(config_file) if config_file else {}
    return TrainConfig.from_values({**file_values, **option_values(TrainConfig, file_values, options)})


@main.command("train", needs="train")
@functools.partial(apply_options, options=TRAIN_COMMAND_OPTIONS[:1] + config_options(TrainConfig)
                   + TRAIN_COMMAND_OPTIONS[1:])
def train_command(config_file, nproc, max_restarts, as_json, offline, **options) -> None:
    """Train an embedder; writes config.json, metrics.jsonl, last.pt, best.pt, report.json to --out."""
    from retrieval.models.weights import offline_scope, resolve_weights
    from retrieval.train import train
    from retrieval.train.distributed import ensure_run_folder, env_world_size, launch, launched

    cfg = config_from_options(config_file, **options)
    if cfg.pretrained and cfg.weights is None:
        resolve_weights(cfg.backbone, offline)  # offline weights that are missing: fail before any work
    ensure_run_folder(cfg)  # before --nproc starts the processes: they all write this one folder
    if nproc is not None and nproc > 1:
        if env_world_size() > 1:
            raise click.UsageError("--nproc launches the processes itself: leave it out under torchrun")
        code = launch(nproc, cfg.to_dict(), Path(cfg.out), max_restarts=max_restarts,
                      extra_args=("--offline",) if offline else ())
        if code:
            raise click.ClickException(f"the {nproc}-process run failed (torchrun exit code {code}); the errors "
                                       f"above name the rank; --resume continues it from {cfg.out}/last.pt")
        from retrieval.serve.report_files import load_report

        report = load_report(Path(cfg.out) / "report.json").data  # the job's last attempt wrote it
    else:
        with offline_scope(offline):  # the backbone factories see --offline (not a training setting: not in cfg)
            report = train(cfg)
        if not report or launched():  # ranks > 0 return no report; --nproc's launcher says rank 0's
            return
    from retrieval.cli.train_summary import export_for_the_index, label_free_summary

    summary = _summary(cfg, report)
    upgrade = export_for_the_index(cfg, report, quiet=as_json)
    if upgrade is not None:
        summary["model"], summary["next"] = upgrade
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    before, after, best = (summary[key] or {} for key in ("before", "after", "best"))
    if cfg.labels == "none" and "recall@1" not in after and KEPT in after:  # no labels: how far the neighbours moved
        label_free_summary(cfg, report, after, summary["report"], upgrade)
        return
    change = f"{before['recall@1']:.4f} -> " if "recall@1" in before else ""
    best_epoch = (report.get("best") or {}).get("epoch")
    pretrained, keep = report.get("pretrained_export") or {}, report.get("keep_pretrained") is True
    if keep:  # the run's model does not beat what the user serves already: why, above the run's line
        click.echo(str(report.get("keep_pretrained_reason") or "keep the pretrained export"))
    click.echo(f"trained {cfg.out}: recall@1 {change}{after.get('recall@1', float('nan')):.4f}"
               + (f" (best {best['recall@1']:.4f} at epoch {best_epoch}, in best.pt)" if "recall@1" in best else "")
               + (f"; the pretrained export {pretrained['recall@1']:.4f}" if "recall@1" in pretrained else "")
               + ("; keep the pretrained export" if keep else "") + f"; report {summary['report']}")
    if summary["selected_on"] == "validation":
        from retrieval.reports import VALIDATION_HOLDS

        held = VALIDATION_HOLDS.get(report.get("validation_by") or "classes")
        click.echo(f"best.pt was chosen on the validation split ({held}), not on the test split these numbers come "
                   "from")
    elif summary["selection_note"]:  # the run warned at its start; the summary says it again beside the numbers
        click.echo(f"warning: {summary['selection_note']}", err=True)
    checkpoint = Path(cfg.out) / ("wise.pt" if report.get("wise") else "best.pt")
    if cfg.resize != PRETRAINED_RESIZE and pretrained:  # measured as the run prepares images, not as the quick path
        click.echo(f"note: this run and the export it was measured against use --resize {cfg.resize}; `retrieval "
                   f"export --pretrained` gives --resize {PRETRAINED_RESIZE} unless told otherwise: train with "
                   f"--resize {PRETRAINED_RESIZE} to measure against the export you serve", err=True)
    if keep and upgrade is None and pretrained.get("command"):  # what to export instead
        click.echo(f"next: {pretrained['command']}   (the pretrained export; the trained model is in "
                   f"{checkpoint})")
    elif upgrade is None:
        click.echo(f"next: retrieval export --checkpoint {checkpoint} --out {Path(cfg.out) / 'model.onnx'}")


def _summary(cfg: TrainConfig, report: dict) -> dict:
    return {"run": cfg.out, "report": str(Path(cfg.out) / "report.json"),
            "before": _headline(report.get("baseline")), "after": _headline(report.get("last")),
            "best": _headline(report.get("best")), "selected_on": report.get("selected_on"),
            "selection_note": report.get("selection_note"), "pretrained_export": report.get("pretrained_export"),
            "keep_pretrained": report.get("keep_pretrained"),
            "keep_pretrained_reason": report.get("keep_pretrained_reason")}


def _headline(metrics: dict | None) -> dict | None:
    if not metrics:
        return None
    keys = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision", "nmi", "f1", "linear_probe", KEPT)
    return {k: round(float(metrics[k]), 4) for k in keys if k in metrics}


# --- evaluate -------------------------------------------------------------------------------------
@main.command("evaluate", needs="train")
@click.option("--checkpoint", required=True, type=click.Path(dir_okay=False), help=TRUSTED_CHECKPOINT)
@shared_option(TrainConfig, "dataset", help="the data set to evaluate on. [default: the checkpoint's]")
@shared_option(TrainConfig, "data", help="the data set's root. [default: the checkpoint's]")
@click.option("--split", default=None,
              help="default: the checkpoint's evaluation split (test; inshop: query, against the gallery).")
@shared_option(TrainConfig, "dataset_kwargs")
@shared_option(TrainConfig, "label_column", help=f"{LABEL_COLUMN_HELP} [default: the checkpoint's, else label]")
@shared_option(TrainConfig, "eval_limit", "--limit")
@shared_option(TrainConfig, "linear_probe", default=False,
               help="also fit a logistic regression on train embeddings and report test accuracy.")
@shared_option(TrainConfig, "eval_batch_size", "--batch-size", default=128)
@shared_option(TrainConfig, "device", default="auto")
@shared_option(TrainConfig, "workers")
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="report file (default: next to the checkpoint).")
@click.option("--pictures/--no-pictures", default=True, show_default=True,
              help="also draw a grid of queries with their top 5 (retrieval.png) and a 2-D map of the embeddings "
                   "(embedding_map.png) next to the report.")
@click.option("--map", "map_method", type=click.Choice(["auto", "umap", "tsne"]), default="auto", show_default=True,
              help="the embedding map: UMAP (umap-learn, when installed) or t-SNE (scikit-learn).")
@click.option("--gallery-model", type=click.Path(dir_okay=False, exists=True), metavar="OLD",
              help="also measure compatibility with OLD (a checkpoint or an .onnx): its own metrics, and the "
                   "checkpoint's queries against the gallery OLD embedded (BCT's cross-model test).")
@rerank_options
@click.option("--rerank-choose", is_flag=True,
              help="with --rerank: choose the sizes not given (k; k1 and k2) on the checkpoint's validation classes "
                   "(each tried, leave-one-out MAP@R, at most --limit or 2,000 images), then measure the split with "
                   "them; the report lists every size tried.")
@click.option("--json", "as_json", is_flag=True, help="print the metrics as JSON (for programs).")
def evaluate_command(checkpoint, dataset, data, split, dataset_kwargs, label_column, eval_limit, linear_probe,
                     eval_batch_size,
                     device, workers, out_path, pictures, map_method, gallery_model, rerank_choose, as_json,
                     **options) -> None:
    """Evaluate a checkpoint: prints its metrics and writes an evaluate report (eval_report.json next to the
    checkpoint, or --out). With --gallery-model OLD: three blocks, new (the checkpoint), old (OLD) and cross_model
    (the checkpoint's queries against OLD's gallery), and BCT's verdict (compatible, not compatible or too few
    queries to tell: a bootstrap interval over the queries, docs/TRAINING.md). With --rerank a block
    "reranked": the kNN metrics with each query's shortlist re-ranked as `retrieval search` re-ranks it (the plain
    metrics stay as they are; sizes not given follow the split's labels as an index's follow its gallery, or with
    --rerank-choose are chosen on the validation classes). --json prints all of it as JSON."""
    from retrieval.analysis.pictures import eval_set_pictures
    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_dataset, resolve_device
    from retrieval.metrics.evaluation import (
        checkpoint_dataset,
        embed_eval_rows,
        eval_arrays,
        evaluate_embeddings,
        load_eval_sets,
        metrics_device,
    )
    from retrieval.models import load_checkpoint, load_embedder
    from retrieval.reports import evaluate_report, save_report

    rerank = rerank_config(options)
    if rerank_choose and not rerank.unset():
        raise click.UsageError("--rerank-choose chooses the re-ranking's sizes that are not given: give --rerank "
                               "qe|dba|kreciprocal and leave out --rerank-k (qe, dba) or --rerank-k1/--rerank-k2 "
                               "(kreciprocal)")
    trained = load_checkpoint(checkpoint).train_config
    given = parse_params(dataset_kwargs, "--dataset-param") | ({"label_column": label_column} if label_column else {})
    dataset, data, kwargs = checkpoint_dataset(trained, dataset, data, given)
    split = split or (trained.eval_split if trained.holds("eval_split") else "test")
    seed = trained.seed if trained.holds("seed") else 0
    dev = resolve_device(device)
    model = load_embedder(checkpoint).to(dev)
    tf = build_transforms(model.preprocessing, train=False)
    sets = load_eval_sets(dataset, data, split, tf, eval_limit, seed, **kwargs)
    # checked before anything is embedded: a checkpoint without validation classes is refused at once
    validation = _validation_set(trained, (dataset, data, kwargs), tf, sets.query, eval_limit) if rerank_choose \
        else None
    query, gallery = embed_eval_rows(model, sets, dev, eval_batch_size, workers)
    q, ql, g, gl = eval_arrays(query, gallery)
    metrics = evaluate_embeddings(q, ql, g, gl, device=metrics_device(dev))  # --device cuda: the kNN there too
    if linear_probe:
        from retrieval.metrics import linear_probe as probe
        from retrieval.metrics.evaluation import probe_test_labels

        train_set = load_dataset(dataset, data, split="train", transform=tf, **kwargs)
        tr, trl = embed_dataset(model, train_set, eval_batch_size, dev, workers, desc="embed train")
        keep, labels = probe_test_labels(ql, sets.query, train_set)
        metrics["linear_probe"] = probe(tr, trl, q[keep], labels)
    out = Path(out_path) if out_path else Path(checkpoint).with_name("eval_report.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = {}
    if pictures:
        plots = eval_set_pictures(out.parent, sets, (q, ql, g, gl), query.indices,
                                  gallery.indices if gallery is not None else None, seed=seed,
                                  method=map_method)
    report = evaluate_report(checkpoint, dataset, data, split, kwargs, len(ql), model.config, metrics, plots)
    reranked: dict = {}
    if rerank.active:  # the same top-k re-ranked as a search would: the plain metrics stay beside it
        from retrieval.metrics.evaluation import reranked_metrics

        chosen = None
        if validation is not None:
            rerank, chosen = _rerank_chosen_on_validation(model, validation, rerank, dev, eval_batch_size, workers)
        reranked = {"reranked": reranked_metrics(q, ql, g, gl, rerank, device=metrics_device(dev))}
        if chosen is not None:
            reranked["reranked"]["chosen"] = chosen
        report.update(reranked)
    if gallery_model is None:
        save_report(report, out)
        if as_json:
            click.echo(json.dumps({**metrics, **reranked, "report": str(out)}, indent=2))
            return
        click.echo(f"{checkpoint} on {dataset} {split} ({len(ql):,} queries): {_metrics_text(metrics)}")
        _echo_reranked_and_report(checkpoint, reranked, out, plots)
        return
    from retrieval.compatibility import compatibility_metrics, compatibility_sentence
    from retrieval.errors import parameters_named
    from retrieval.models import in_compatible_space
    from retrieval.train.compatible import OldModel

    with parameters_named(path="gallery_model"):
        old = OldModel(gallery_model, model.preprocessing, device=dev)
    # the same images as the checkpoint's rows: the sets are read in the same order, each image given to OLD as
    # the checkpoint saw it (taken back to pixels and to OLD's size and normalisation where they differ)
    old_query, old_gallery = embed_eval_rows(old, sets, dev, eval_batch_size, workers)
    with parameters_named(cross_query="gallery_model"):  # OLD of another size than a model without a projection
        blocks = compatibility_metrics(q, old_query.embeddings, ql, g, None if old_gallery is None else
                                       old_gallery.embeddings, gl, cross_query=in_compatible_space(model, q))
    sentence = compatibility_sentence(blocks)
    report["compatibility"] = {**blocks, "gallery_model": str(gallery_model)}
    save_report(report, out)
    if as_json:
        click.echo(f"{Path(checkpoint).name} against {Path(gallery_model).name}: {sentence}", err=True)
        click.echo(json.dumps({"new": metrics, "old": blocks["old"], "cross_model": blocks["cross_model"],
                               "verdict": blocks["verdict"], "interval": blocks["interval"], "criterion": sentence,
                               **reranked, "report": str(out)}, indent=2))
        return
    click.echo(f"{checkpoint} (new) against {gallery_model} (old) on {dataset} {split} ({len(ql):,} queries):")
    for name, shown in (("new", metrics), ("old", blocks["old"]), ("cross-model", blocks["cross_model"])):
        click.echo(f"  {name + ':':<13}{_metrics_text(shown)}")
    click.echo(sentence)
    _echo_reranked_and_report(checkpoint, reranked, out, plots)


def _metrics_text(metrics: dict) -> str:
    """The headline metrics on one line, for people: ``recall@1 0.8125, recall@2 0.9000, ...``."""
    return ", ".join(f"{key} {value:.4f}" for key, value in (_headline(metrics) or {}).items())


VALIDATION_CHOICE_IMAGES = 2000  # --rerank-choose's validation images at most, without --limit


def _validation_set(trained: RunConfig, source: tuple, transform, test_set, limit: int | None):
    """The checkpoint's validation split, as its training held it out (at most ``limit`` or
    ``VALIDATION_CHOICE_IMAGES`` of its images, seeded), and how many classes it holds."""
    from retrieval.data import load_dataset
    from retrieval.metrics.evaluation import seeded_subset
    from retrieval.train.data import carve_validation

    dataset, data, kwargs = source
    seed = trained.seed if trained.holds("seed") else 0
    train_set = load_dataset(dataset, data, split="train", transform=transform, **kwargs)
    per_class = trained.per_class if trained.holds("per_class") else \
        TrainConfig.__dataclass_fields__["per_class"].default
    carved = carve_validation(trained.val_fraction, train_set, test_set, seed, per_class)
    validation = carved.validation
    if validation is None:
        raise click.ClickException(f"--rerank-choose chooses on the checkpoint's validation split, and its "
                                   f"training had none ({carved.none_because}): give the sizes (--rerank-k; "
                                   "--rerank-k1 and --rerank-k2), or leave them to the split's labels without "
                                   "--rerank-choose")
    classes = len(set(validation.labels))
    cap = limit or VALIDATION_CHOICE_IMAGES
    return (seeded_subset(validation, cap, seed) if len(validation) > cap else validation), classes


def _rerank_chosen_on_validation(model, validation: tuple, rerank, device, batch_size: int, workers) -> tuple:
    """The re-ranking with its unset sizes chosen on the validation set, and the record of the choice."""
    from retrieval.inference import embed_dataset
    from retrieval.metrics.evaluation import choose_rerank, metrics_device

    images, classes = validation
    vectors, labels = embed_dataset(model, images, batch_size, device, workers, desc="embed validation")
    chosen, tried = choose_rerank(vectors, labels, rerank, device=metrics_device(device))
    return chosen, {"on": "validation", "images": len(labels), "classes": classes, "tried": tried}


def _echo_reranked_and_report(checkpoint: str, reranked: dict, out: Path, plots: dict) -> None:
    if reranked:
        block = reranked["reranked"]
        sizes = ", ".join(f"{name} = {value}" for name, value in block["params"].items() if name != "candidates")
        if "chosen" in block:
            chosen = block["chosen"]
            best = next(row for row in chosen["tried"] if row["params"] is not None)
            plain = next(row for row in chosen["tried"] if row["params"] is None)
            click.echo(f"re-ranking sizes chosen on {chosen['images']:,} validation images of {chosen['classes']} "
                       f"classes: {sizes} (MAP@R {best['map@r']:.4f} there; {plain['map@r']:.4f} without "
                       f"re-ranking; {len(chosen['tried']) - 1} tried, in the report)")
        elif "defaults" in block:
            click.echo(f"re-ranking sizes {sizes}, from the split's labels: {block['defaults']}")
        click.echo(f"re-ranked ({block['method']}): {_metrics_text(block['metrics'])}")
    pictures = f" (pictures: {', '.join(sorted(plots.values()))})" if plots else ""
    click.echo(f"report {out}{pictures}")
    click.echo(f"next: retrieval export --checkpoint {checkpoint} --out {Path(checkpoint).with_name('model.onnx')}")


# --- listings -------------------------------------------------------------------------------------
@main.command("losses", needs="train")
def losses_command() -> None:
    """List the registered losses (paper equation, defaults, readings) and hard-negative combinations."""
    from retrieval import losses

    for name in losses.available():
        info = losses.describe(name)
        click.echo(f"{name}: {info['equation']}")
        click.echo("  defaults: " + (", ".join(f"{k}={v}" for k, v in info["defaults"].items()) or "none"))
        for option, text in info["readings"].items():
            click.echo(f"  {option}: {text}")
    combos = losses.available_negatives()
    click.echo("with --negatives: " + (", ".join(f"{n}+{m}" for n, m in combos) or "none"))


@main.command("backbones", needs="train")
def backbones_command() -> None:
    """List the registered backbones."""
    from retrieval.models import backbone_names

    click.echo("\n".join(backbone_names()))


# --- demo -----------------------------------------------------------------------------------------
@main.command("demo", needs="train")
@click.option("--out", default="artifacts/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--epochs", default=None, type=int, help="override the recipe's number of epochs.")
@click.option("--serve/--no-serve", "start_server", default=True, show_default=True,
              help="start the app on the built index at the end.")
@click.option("--host", default=DEFAULT_HOST, show_default=True)
@click.option("--port", default=DEFAULT_PORT, show_default=True, type=int)
def demo_command(out: str, epochs: int | None, start_server: bool, host: str, port: int) -> None:
    """The main job on the emoji data: prepare, train, evaluate, export, index, then serve the app."""
    from retrieval.cli.demo import run_demo

    run_demo(Path(out), epochs=epochs)
    if start_server:
        from retrieval.serve.defaults import DEFAULT_RESULTS
        from retrieval.serve.server import ServerConfig, serve

        report = Path(out) / "run" / "report.json"
        # the project's results grid measured the demo's data: its Results tab, as `python app.py` shows it
        results = DEFAULT_RESULTS if DEFAULT_RESULTS.is_file() else None
        click.secho(f"starting the app at http://{host}:{port}/ (Ctrl-C stops it; `python app.py` restarts it)",
                    bold=True)
        serve(ServerConfig(index_dir=Path(out) / "index", report=report, results=results, host=host, port=port))


def _register_area_commands() -> None:
    """Each area keeps its commands in its own module; they join the one command line here."""
    from retrieval.cli.analyze import analyze_group
    from retrieval.cli.curation import audit_command, duplicates_command, index_audit_command
    from retrieval.cli.data import data_group
    from retrieval.cli.export import export_command
    from retrieval.cli.index import compare_command, index_group, search_command
    from retrieval.cli.results import results_group
    from retrieval.cli.runs import runs_group
    from retrieval.cli.serve import serve_command
    from retrieval.cli.text import text_group

    for command in (duplicates_command, index_audit_command):
        index_group.add_command(command)
    for command in (data_group, analyze_group, export_command, index_group, search_command, compare_command,
                    audit_command, serve_command, results_group, runs_group, text_group):
        main.add_command(command)


_register_area_commands()

if __name__ == "__main__":
    sys.exit(main())
