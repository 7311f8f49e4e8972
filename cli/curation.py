"""`retrieval index duplicates`, `retrieval index audit` and `retrieval audit --images DIR`: near-duplicate groups and
label suspects, found through each image's nearest neighbours (``retrieval.index.curation.duplicates``,
``.audit``). Their options are declared once, in ``CurationOptions`` (docs/INDEX.md's table of the gallery commands
is made from it)."""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from retrieval.cli.config_options import command_option, command_options, shared_option
from retrieval.cli.errors import OptionCommand
from retrieval.cli.index_common import index_folder, json_option
from retrieval.cli.index_options import IndexOptions
from retrieval.options import TRUSTED_MODEL, option
from retrieval.train.config import TrainConfig

SHOWN = 10  # groups or suspects printed for people; --json lists up to --max-groups / --top
MEMBERS_SHOWN = 6  # images printed per group


@dataclass(frozen=True)
class CurationOptions:
    """The options of the curation commands, declared once (docs/INDEX.md's table, with the gallery commands'); they
    share ``IndexOptions``' --json and the audit's --workers (decoding threads), and training's --label-noise;
    `index duplicates` has its own --workers (verification threads)."""

    threshold: float | str = option(
        "auto", "near-duplicates", "auto: each image's neighbours above a loose cosine are candidates, and each pair "
        "is verified as a copy (local features under one transform, aligned content, colour), all calibrated on copies "
        "planted of a sample of the gallery; a cosine: link two images when one is among the other's k nearest at "
        "that cosine or more, unverified (docs/INDEX.md, \"Near-duplicates\").",
        metavar="COSINE|auto", low=-1, high=1)
    duplicates_model: str | None = option(
        None, "near-duplicates", f"the model that embeds auto's planted copies (default: the one recorded in "
        f"index.json). {TRUSTED_MODEL}", flag="--model", dest="model", path="file", exists=True)
    calibration_sample: int = option(50, "near-duplicates", "gallery images whose planted copies calibrate auto "
                                     "(6 copies embedded and 10 pairs compared each).", low=2, high=2000)
    verify_workers: int = option(2, "near-duplicates", "threads that verify candidate pairs (OpenCV and NumPy work "
                                 "beside each other on them).", flag="--workers", dest="workers", low=1, high=64)
    max_groups: int = option(100, "near-duplicates", "groups listed, largest first (the counts cover every group).",
                             low=1, high=10_000)
    groups_png: str | None = option(None, "near-duplicates", "draw the first groups into this PNG file.",
                                    flag="--out", dest="png", metavar="PNG", path="file")
    neighbours: int = option(10, "neighbours", "neighbours searched per image (the graph holds k per image: never all "
                             "pairs).", flag="-k", dest="k", low=1, high=100)
    top: int = option(50, "label audit", "suspects listed, most suspect first (the count covers all).", low=1,
                      high=10_000)
    suspects_png: str | None = option(None, "label audit", "draw the first suspects into this PNG file.",
                                      flag="--out", dest="png", metavar="PNG", path="file")
    audit_images: str | None = option(
        None, "label audit", "a training folder: one sub-folder per class (its name is the label), searched "
        "recursively.", flag="--images", dest="images", path="dir", exists=True, required=True)
    audit_model: str | None = option(None, "label audit", f"the model (.onnx) that embeds the images. {TRUSTED_MODEL}",
                                     flag="--model", dest="model", path="file", exists=True, required=True)
    max_images: int = option(20_000, "label audit", "the most images audited (each is compared with every other, "
                             "exactly); for more, index them and run `retrieval index audit`.", low=2)
    noise_seed: int = option(0, "label audit", "the label noise's seed.", flag="--seed", dest="seed")


def _threshold(_ctx: click.Context, _param: click.Parameter, value: float | str) -> float | str:
    """--threshold: ``auto`` or a cosine within [-1, 1]."""
    if str(value).strip().lower() == "auto":
        return "auto"
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not -1.0 <= number <= 1.0:
        raise click.BadParameter(f"must be a cosine within [-1, 1] or auto, got {value!r}")
    return number


def _open(index_dir: str, model: str | None):
    """The index, with ``model`` as its query model when given (another model's is refused with the fix)."""
    from retrieval.index import Index, ModelMismatchError, load_model

    try:
        return Index.open(index_dir, embedder=load_model(model) if model else None)
    except ModelMismatchError as exc:
        raise click.ClickException(f"{exc}: retrieval index upgrade {shlex.quote(str(index_dir))} --model "
                                   f"{shlex.quote(str(model))}") from exc


def _save(picture: Any, png: str | None) -> str | None:
    """Write ``picture`` (a PIL image or None) to ``png`` atomically; the path written, or None."""
    if png is None or picture is None:
        return None
    import io

    from retrieval.utils.io import atomic_write

    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    atomic_write(png, buffer.getvalue())
    return png


def _shown(path: str | None) -> str:
    from retrieval.index.sources import printable_path

    return "(missing)" if path is None else printable_path(path)


@click.command("duplicates", cls=OptionCommand)
@index_folder
@command_option(CurationOptions, "threshold", callback=_threshold)
@command_options(CurationOptions, "neighbours", "duplicates_model", "calibration_sample", "max_groups", "groups_png",
                 "verify_workers")
@json_option
def duplicates_command(index_dir, threshold, k, model, calibration_sample, max_groups, png, workers,
                       as_json) -> None:
    """Groups of copies in the index (the same picture cropped, scaled, re-encoded, brightened or slightly turned),
    each pair verified; alike images that are not copies (colour variants, other products) are listed apart. The
    first of each group is the one kept: the one holding the picture at the most pixels, an original rather than
    its downscaled, cropped or re-encoded copies (a cosine as --threshold: the one indexed first). Ctrl-C stops the
    verification and lists what was verified."""
    from retrieval.analysis.neighbour_pictures import copies_picture, duplicates_picture
    from retrieval.index.curation.catalogued_images import catalogued_image_loader, index_picture_background
    from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates

    with _open(index_dir, model) as index:
        summary = find_duplicates(index, DuplicateOptions(threshold, k=k, calibration_sample=calibration_sample,
                                                          max_groups=max_groups, workers=workers,
                                                          progress=not as_json))
        load = catalogued_image_loader(index)
        draw = copies_picture if summary.get("mode") == "verified" else duplicates_picture
        picture = draw(summary, load, background=index_picture_background(index)) if png else None
        summary["picture"] = _save(picture, png)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
    else:
        _print_groups(summary, index_dir)
    if (summary.get("verification") or {}).get("interrupted"):
        raise SystemExit(130)  # what was verified is listed; the exit status says it was stopped, as Ctrl-C does


def _calibration_text(summary: dict[str, Any]) -> str:
    calibration = summary["calibration"]
    if calibration is None:
        return "as given, unverified"
    separated = "" if calibration.get("separated", True) else "; copies and distinct images do NOT separate"
    return (f"auto: {calibration['copy_recall']:.0%} of {calibration['copies']} copies planted of "
            f"{calibration['images']} gallery images reach it, and {calibration['neighbour_share']:.1%} of those "
            f"images' nearest other image{separated}")


def _header(summary: dict[str, Any]) -> str:
    exact = (f"; {summary['exact_duplicates']} files with the bytes of an indexed one were skipped when indexed "
             "(index stats --json)") if summary["exact_duplicates"] else ""
    if summary.get("mode") != "verified":
        return (f"{summary['groups_found']} groups of near-duplicates ({summary['copies_in_groups']} copies) among "
                f"{summary['images']} indexed images at cosine >= {summary['threshold']:.3f} "
                f"({_calibration_text(summary)}); {summary['k']} neighbours each through {summary['search']}{exact}")
    checked, calibration = summary["verification"], summary["calibration"]
    rules = calibration["rules"]
    # a precision of nothing verified says nothing: only said where some pairs were verified
    trust = (f" (estimated precision {checked['estimated_precision']:.2f}: the calibration cannot rule out "
             f"{checked['expected_false_pairs']:g} false ones among them)") if checked["verified"] else ""
    return (f"{summary['groups_found']} groups of verified copies ({summary['copies_in_groups']} copies) among "
            f"{summary['images']} indexed images: {checked['checked']} of {checked['candidates']} candidate pairs "
            f"(among {summary['k']} neighbours each at cosine >= {summary['threshold']:.3f}, and each image's "
            f"nearest) compared in "
            f"{checked['seconds']:.1f} s ({checked['pairs_per_second']:.0f} pairs/s), {checked['verified']} verified"
            f"{trust}: "
            f">= {rules['min_inliers']} features agreeing under one transform, aligned content correlating >= "
            f"{rules['correlation']:.2f}, colours within {rules['colour_mismatch']:.0f} degrees of hue and "
            f"{rules['shade']:.2f} of shade. Calibrated "
            f"on {calibration['copies']} copies planted of {calibration['images']} gallery images "
            f"({calibration['copy_recall']:.0%} found and verified) and {calibration['distinct_pairs']} distinct "
            f"pairs and {calibration['colour_variants']} colour variants ({calibration['false_verified']} verified)"
            f"{exact}")


def _print_groups(summary: dict[str, Any], index_dir: str) -> None:
    folder = shlex.quote(str(index_dir))
    verified = summary.get("mode") == "verified"
    click.echo(_header(summary))
    for number, group in enumerate(summary["groups"][:SHOWN], 1):
        mixed = f"; LABELS DIFFER ({_labels_text(group)}): not proposed for removal" if group.get("labels_mixed") \
            else ""
        trust = f", estimated precision {group['estimated_precision']:.2f}" if "estimated_precision" in group else ""
        click.echo(f"  {number}. {group['size']} images, weakest link {group['weakest_link']:.3f}{trust}{mixed}:")
        checks = [None, *group.get("checks", [])]
        members = list(zip(group["ids"], group["paths"], group["similarities"], strict=True))
        for position, (image_id, path, similarity) in enumerate(members[:MEMBERS_SHOWN]):
            score = "    ?" if similarity is None else f"{similarity:.3f}"
            check = checks[position] if position < len(checks) else None
            how = f"  {check['inliers']:3d} features, aligned {check['correlation']:.3f}" if check else ""
            click.echo(f"       {'kept' if position == 0 else 'copy'}  id={image_id:<8d} {score}{how}  {_shown(path)}")
        if group["size"] > MEMBERS_SHOWN:
            click.echo(f"       ... and {group['size'] - MEMBERS_SHOWN} more (--json)")
    if summary["groups_found"] > SHOWN:
        click.echo(f"  ... and {summary['groups_found'] - SHOWN} more groups (--json lists up to --max-groups)")
    if verified and summary["similar_found"]:
        click.echo(f"similar, not copies ({summary['similar_found']} candidate pairs; for a person to look at, never "
                   "proposed for removal):")
        for pair in summary["similar"][:SHOWN]:
            click.echo(f"  id={pair['ids'][0]} ~ id={pair['ids'][1]}  cosine {pair['cosine']:.3f}, {pair['reason']}: "
                       f"{_shown(pair['paths'][0])}  {_shown(pair['paths'][1])}")
        if summary["similar_found"] > SHOWN:
            click.echo(f"  ... and {summary['similar_found'] - SHOWN} more pairs (--json lists up to --max-groups)")
    if summary.get("picture"):
        click.echo(f"picture: {summary['picture']}")
    for warning in summary.get("warnings", []):
        click.echo(f"warning: {warning}")
    shown = summary["groups"][:SHOWN]
    # a group whose labels differ may hold distinct images: never proposed for removal, and said so
    copies = [i for group in shown if not group.get("labels_mixed") for i in group["ids"][1:]]
    mixed = [str(number) for number, group in enumerate(shown, 1) if group.get("labels_mixed")]
    left_out = f"; groups {', '.join(mixed)} mix labels and are left out: look at them first" if mixed else ""
    what = "verified copies" if verified else "copies"
    if copies:
        click.echo(f"next: retrieval index remove {folder} --ids {','.join(map(str, copies))}   (the {what} of the "
                   f"groups above whose labels agree; each group's first image stays{left_out})")
    elif mixed:
        click.echo(f"next: look at groups {', '.join(mixed)} above: their labels differ, so no removal is proposed; "
                   f"retrieval index audit {folder} lists the labels that disagree with their neighbours")
    else:
        click.echo(f"next: retrieval index audit {folder}   (labels that disagree with their neighbours)")


def _labels_text(group: dict[str, Any]) -> str:
    """The distinct labels of a group's listed images, for one line."""
    from retrieval.index.sources import printable_path

    labels = dict.fromkeys(label for label in group["labels"] if label is not None)
    return ", ".join(printable_path(" ".join(str(label).splitlines())) for label in list(labels)[:4]) + \
        (", ..." if len(labels) > 4 else "")


audit_options = command_options(CurationOptions, "neighbours", "top", "suspects_png")  # -k, --top, --out of both audits


@click.command("audit", cls=OptionCommand)
@index_folder
@audit_options
@json_option
def index_audit_command(index_dir, k, top, png, as_json) -> None:
    """Images whose label disagrees with their neighbours': a similarity-weighted vote of each image's k nearest
    images, read as confident learning reads a classifier (per-class thresholds); ranked, with the label each has,
    the one its neighbours suggest and a score."""
    from retrieval.analysis.neighbour_pictures import suspects_picture
    from retrieval.index import Index
    from retrieval.index.curation.audit import audit_index
    from retrieval.index.curation.catalogued_images import catalogued_image_loader, index_picture_background

    with Index.open(index_dir) as index:
        summary = audit_index(index, k=k, top=top)
        rule = index.catalogue.get_meta("label_from") or "parent"
        picture = suspects_picture(summary, catalogued_image_loader(index),
                                   background=index_picture_background(index)) if png else None
        summary["picture"] = _save(picture, png)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    _print_suspects(summary, "id")
    folder = shlex.quote(str(index_dir))
    click.echo(f"next: correct the labels at their source (move the file to its class's folder, or fix the manifest), "
               f"then `retrieval index repair {folder} --label-from {rule}` relabels the index (nothing re-embedded)")


def _print_suspects(summary: dict[str, Any], key: str) -> None:
    from retrieval.index.sources import printable_path

    click.echo(f"{summary['suspects_found']} label suspects among {summary['voted']} labelled images "
               f"({summary['classes']} classes; a vote of {summary['k']} neighbours each through {summary['search']}, "
               "confident-learning thresholds per class)")
    for number, suspect in enumerate(summary["suspects"][:SHOWN], 1):
        where = f"id={suspect['id']:<8d} " if key == "id" else ""
        click.echo(f"  {number:2d}. score {suspect['score']:+.3f}  {where}{printable_path(suspect['label'])} -> "
                   f"{printable_path(suspect['suggested'])} (its label's share of the vote "
                   f"{suspect['self_confidence']:.2f})  {_shown(suspect['path'])}")
    if summary["suspects_found"] > SHOWN:
        click.echo(f"  ... and {summary['suspects_found'] - SHOWN} more (--json lists up to --top)")
    if summary.get("picture"):
        click.echo(f"picture: {summary['picture']}")


@click.command("audit", cls=OptionCommand)
@command_options(CurationOptions, "audit_images", "audit_model")
@audit_options
@json_option
@command_options(CurationOptions, "max_images")
@shared_option(TrainConfig, "label_noise",
               help="flip labels first, as `retrieval train --label-noise` does (symmetric:RATE or asymmetric:RATE), "
                    "and measure how well the suspects find the flipped images (precision of the top --top).")
@shared_option(TrainConfig, "label_noise_transitions")
@command_options(CurationOptions, "noise_seed")
@command_options(IndexOptions, "threads")  # --workers: decoding threads, as `retrieval compare`'s
def audit_command(images, model, k, top, png, as_json, max_images, label_noise, label_noise_transitions, seed,
                  workers) -> None:
    """Images of a training folder whose label (their sub-folder) disagrees with their neighbours', as `retrieval
    index audit` finds them in an index: ranked, with the label each has, the one its neighbours suggest and a
    score. For an index's gallery: retrieval index audit INDEX."""
    from retrieval.analysis.neighbour_pictures import suspects_picture
    from retrieval.index import load_model
    from retrieval.index.curation.audit import audit_folder
    from retrieval.index.curation.catalogued_images import picture_background

    embedder = load_model(model)
    summary = audit_folder(images, embedder, k=k, top=top, max_images=max_images, label_noise=label_noise,
                           label_noise_transitions=label_noise_transitions, seed=seed, workers=workers)
    root = Path(images)
    summary["picture"] = _save(suspects_picture(summary, lambda path: _open_image(root / path), key="path",
                                                background=picture_background(embedder)) if png else None, png)
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    _print_suspects(summary, "path")
    noise = summary.get("noise")
    if noise:
        click.echo(f"with {noise['flipped']} labels flipped ({noise['mode']}, rate {noise['rate']:g}, seed "
                   f"{noise['seed']}): precision {_ratio(noise['precision_at_top'])} in the top {noise['top']}, "
                   f"{_ratio(noise['precision_at_flipped'])} in the top {min(noise['flipped'], noise['suspects'])}; "
                   f"every suspect: precision {_ratio(noise['precision'])}, recall {_ratio(noise['recall'])}")
    click.echo("next: move each mislabelled file into its class's sub-folder (or delete it) and run this again; "
               "then train on the folder")


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _open_image(path: Path):
    """A folder image for the picture (the one decoder), None when it cannot be read now."""
    from retrieval.data.decode import read_image

    try:
        return read_image(path).image
    except Exception:  # noqa: BLE001  (the picture shows a grey square for it)
        return None
