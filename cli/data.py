"""`retrieval data ...`: prepare the embedded data sets as ImageFolder trees."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import click

from retrieval.cli.errors import OptionGroup

EXPORTABLE = ("emoji", "fashion-mnist", "digits")


@click.group("data", cls=OptionGroup)
def data_group() -> None:
    """Prepare data sets (render emoji, export built-in sets as image folders)."""


@data_group.command("prepare")
@click.argument("name", type=click.Choice(EXPORTABLE))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write the ImageFolder tree into.",
)
@click.option("--image-size", default=128, show_default=True, help="emoji: square image size in pixels.")
@click.option(
    "--skin-tones/--no-skin-tones",
    default=False,
    show_default=True,
    help="emoji: also render the skin-tone variants as their own classes.",
)
@click.option(
    "--limit",
    type=int,
    default=None,
    help="emoji: render only the first N candidates; fashion-mnist/digits: N images per class.",
)
@click.option(
    "--protocol",
    type=click.Choice(["standard", "disjoint"]),
    default=None,
    help="fashion-mnist/digits: same classes in train and test, or class-disjoint (0-4 / 5-9).",
)
def prepare(
    name: str, out: Path, image_size: int, skin_tones: bool, limit: int | None, protocol: str | None
) -> None:
    """Write data set NAME to OUT as OUT/{train,test}/<class>/<image>.png plus OUT/manifest.csv."""
    from retrieval.data import prepare_emoji

    try:
        if name == "emoji":
            info = prepare_emoji(out, image_size=image_size, include_skin_tones=skin_tones, limit=limit)
        else:
            info = export_builtin(name, out, protocol, limit)
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    summary = {k: info[k] for k in ("classes", "train_classes", "test_classes", "images") if k in info}
    if "render_seconds" in info:
        summary["render_seconds"] = info["render_seconds"]
    click.echo(f"wrote {out}: {json.dumps(summary)}")


def export_builtin(name: str, out: Path, protocol: str | None, limit: int | None) -> dict:
    """Save every image of a built-in in-memory data set as PNG in an ImageFolder tree."""
    from retrieval.data import load_dataset
    from retrieval.utils.progress import progress_bar

    kwargs = {"protocol": protocol} if protocol else {}
    out.mkdir(parents=True, exist_ok=True)
    rows, info = [], {"dataset": name, "protocol": protocol or "default", "limit_per_class": limit}
    for split in ("train", "test"):
        dataset = load_dataset(name, split=split, limit_per_class=limit, **kwargs)
        info[f"{split}_classes"] = dataset.num_classes
        for i in progress_bar(range(len(dataset)), desc=f"{name} {split}", unit="img", file=sys.stderr):
            class_name = dataset.class_names[dataset.labels[i]]
            relative = Path(split) / class_name / f"{i:06d}.png"
            (out / relative).parent.mkdir(parents=True, exist_ok=True)
            dataset.load_image(i).save(out / relative)
            rows.append((relative.as_posix(), class_name, split))
    with open(out / "manifest.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label", "split"])
        writer.writerows(rows)
    info["images"] = len(rows)
    info["classes"] = len({label for _, label, _ in rows})
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
