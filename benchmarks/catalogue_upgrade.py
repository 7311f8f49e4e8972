"""The README's upgrade from the quick path, end to end with the CLI on catalogue A (benchmarks/catalogue.py's
cut-outs), one seed: what `retrieval index upgrade` does with the recipe trained compatible with the quick path.

    .venv/bin/python benchmarks/catalogue_upgrade.py --work DIR [--seed 0] [--out FILE]

1. `retrieval export --pretrained efficientnet_lite0 --resize pad` (the quick path's model);
2. `retrieval index build` of the whole catalogue (600 images, labelled by their class folders);
3. the recipe `--compatible-with` that model on the seed's split (`retrieval train ... --dataset-param
   protocol=standard`), then `retrieval export --checkpoint RUN/best.pt`;
4. `retrieval index upgrade INDEX --model NEW` (and, where it refuses, again with `--force`).
Search is scored before and after: each of the seed's test images (unseen by training) a query against the index,
itself left out (`--exclude-self`): Recall@1 and MAP@R over the catalogue's labels. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from catalogue import BASE, IMAGE_SIZE, catalogue_folder  # beside this file

RECIPE = ["--resize", "pad", "--image-size", str(IMAGE_SIZE), "--freeze-backbone", "--batch-size",
          str(BASE["batch_size"]), "--per-class", str(BASE["per_class"])]


def retrieval(*args: str) -> dict:
    """Run `retrieval ARGS`: its exit status and the tail of what it printed."""
    command = [str(Path(sys.executable).with_name("retrieval")), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    return {"rc": done.returncode, "stdout": done.stdout[-20000:], "stderr": done.stderr[-3000:]}


def search_scores(index: Path, queries: list[str], labels: list[str], per_class: int) -> dict[str, float]:
    """Each query against the index, itself left out: Recall@1 and MAP@R (R = the other images of its class)."""
    r = per_class - 1
    recall, average = [], []
    for start in range(0, len(queries), 200):
        batch = queries[start:start + 200]
        done = subprocess.run([str(Path(sys.executable).with_name("retrieval")), "search", "--index", str(index),
                               "--exclude-self", "-k", str(r), "--json", *batch],
                              capture_output=True, text=True, timeout=3600, check=True)
        for answer, label in zip(json.loads(done.stdout), labels[start:start + 200], strict=True):
            hits = np.array([result["label"] == label for result in answer["results"][:r]], dtype=float)
            recall.append(hits[0] if len(hits) else 0.0)
            average.append(float(np.sum(hits * np.cumsum(hits) / np.arange(1, len(hits) + 1))) / r)
    return {"recall@1": round(float(np.mean(recall)), 4), "map@r": round(float(np.mean(average)), 4),
            "queries": len(recall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path, help="the catalogue and the feature cache "
                        "(benchmarks/catalogue.py's --work); the upgrade's files go to WORK/upgrade")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-class", type=int, default=60)
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    from retrieval.data import load_dataset

    folder = catalogue_folder(args.work, args.per_class)
    up = args.work / "upgrade"
    shutil.rmtree(up, ignore_errors=True)
    old, new, index, run = up / "old" / "model.onnx", up / "new" / "model.onnx", up / "index", up / "run"
    test = load_dataset("folder", folder, split="test", protocol="standard", seed=args.seed)
    queries = [str(path) for path in test.samples]
    labels = [str(test.class_names[int(label)]) for label in test.labels]
    steps: dict[str, dict] = {}
    steps["export pretrained"] = retrieval("export", "--pretrained", "efficientnet_lite0", "--resize", "pad",
                                           "--image-size", str(IMAGE_SIZE), "--out", str(old))
    steps["index build"] = retrieval("index", "build", "--model", str(old), "--images", str(folder), "--out",
                                     str(index))
    before = search_scores(index, queries, labels, args.per_class)
    steps["train"] = retrieval("train", "--dataset", "folder", "--data", str(folder), "--dataset-param",
                               "protocol=standard", "--dataset-param", f"seed={args.seed}", "--seed", str(args.seed),
                               *RECIPE, "--compatible-with", str(old), "--out", str(run), "--feature-cache",
                               str(args.work / "cache"), "--workers", "0", "--device", "cpu")
    steps["export checkpoint"] = retrieval("export", "--checkpoint", str(run / "best.pt"), "--out", str(new))
    steps["upgrade"] = retrieval("index", "upgrade", str(index), "--model", str(new), "--json")
    if steps["upgrade"]["rc"]:
        steps["upgrade --force"] = retrieval("index", "upgrade", str(index), "--model", str(new), "--force", "--json")
    after = search_scores(index, queries, labels, args.per_class)
    report = json.loads((run / "report.json").read_text(encoding="utf-8")) if (run / "report.json").is_file() else {}
    result = {"date": time.strftime("%Y-%m-%d"), "seed": args.seed, "gallery": sum(1 for _ in folder.rglob("*.jpg")),
              "search before": before,
              "search after": after, "run best": {key: report.get("best", {}).get(key) for key in
                                                  ("recall@1", "map@r", "epoch", "compatibility")},
              **{key: report[key] for key in ("pretrained_export", "keep_pretrained", "keep_pretrained_reason")
                 if key in report},
              "steps": steps}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
