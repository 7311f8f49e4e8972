"""What a refactoring must leave as it was, written down so that two checkouts can be compared: every command's
``--help``, the HTTP API's OpenAPI document, and every index.json, report.json, config.json and ONNX metadata the demo
and five model variants write (a head with another start and size, a model compatible with the demo's, a pretrained
export, an int8 export, a fine-tuned backbone), each with an index built with it.

    python benchmarks/behaviour_snapshot.py snap --work /tmp/snap-work --out /tmp/snap-before   # in checkout A
    python benchmarks/behaviour_snapshot.py snap --work /tmp/snap-work --out /tmp/snap-after    # in checkout B
    python benchmarks/behaviour_snapshot.py compare /tmp/snap-before /tmp/snap-after

Run both with the same ``--work`` folder (it is emptied first): the files record absolute paths, and a run's config
hash covers its folders. A file is kept byte for byte unless something in it differs between two runs of the same
code (measured times and rates, dates, the versions of the installed packages): then those values are masked and the
file written again (keys in their order). Checkpoints are kept as their configs, hash and the types they hold.
``compare`` lists what is left different. On a 2-core CPU a snapshot takes about 25 minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

VOLATILE = re.compile(
    r"(seconds|_s$|^s$|_ms$|^ms$|time(?!out)|date|elapsed|latency|per_s|throughput|per_second|created|started|finished"
    r"|duration|speed|rss|peak|host|pid|version|when|measured_at|qps|wall)", re.IGNORECASE)
MASK = "<varies>"
GALLERY_IMAGES = 240
ARTEFACTS = ("index.json", "report.json", "config.json", "summary.json")


def masked(value: Any, key: str = "") -> Any:
    """``value`` with what varies from run to run replaced by MASK (keys named for times, dates, versions)."""
    if key and VOLATILE.search(key) and not isinstance(value, (dict, list)):
        return MASK
    if isinstance(value, dict):
        return {k: masked(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [masked(v, key) for v in value]
    if isinstance(value, str):  # a JSON document inside a string (ONNX metadata values)
        try:
            inner = json.loads(value)
        except ValueError:
            return value
        if isinstance(inner, (dict, list)) and masked(inner, key) != inner:
            return json.dumps(masked(inner, key))  # keeps key order: order is part of what is compared
    return value  # as it is, byte for byte


def kept_json(text: str) -> str:
    """A JSON file's text as it is, byte for byte, unless something in it varies (then masked, re-written)."""
    document = json.loads(text)
    return text if masked(document) == document else json.dumps(masked(document), indent=1)


def checkpoint_configs(path: Path) -> str | None:
    """What a checkpoint file holds besides tensors and training state: its configs (with their key order), their
    types, and the hash naming the run (None: a .pt file that is no checkpoint, e.g. a feature cache)."""
    import torch

    data = torch.load(path, map_location="cpu", weights_only=False)  # files this snapshot's own runs wrote
    if not isinstance(data, dict) or "model_config" not in data:
        return None
    kept = {key: data.get(key) for key in ("format", "model_config", "train_config", "config_hash", "epoch",
                                            "class_names")}
    kept["types"] = {key: type(value).__name__ for key, value in data.items()}
    return json.dumps(masked(kept), indent=1)


def retrieval(*args: str, cwd: Path, creates: Path | None = None) -> None:
    """Run ``retrieval ARGS`` with this interpreter (not when ``creates`` exists: --keep-work); stop the snapshot if
    it fails."""
    if creates is not None and creates.exists():
        return
    command = [sys.executable, "-m", "retrieval", *args]
    print("$ retrieval " + " ".join(args), flush=True)
    done = subprocess.run(command, cwd=cwd, env={**os.environ, "RETRIEVAL_OFFLINE": "1"}, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def help_texts(out: Path) -> None:
    """Every command's --help, one file each."""
    import click

    from retrieval.cli.main import main

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        ctx = click.Context(command, info_name=" ".join(path), parent=parent, max_content_width=110,
                            terminal_width=110)
        (out / ("help-" + "-".join(path) + ".txt")).write_text(command.get_help(ctx))
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), [*path, name], ctx)

    walk(main, ["retrieval"], None)


def openapi(index_dir: Path, out: Path) -> None:
    """The HTTP API's OpenAPI document, served on the demo's index."""
    from fastapi.testclient import TestClient

    from retrieval.serve.api import create_api
    from retrieval.serve.service import SearchService

    with TestClient(create_api(SearchService(index_dir))) as client:
        document = client.get("/openapi.json").json()
    (out / "openapi.json").write_text(json.dumps(document, indent=1))


def onnx_metadata(path: Path) -> dict[str, str]:
    """An ONNX file's metadata_props, in their order."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {prop.key: prop.value for prop in model.metadata_props}


def gallery(data_dir: Path, work: Path) -> Path:
    """A small labelled gallery of the demo's test images, copied into a folder per subgroup."""
    root = work / "gallery"
    with open(data_dir / "subgroup-test.csv", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))[:GALLERY_IMAGES]
    for row in rows:
        source = data_dir / row["path"]
        target = root / row["label"] / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return root


def snap(work: Path, out: Path, epochs: int, keep_work: bool = False) -> None:
    """Build the demo and the five variants in ``work``; write what they wrote, masked, to ``out``."""
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True)
    help_texts(out)
    demo = work / "demo"
    retrieval("demo", "--out", str(demo), "--epochs", str(epochs), "--no-serve", cwd=work)
    data = demo / "data" / "emoji"
    images = gallery(data, work)
    openapi(demo / "index", out)
    emoji = ["--dataset", "emoji", "--data", str(data), "--dataset-param", "reading=subgroup", "--epochs", "1",
             "--batch-size", "64", "--image-size", "96", "--seed", "0"]
    retrieval("train", *emoji, "--embedding-dim", "128", "--head-start", "principal", "--out", str(work / "head"),
              cwd=work, creates=work / "head" / "report.json")
    retrieval("train", *emoji, "--compatible-with", str(demo / "model.onnx"), "--out", str(work / "compatible"),
              cwd=work, creates=work / "compatible" / "report.json")
    retrieval("train", "--dataset", "digits", "--backbone", "resnet18", "--no-pretrained", "--no-freeze-backbone",
              "--image-size", "32", "--epochs", "1", "--batch-size", "20", "--per-class", "4", "--seed", "0",
              "--out", str(work / "finetuned"), cwd=work, creates=work / "finetuned" / "report.json")
    models = {}
    for run in ("head", "compatible", "finetuned"):
        models[run] = work / f"{run}.onnx"
        retrieval("export", "--checkpoint", str(work / run / "best.pt"), "--out", str(models[run]), cwd=work,
                  creates=models[run])
    models["pretrained"] = work / "pretrained.onnx"
    retrieval("export", "--pretrained", "efficientnet_lite0", "--image-size", "96", "--out",
              str(models["pretrained"]), cwd=work, creates=models["pretrained"])
    models["int8"] = work / "int8.onnx"
    retrieval("export", "--int8", "--onnx", str(demo / "model.onnx"), "--calibration", str(images),
              "--calibration-images", "64", "--out", str(models["int8"]), cwd=work, creates=models["int8"])
    for name, model in models.items():
        retrieval("index", "build", "--model", str(model), "--images", str(images), "--out",
                  str(work / f"index-{name}"), "--index-key", "Flat", cwd=work,
                  creates=work / f"index-{name}" / "index.json")
    evaluated = work / "evaluated" / "report.json"
    evaluated.parent.mkdir(exist_ok=True)
    retrieval("evaluate", "--checkpoint", str(work / "head" / "best.pt"), "--limit", "200", "--out",
              str(evaluated), cwd=work, creates=evaluated)
    for path in sorted(work.rglob("*")):
        name = str(path.relative_to(work)).replace(os.sep, "~")
        if path.name in ARTEFACTS:
            (out / name).write_text(kept_json(path.read_text(encoding="utf-8")))
        elif path.suffix == ".pt" and (configs := checkpoint_configs(path)) is not None:
            (out / f"{name}.configs.json").write_text(configs)
        elif path.suffix == ".onnx":
            (out / f"{name}.metadata.json").write_text(json.dumps(masked(onnx_metadata(path)), indent=1))
    print(f"snapshot of {len(list(out.iterdir()))} files in {out}")


def compare(before: Path, after: Path) -> int:
    """Print what differs between two snapshots; 0 when they are identical."""
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    different = 0
    for name in names:
        a, b = before / name, after / name
        if not a.exists() or not b.exists():
            print(f"only in {'after' if not a.exists() else 'before'}: {name}")
            different += 1
        elif a.read_bytes() != b.read_bytes():
            different += 1
            done = subprocess.run(["diff", "-u", str(a), str(b)], capture_output=True, text=True)
            print(done.stdout[:4000])
    print(f"{len(names)} files compared, {different} differ")
    return 1 if different else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    take = commands.add_parser("snap", help="build and write a snapshot")
    take.add_argument("--work", type=Path, required=True, help="folder the runs write (emptied first)")
    take.add_argument("--out", type=Path, required=True, help="folder the snapshot goes to (emptied first)")
    take.add_argument("--epochs", type=int, default=1, help="the demo's epochs")
    take.add_argument("--keep-work", action="store_true",
                      help="keep --work and skip each step whose output is there (to finish a snapshot that stopped)")
    both = commands.add_parser("compare", help="compare two snapshots")
    both.add_argument("before", type=Path)
    both.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "snap":
        snap(args.work.resolve(), args.out.resolve(), args.epochs, args.keep_work)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
