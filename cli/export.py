"""``retrieval export``: a training checkpoint, or a pretrained backbone as it is, -> one verified ONNX file with
metadata; with ``--int8``, also its int8 quantization, calibrated on the user's images and verified against it (or
an existing fp32 export quantized, ``--onnx``, which needs no PyTorch)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from retrieval.cli.errors import OptionCommand
from retrieval.cli.export_next import export_next_step
from retrieval.data.resize_modes import PRETRAINED_RESIZE, RESIZE_MODES
from retrieval.errors import ParameterError
from retrieval.options import TRUSTED_CHECKPOINT
from retrieval.utils.printable import printable_path

# the fp32 parent an int8 export of a checkpoint or a backbone writes beside OUT: model.onnx -> model-fp32.onnx
PARENT_SUFFIX = "-fp32"


class ExportCommand(OptionCommand):
    """Needs the train extra, except to quantize an existing export (``--onnx``), which onnxruntime does alone."""

    def invoke(self, ctx: click.Context) -> object:
        if ctx.params.get("onnx") is None:
            return super().invoke(ctx)
        needs, self.needs = self.needs, None
        try:
            return super().invoke(ctx)
        finally:
            self.needs = needs


def parent_path(out: Path) -> Path:
    """Where ``--int8`` writes the fp32 model it quantizes: beside OUT, its name ending ``-fp32``."""
    return out.with_name(f"{out.stem}{PARENT_SUFFIX}{out.suffix or '.onnx'}")


@click.command("export", cls=ExportCommand, needs="train")
@click.option("--checkpoint", type=click.Path(dir_okay=False),
              help=f"training checkpoint (RUN_DIR/best.pt or last.pt). {TRUSTED_CHECKPOINT}")
@click.option("--pretrained", "backbone", metavar="BACKBONE",
              help="instead of a checkpoint: a pretrained backbone as it is, untrained (its pooled features, "
                   "L2-normalised), e.g. efficientnet_lite0 or timm:<name>; its weights are downloaded once unless "
                   "cached or shipped with a package.")
@click.option("--image-size", type=click.IntRange(32, 1024), default=None,
              help="with --pretrained: the input's side in pixels. [default: the backbone's own]")
@click.option("--resize", type=click.Choice(RESIZE_MODES), default=None,
              help="with --pretrained: how an image becomes square: crop (its centre) or pad (the whole image, "
                   f"letterboxed). [default: {PRETRAINED_RESIZE}] (a checkpoint keeps the mode it was trained with)")
@click.option("--onnx", type=click.Path(dir_okay=False, exists=True),
              help="with --int8, instead of a checkpoint: an fp32 export (`retrieval export`) to quantize; needs no "
                   "PyTorch, and an index that model built is searched with the int8 one as it is.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="ONNX file to write, e.g. model.onnx.")
@click.option("--opset", type=click.IntRange(min=7), default=None,
              help="ONNX opset (default: the exporter's recommended one).")
@click.option("--fp16", is_flag=True, help="float16 weights and activations (inputs/outputs stay float32).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="compare onnxruntime with PyTorch on real images at batch 1 and 7.")
@click.option("--int8", is_flag=True,
              help="OUT is the model quantized to int8 (measured 2.1-2.2x fp32's images/s on 2 cores, 1.3x on "
                   "16), calibrated on --calibration and verified against the fp32 model, written beside it as "
                   "OUT-fp32.onnx (or --onnx); refused, nothing written, where it loses more than the bounds of "
                   "docs/INDEX.md, \"int8 on the CPU\".")
@click.option("--calibration", type=click.Path(exists=True),
              help="with --int8: a folder or manifest (.csv, .parquet) of your own images, like the gallery's; a "
                   "seeded sample calibrates, others verify.")
@click.option("--calibration-images", type=click.IntRange(min=1), default=None, show_default=False,
              help="with --int8: images sampled to calibrate. [default: 256]")
@click.option("--calibration-seed", type=int, default=0, show_default=True, help="with --int8: the sample's seed.")
@click.option("--text-tower/--no-text-tower", default=True, show_default=True,
              help="with --pretrained: also write OUT's zero-shot text tower beside it (OUT.text.onnx: the backbone's "
                   "ImageNet class names mapped onto its classifier, so an index of the model is searched by text "
                   "with no captions; efficientnet_lite0), named in OUT's metadata.")
@click.option("--json", "as_json", is_flag=True, help="end with the file's metadata as JSON (for programs).")
def export_command(checkpoint: str | None, backbone: str | None, image_size: int | None, resize: str | None,
                   onnx: str | None, out: str, opset: int | None, fp16: bool, verify: bool, int8: bool,
                   calibration: str | None, calibration_images: int | None, calibration_seed: int,
                   text_tower: bool, as_json: bool) -> None:
    """Export a trained embedder (backbone, head, L2 norm), or a pretrained backbone as it is (--pretrained), to
    ONNX with a dynamic batch axis; with --int8, quantized for the CPU, calibrated on your images."""
    if int8 or onnx is not None:
        _check_int8_options(checkpoint, backbone, onnx, int8, fp16, calibration)
    elif calibration is not None or calibration_images is not None:
        raise click.UsageError("--calibration and --calibration-images apply to --int8")
    if onnx is not None:
        _int8(Path(onnx), Path(out), calibration, calibration_images, calibration_seed, as_json)
        return
    from retrieval.export.onnx_export import ExportVerificationError, export_checkpoint, export_pretrained

    if (checkpoint is None) == (backbone is None):
        raise click.UsageError("give either --checkpoint (a trained model) or --pretrained BACKBONE (a backbone "
                               "as it is, untrained), not both" if checkpoint else
                               "give --checkpoint RUN_DIR/best.pt (a trained model) or --pretrained BACKBONE (e.g. "
                               "efficientnet_lite0: a backbone as it is, untrained)")
    if image_size is not None and backbone is None:
        raise click.UsageError("--image-size applies to --pretrained (a checkpoint keeps the size it was trained at)")
    if resize is not None and backbone is None:
        raise click.UsageError("--resize applies to --pretrained (a checkpoint keeps the mode it was trained with: "
                               "`retrieval train --resize`)")
    target = parent_path(Path(out)) if int8 else out
    try:
        if backbone is not None:
            result = export_pretrained(backbone, target, image_size, resize or PRETRAINED_RESIZE, opset=opset,
                                       fp16=fp16, verify=verify, log=click.echo)
        else:
            result = export_checkpoint(checkpoint, target, opset=opset, fp16=fp16, verify=verify, log=click.echo)
    except ExportVerificationError as exc:
        raise click.ClickException(f"verification failed: {exc}") from exc
    except ParameterError:
        raise  # the command names its option (--pretrained, --image-size)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    if backbone is not None and text_tower:  # before --int8: the int8 model takes its parent's metadata
        result.metadata.update(_zero_shot_tower(backbone, Path(result.path), Path(out), result.metadata["model_hash"],
                                                progress=not as_json))
    verdict = _run_verdict(checkpoint) if checkpoint is not None else None
    if int8:
        if verdict and verdict["line"] and not as_json:  # the run measured it no better than the pretrained export
            click.echo(verdict["line"])
        _int8(Path(result.path), Path(out), calibration, calibration_images, calibration_seed, as_json)
        return
    meta = result.metadata
    if as_json:
        click.echo(json.dumps({"path": str(result.path), "precision": result.precision, "metadata": meta,
                               "verified": result.verification is not None,
                               **({"keep_pretrained": verdict["keep_pretrained"]} if verdict else {})}, indent=2))
        return
    # a model trained --compatible-with an old one of another size: its second output, into the old space
    second = (f" (and {meta['compatible_output']}, {meta['compatible_dim']}-d, into the old model's space)"
              if meta.get("compatible_output") else "")
    click.echo(
        f"wrote {Path(result.path)}: {meta['backbone']}, input {meta['input_size']} px ({meta['resize']}), "
        f"{meta['embedding_dim']}-d{second}, normalized={meta['normalized']}, {result.precision}, "
        f"model_hash {meta['model_hash']}, config_hash {meta['config_hash'] or '-'}"
    )
    step = export_next_step(result.path, meta)
    if verdict and verdict["line"]:  # the run measured it no better than the pretrained export: say so first
        click.echo(verdict["line"])
        if verdict["command"]:  # what to serve instead; this model stays one command away
            click.echo(f"next: {verdict['command']}   (the pretrained export; to use this model anyway: {step})")
            return
    click.echo(f"next: {step}")


MAX_SAID = 1000  # characters of a report's sentence said on the terminal (the report is anyone's file)


def _run_verdict(checkpoint: str) -> dict | None:
    """The keep-pretrained verdict of the run ``checkpoint`` was delivered by (its report.json beside it, about
    this very file: wise.pt where the run made one, else best.pt); None without one, or for another checkpoint."""
    from retrieval.reports import delivered_checkpoint
    from retrieval.serve.report_files import load_report

    path = Path(checkpoint).with_name("report.json")
    if not path.is_file():
        return None
    try:
        data = load_report(path).data
    except (OSError, ValueError):
        return None
    keep = data.get("keep_pretrained")
    if not isinstance(keep, bool) or Path(checkpoint).name != delivered_checkpoint(data):
        return None

    def said(value: object) -> str:
        return printable_path(value, MAX_SAID) if isinstance(value, str) else ""

    pretrained = data.get("pretrained_export") if isinstance(data.get("pretrained_export"), dict) else {}
    line = command = None
    if keep:
        command = said(pretrained.get("command")) or None
        line = (f"{said(data.get('keep_pretrained_reason')) or 'keep the pretrained export'} (its run's report "
                f"{printable_path(path)})")
    return {"keep_pretrained": keep, "line": line, "command": command}


def _zero_shot_tower(backbone: str, image_model: Path, out: Path, model_hash: str, progress: bool) -> dict[str, str]:
    """Train the backbone's zero-shot text tower onto its ImageNet head, write it beside OUT (verified against
    PyTorch) and name it in ``image_model``'s metadata; returns that metadata (empty where no tower is written,
    which one line says)."""
    import time

    from retrieval.export.text_export import export_text_tower, link_text_model
    from retrieval.text.class_texts import ImageNetTextsError
    from retrieval.text.sibling_text import ZERO_SHOT, sibling_path
    from retrieval.train.zero_shot_tower import IMAGENET_HEADS, imagenet_head, train_zero_shot_tower

    if backbone not in IMAGENET_HEADS:
        click.echo(f"no text tower: {backbone} has no ImageNet classifier head to map class names onto (only "
                   f"{', '.join(IMAGENET_HEADS)}); to search by text, train one on captions: retrieval text train "
                   f"--model {out} --images MANIFEST --caption-column COLUMN --out RUN")
        return {}
    started = time.perf_counter()
    click.echo(f"training the zero-shot text tower onto {backbone}'s ImageNet head (--no-text-tower skips it) ...")
    try:
        trained = train_zero_shot_tower(imagenet_head(backbone), progress=progress)
    except (ParameterError, ImageNetTextsError) as exc:  # the encoder's or timm's package missing
        click.echo(f"no text tower: {exc}")
        return {}
    text_path = sibling_path(out)
    check = export_text_tower(trained.tower, trained.tokenizer, text_path, model_hash, trained.encoder_record,
                              trained.check_texts, origin=ZERO_SHOT, extra=trained.metadata())
    metadata = link_text_model(image_model, text_path)
    click.echo(f"wrote {text_path}: zero-shot text tower, {len(trained.class_names)} classes, {trained.texts} "
               f"texts, verified against PyTorch (min cosine {check['min_cosine']:.6f}), in "
               f"{time.perf_counter() - started:.0f} s; named in {image_model.name}'s metadata (its model_hash stays "
               f"{model_hash})")
    return metadata


def _check_int8_options(checkpoint: str | None, backbone: str | None, onnx: str | None, int8: bool, fp16: bool,
                        calibration: str | None) -> None:
    if onnx is not None and not int8:
        raise click.UsageError("--onnx is an fp32 export to quantize: give it with --int8")
    if onnx is not None and (checkpoint is not None or backbone is not None):
        raise click.UsageError("give one model: --onnx (an fp32 export to quantize), --checkpoint or --pretrained")
    if fp16:
        raise click.UsageError("--int8 and --fp16 are two precisions: choose one")
    if calibration is None:
        raise click.UsageError("--int8 needs --calibration DIR: a folder or manifest of your own images (a few "
                               "hundred, like the gallery's), which set the int8 ranges and check it")


def _int8(parent: Path, out: Path, calibration: str, images: int | None, seed: int, as_json: bool) -> None:
    """Quantize ``parent`` into ``out`` and say what was measured (or why it was refused)."""
    from retrieval.export.int8_export import CALIBRATION_IMAGES, Int8Refused, export_int8

    try:
        result = export_int8(parent, out, calibration, images or CALIBRATION_IMAGES, seed, log=click.echo)
    except Int8Refused as exc:
        raise click.ClickException(f"int8 refused: {exc}") from exc
    meta = result.metadata
    if as_json:
        click.echo(json.dumps({"path": str(result.path), "precision": "int8", "fp32_path": str(result.parent),
                               "metadata": meta, "verified": True}, indent=2))
        return
    click.echo(f"wrote {result.path}: {meta['backbone']}, input {meta['input_size']} px ({meta['resize']}), "
               f"{meta['embedding_dim']}-d, int8, model_hash {meta['model_hash']}, quantized from {result.parent} "
               f"(model_hash {meta['fp32_model_hash']}); an index either one builds is searched with the other")
    click.echo(f"next: {export_next_step(result.path, meta)}")
