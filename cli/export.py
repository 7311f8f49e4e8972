"""``retrieval export``: a training checkpoint, or a pretrained backbone as it is, -> one verified ONNX file with
metadata."""

from __future__ import annotations

import json
from pathlib import Path

import click

from retrieval.cli.errors import OptionCommand
from retrieval.data.resize_modes import CROP, RESIZE_MODES
from retrieval.errors import ParameterError
from retrieval.options import TRUSTED_CHECKPOINT


@click.command("export", cls=OptionCommand, needs="train")
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
                   "letterboxed). [default: crop] (a checkpoint keeps the mode it was trained with)")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="ONNX file to write, e.g. model.onnx.")
@click.option("--opset", type=click.IntRange(min=7), default=None,
              help="ONNX opset (default: the exporter's recommended one).")
@click.option("--fp16", is_flag=True, help="float16 weights and activations (inputs/outputs stay float32).")
@click.option("--verify/--no-verify", default=True, show_default=True,
              help="compare onnxruntime with PyTorch on real images at batch 1 and 7.")
@click.option("--json", "as_json", is_flag=True, help="end with the file's metadata as JSON (for programs).")
def export_command(checkpoint: str | None, backbone: str | None, image_size: int | None, resize: str | None,
                   out: str, opset: int | None, fp16: bool, verify: bool, as_json: bool) -> None:
    """Export a trained embedder (backbone, head, L2 norm), or a pretrained backbone as it is (--pretrained), to
    ONNX with a dynamic batch axis."""
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
    try:
        if backbone is not None:
            result = export_pretrained(backbone, out, image_size, resize or CROP, opset=opset, fp16=fp16,
                                       verify=verify, log=click.echo)
        else:
            result = export_checkpoint(checkpoint, out, opset=opset, fp16=fp16, verify=verify, log=click.echo)
    except ExportVerificationError as exc:
        raise click.ClickException(f"verification failed: {exc}") from exc
    except ParameterError:
        raise  # the command names its option (--pretrained, --image-size)
    except (FileNotFoundError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    meta = result.metadata
    if as_json:
        click.echo(json.dumps({"path": str(result.path), "precision": result.precision, "metadata": meta,
                               "verified": result.verification is not None}, indent=2))
        return
    # a model trained --compatible-with an old one of another size: its second output, into the old space
    second = (f" (and {meta['compatible_output']}, {meta['compatible_dim']}-d, into the old model's space)"
              if meta.get("compatible_output") else "")
    click.echo(
        f"wrote {Path(result.path)}: {meta['backbone']}, input {meta['input_size']} px ({meta['resize']}), "
        f"{meta['embedding_dim']}-d{second}, normalized={meta['normalized']}, {result.precision}, "
        f"model_hash {meta['model_hash']}, config_hash {meta['config_hash'] or '-'}"
    )
    click.echo(f"next: retrieval index build --model {result.path} --images YOUR_IMAGES --out INDEX")
