"""Search by text as a shop judges it: customers' words against a catalogue of product photos with titles
(benchmarks/shop_catalogue.py), driven through the real CLI (`retrieval export / index build / index text /
text train / search --json / serve`), so the numbers are what users get.

    .venv/bin/python benchmarks/shop_text.py --work DIR [--seeds 0 1 2] [--parts shop disjoint] [--save cpu-2core]

Part "shop", per seed S (the catalogue of seed S: which photos are in the gallery, their colours, sizes and margins,
which artist's drawing; ``text train --seed S``), four configurations, each an index built from the gallery:
- zero-shot: the pretrained export's own text tower (``export --pretrained`` writes model.text.onnx; ``index build``
  records it, adapted to the gallery where the build does that);
- zero-shot + keywords: the same with ``--text-columns title`` (SQLite FTS5 beside the index, fused with the vectors);
- trained: ``text train`` on the titles of train.csv, other photos of the same products (Fashion-MNIST photos not in
  the gallery, the other artist's drawing of each emoji): no gallery photo is ever trained on; ``index text``;
- trained + keywords.
A configuration whose part is not in this tree yet is skipped with the reason printed. Measured: Precision@5 by
category and by item over ``QUERIES`` (a query's precision is over min(5, its relevant gallery items), so a product
with 2 items in the gallery can score 1); "no match" on ``NOT_SOLD_QUERIES`` and on ``QUERIES`` (the answers'
``no_match``); a text query's and an image query's latency through `retrieval serve` (POST /search, one at a time,
interleaved, same index and process).

Part "disjoint" (benchmarks/shop_disjoint.py): Fashion-MNIST's classes split in two, each photo captioned by its
title and its class's description; each test photo's caption searched among the test photos (Recall@10 of its own
photo, Precision@10 of its class) with the zero-shot tower, the tower trained on the train classes' captions and the
linear map on frozen MiniLM (the ridge start).
"""

from __future__ import annotations

import argparse
import base64
import csv
import json
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from shop_catalogue import COLOURS, FASHION, catalogue  # noqa: E402  (beside this file)

if TYPE_CHECKING:
    from retrieval.records.index_info import IndexInfo

# ---------------------------------------------------------------------------------------------------------------------
# The queries: customers' words. Written before any result of this benchmark was seen; not tuned afterwards.
# (text, the categories that answer it, the items that answer it: kinds ("hammer", a Fashion-MNIST class) or
# kind/colour ("ankle-boot/red"); None: every item of those categories)
QUERIES = [
    ("a hammer", ["Tools"], ["hammer", "hammer and pick", "hammer and wrench"]),
    ("spanner", ["Tools"], ["wrench", "hammer and wrench"]),
    ("screwdriver", ["Tools"], ["screwdriver"]),
    ("an axe for firewood", ["Tools"], ["axe"]),
    ("ladder", ["Tools"], ["ladder"]),
    ("veggies", ["Vegetables"], None),
    ("fresh fruit", ["Fruit"], None),
    ("bananas", ["Fruit"], ["banana"]),
    ("apples", ["Fruit"], ["red apple", "green apple"]),
    ("citrus fruit", ["Fruit"], ["lemon", "lemon + large green square", "tangerine"]),
    ("carrots", ["Vegetables"], ["carrot"]),
    ("spicy chillies", ["Vegetables"], ["hot pepper"]),
    ("kitty", ["Cat toys & gifts"], None),
    ("black cat", ["Cat toys & gifts"], ["cat + black large square"]),
    ("farm animals", ["Farm animal toys"], None),
    ("a cow", ["Farm animal toys"], ["cow", "cow face", "ox"]),
    ("piggy", ["Farm animal toys"], ["pig", "pig face"]),
    ("sheep", ["Farm animal toys"], ["sheep", "ram"]),
    ("chicken", ["Farm animal toys"], ["chicken", "rooster", "baby chick"]),
    ("toy car", ["Toy vehicles"], ["automobile", "racing car", "taxi", "police car"]),
    ("fire truck", ["Toy vehicles"], ["fire engine"]),
    ("a tractor", ["Toy vehicles"], ["tractor"]),
    ("school bus", ["Toy vehicles"], ["bus", "minibus"]),
    ("guitar", ["Musical instruments"], ["guitar"]),
    ("something to play music on", ["Musical instruments"], None),
    ("drums", ["Musical instruments"], ["drum with drumsticks", "long drum"]),
    ("football", ["Sports goods"], ["soccer ball", "american football", "rugby football"]),
    ("tennis racket", ["Sports goods"], ["tennis racquet and ball"]),
    ("sports balls", ["Sports goods"], None),
    ("kitchen knife", ["Kitchenware"], ["hocho"]),
    ("frying pan", ["Kitchenware"], ["cooking"]),
    ("a cup for tea", ["Kitchenware"], ["teacup without handle"]),
    ("cleaning supplies", ["Cleaning & bathroom"], None),
    ("toothbrush", ["Cleaning & bathroom"], ["toothbrush"]),
    ("toilet paper", ["Cleaning & bathroom"], ["roll of paper"]),
    ("a pen", ["Stationery"], ["lower left ballpoint pen", "lower left fountain pen", "black nib"]),
    ("school supplies", ["Stationery"], None),
    ("scissors", ["Stationery"], ["black scissors"]),
    ("fresh bread", ["Bakery"], ["bread", "baguette bread"]),
    ("croissant", ["Bakery"], ["croissant"]),
    ("running shoes", ["Trainers"], None),
    ("pink trainers", ["Trainers"], ["sneaker/pink"]),
    ("red ankle boots", ["Boots"], ["ankle-boot/red"]),
    ("boots", ["Boots"], None),
    ("footwear", ["Sandals", "Trainers", "Boots"], None),
    ("sandals for the beach", ["Sandals"], None),
    ("something to carry my laptop", ["Bags"], None),
    ("a handbag", ["Bags"], None),
    ("summer dress", ["Dresses"], None),
    ("green dress", ["Dresses"], ["dress/green"]),
    ("blue jeans", ["Trousers"], ["trouser/blue"]),
    ("a warm winter coat", ["Coats & jackets"], None),
    ("sweater", ["Jumpers"], None),
    ("t-shirt", ["T-shirts & tops"], None),
    ("black t-shirt", ["T-shirts & tops"], ["t-shirt/black"]),
    ("a shirt for the office", ["Shirts"], None),
]
# Products the shop does not sell (nothing in the gallery answers them): the answer should say "no match".
NOT_SOLD_QUERIES = ["a dog", "puppy toy", "a laptop", "mobile phone", "a bouquet of roses", "wrist watch",
                    "a sun hat", "diamond ring", "a novel to read", "birthday cake", "a sofa for the living room",
                    "a pet parrot", "goldfish", "a winter scarf"]
# ---------------------------------------------------------------------------------------------------------------------

CONFIGS = {  # name -> (tower, keywords)
    "zero-shot": ("zero-shot", False),
    "zero-shot + keywords": ("zero-shot", True),
    "trained": ("trained", False),
    "trained + keywords": ("trained", True),
}
K = 5
LATENCY_QUERIES = 30  # of each kind a configuration, after 5 of each to warm up


def check_queries() -> None:
    """Every query names categories and items the catalogue has (a typo would make a query unanswerable)."""
    from shop_catalogue import EMOJI_PRODUCTS

    categories = {c for c, _, _ in FASHION.values()} | set(EMOJI_PRODUCTS)
    kinds = set(FASHION) | {name for _, products in EMOJI_PRODUCTS.values() for name in products}
    bad = [text for text, cats, items in QUERIES if set(cats) - categories or any(
        item.split("/")[0] not in kinds or item.count("/") and item.split("/")[1] not in COLOURS
        for item in items or [])]
    if bad:
        raise SystemExit(f"queries naming what the catalogue lacks: {bad}")


def retrieval_cli() -> list[str]:
    """The installed `retrieval` command beside this Python (what users run)."""
    script = Path(sys.executable).with_name("retrieval")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "retrieval"]


def cli(*args: str, timeout: float = 3600) -> str:
    """Run `retrieval ARGS`; its stdout, or SystemExit with its stderr's tail."""
    done = subprocess.run([*retrieval_cli(), *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(f"retrieval {' '.join(args[:3])} ... failed ({done.returncode}): {done.stderr[-1500:]}")
    return done.stdout


def takes_option(command: list[str], option: str) -> bool:
    """Whether `retrieval COMMAND --help` lists ``option`` (a part not built yet does not)."""
    done = subprocess.run([*retrieval_cli(), *command, "--help"], capture_output=True, text=True, timeout=120)
    return option in done.stdout


def exported_model(work: Path) -> tuple[Path, Path | None]:
    """The pretrained export (written once) and its zero-shot text tower, when the export writes one."""
    model = work / "model" / "model.onnx"
    if not model.with_name("model.text.onnx").is_file():  # (again: an export from before the text tower had none)
        model.parent.mkdir(parents=True, exist_ok=True)
        cli("export", "--pretrained", "efficientnet_lite0", "--resize", "pad", "--out", str(model))
    text = model.with_name("model.text.onnx")
    return model, text if text.is_file() else None


def emoji_folder(work: Path) -> Path:
    """`retrieval data prepare emoji`'s folder (made once)."""
    folder = work / "emoji"
    if not (folder / "manifest.csv").is_file():
        cli("data", "prepare", "emoji", "--out", str(folder))
    return folder


def index_info(index: Path) -> IndexInfo:
    from retrieval.index.layout import IndexLayout

    return IndexLayout(index).read_record()


def build_config(name: str, model: Path, manifest: Path, out: Path, trained: Path | None,
                 features: dict) -> tuple[Path | None, str]:
    """The configuration's index (None with the reason when a part it needs is missing) and what made it."""
    tower, keywords = CONFIGS[name]
    if tower == "zero-shot" and not features["zero_shot"]:
        return None, "the export writes no model.text.onnx (zero-shot tower not built yet)"
    if tower == "trained" and trained is None:
        return None, "text train failed"
    if keywords and not (features["build_columns"] or features["text_columns"]):
        return None, "no --text-columns on index build or index text (keywords not built yet)"
    shutil.rmtree(out, ignore_errors=True)
    build = ["index", "build", "--model", str(model), "--images", str(manifest), "--out", str(out)]
    steps = []
    if keywords and features["build_columns"]:
        build += ["--text-columns", "title"]
    cli(*build)
    steps.append(" ".join(build[:2] + (["--text-columns title"] if "--text-columns" in build else [])))
    text_step = []
    if tower == "trained":
        text_step += ["--text-model", str(trained)]
    elif not index_info(out).text.path:
        text_step += ["--text-model", str(features["zero_shot"])]  # the build did not record it: record it by hand
    if keywords and not features["build_columns"]:
        text_step += ["--text-columns", "title"]
    if text_step:
        cli("index", "text", str(out), *text_step)
        steps.append("index text " + " ".join(a for a in text_step if a.startswith("--")))
    return out, "; ".join(steps)


def search(index: Path, texts: list[str], k: int = 10) -> list[dict]:
    """`retrieval search --index INDEX --text ... --json`: each text's answer."""
    args = ["search", "--index", str(index), "-k", str(k), "--json"]
    for text in texts:
        args += ["--text", text]
    return json.loads(cli(*args))


def relevant(rows: list[dict], categories: list[str], items: list[str] | None) -> tuple[set[str], set[str]]:
    """The gallery paths that answer a query by category and by item."""
    by_category = {r["path"] for r in rows if r["category"] in categories}
    if items is None:
        return by_category, by_category
    by_item = {r["path"] for r in rows if r["category"] in categories
               and (r["kind"] in items or f"{r['kind']}/{r['colour']}" in items)}
    return by_category, by_item


def precision(found: list[str], wanted: set[str], k: int = K) -> float:
    """Hits in the top k over min(k, how many there are to find)."""
    return sum(path in wanted for path in found[:k]) / min(k, len(wanted))


def shop_metrics(index: Path, rows: list[dict]) -> dict:
    """Precision@5 by category and item, no-match rates and the sources of the hits, for one index."""
    answers = search(index, [q for q, _, _ in QUERIES] + NOT_SOLD_QUERIES)
    answered, not_sold = answers[:len(QUERIES)], answers[len(QUERIES):]
    p_cat, p_item, per_query = [], [], {}
    for (text, categories, items), answer in zip(QUERIES, answered, strict=True):
        found = [r["path"] for r in answer["results"]]
        by_category, by_item = relevant(rows, categories, items)
        p_cat.append(precision(found, by_category))
        p_item.append(precision(found, by_item))
        per_query[text] = {"category": round(p_cat[-1], 2), "item": round(p_item[-1], 2),
                           "top": [r.get("columns", {}).get("title", r["path"]) for r in answer["results"][:3]]}
    has_flag = all("no_match" in a for a in answers)
    sources = [r.get("source") for a in answered for r in a["results"][:K]]
    return {"p5_category": float(np.mean(p_cat)), "p5_item": float(np.mean(p_item)),
            "no_match_not_sold": float(np.mean([a["no_match"] for a in not_sold])) if has_flag else None,
            "false_no_match": float(np.mean([a["no_match"] for a in answered])) if has_flag else None,
            "keyword_share": float(np.mean([s in ("keyword", "both") for s in sources])) if any(sources) else None,
            "per_query": per_query}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def latency(index: Path, images: list[Path]) -> dict:
    """p50 ms of a text query and of an image query, one at a time and interleaved, through `retrieval serve`."""
    import httpx

    port = free_port()
    server = subprocess.Popen([*retrieval_cli(), "serve", "--index", str(index), "--port", str(port), "--no-ui",
                               "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=60) as client:
            for _ in range(240):
                try:
                    if client.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError("the server did not come up in 2 minutes")
            bodies = {"text": [{"text": q, "k": 10} for q, _, _ in QUERIES],
                      "image": [{"image": base64.b64encode(p.read_bytes()).decode(), "k": 10} for p in images]}
            times: dict[str, list[float]] = {"text": [], "image": []}
            for n in range(LATENCY_QUERIES + 5):
                for kind in ("text", "image"):
                    started = time.perf_counter()
                    answer = client.post(url + "/search", json=bodies[kind][n % len(bodies[kind])])
                    answer.raise_for_status()
                    if n >= 5:
                        times[kind].append((time.perf_counter() - started) * 1000)
    finally:
        server.terminate()
        server.wait(30)
    text, image = float(np.median(times["text"])), float(np.median(times["image"]))
    return {"text_ms": text, "image_ms": image, "ratio": text / image}


def train_tower(model: Path, manifest: Path, out: Path, seed: int, column: str = "title") -> tuple[Path | None, dict]:
    """`retrieval text train` on the manifest's ``column``; its text.onnx and the report's held-out recall."""
    try:
        cli("text", "train", "--model", str(model), "--images", str(manifest), "--caption-column", column,
            "--out", str(out), "--seed", str(seed), "--json")
    except RuntimeError as exc:
        print(f"text train failed: {exc}", flush=True)
        return None, {}
    report = json.loads((out / "report.json").read_text())
    return out / "text.onnx", {"held_out_recall@10": report.get("held_out", {}).get("recall@10"),
                               "chosen_epoch": report.get("chosen_epoch")}


def features_present(zero_shot: Path | None) -> dict:
    """What this tree's CLI can do now (the parts being built)."""
    found = {"zero_shot": zero_shot, "build_columns": takes_option(["index", "build"], "--text-columns"),
             "text_columns": takes_option(["index", "text"], "--text-columns")}
    print(json.dumps({"zero-shot tower": str(zero_shot) if zero_shot else None,
                      "index build --text-columns": found["build_columns"],
                      "index text --text-columns": found["text_columns"]}), flush=True)
    return found


def shop_part(work: Path, seeds: list[int], model: Path, features: dict) -> dict:
    """Every configuration on every seed's catalogue: {config: {"runs": [...], "skipped": reason}}."""
    emoji = emoji_folder(work)
    out: dict[str, dict] = {name: {"runs": []} for name in CONFIGS}
    for seed in seeds:
        folder = catalogue(work / f"seed{seed}" / "catalogue", emoji, seed)
        with open(folder / "manifest.csv", newline="", encoding="utf-8") as handle:
            rows = list(csv.DictReader(handle))
        with open(folder / "train.csv", newline="", encoding="utf-8") as handle:
            query_images = [folder / r["path"] for r in csv.DictReader(handle)]
        query_images = random.Random(seed).sample(query_images, LATENCY_QUERIES)
        started = time.perf_counter()
        trained, report = train_tower(model, folder / "train.csv", work / f"seed{seed}" / "text", seed)
        train_seconds = time.perf_counter() - started
        for name in CONFIGS:
            started = time.perf_counter()
            try:
                index, how = build_config(name, model, folder / "manifest.csv", work / f"seed{seed}" / slug(name),
                                          trained, features)
            except RuntimeError as exc:  # a part mid-change in this tree: the others still run
                index, how = None, f"failed: {str(exc)[:300]}"
            if index is None:
                out[name]["skipped"] = how
                print(f"seed {seed}, {name}: skipped: {how}", flush=True)
                continue
            run = {"seed": seed, "built_by": how, "build_seconds": round(time.perf_counter() - started, 1),
                   **shop_metrics(index, rows), **latency(index, query_images)}
            info = index_info(index)
            run["index_keys"] = sorted(k for k in info.keys_held if k.startswith(("text", "keyword", "adapt")))
            if CONFIGS[name][0] == "trained":
                run |= {"text_train_seconds": round(train_seconds, 1), **report}
            out[name]["runs"].append(run)
            print(json.dumps({k: v for k, v in run.items() if k != "per_query"} | {"config": name}), flush=True)
    return out


def slug(name: str) -> str:
    return name.replace(" + ", "-").replace(" ", "-")


def mean_spread(values: list[float | None]) -> str:
    """Mean ± half the seeds' spread, or '-' when not measured."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{np.mean(values):.2f} ± {np.ptp(values) / 2:.2f}" if len(values) > 1 else f"{values[0]:.2f}"


SHOP_COLUMNS = ["configuration", "P@5 category", "P@5 item", "no match: not sold", "no match: with answers",
                "hits by keyword (top 5)", "text query p50 ms", "image query p50 ms", "text / image"]


def shop_rows(results: dict) -> list[list[str]]:
    rows = []
    for name, found in results.items():
        runs = found["runs"]
        if not runs:
            rows.append([name, f"skipped: {found.get('skipped')}"] + ["-"] * (len(SHOP_COLUMNS) - 2))
            continue
        def pick(key: str, runs: list[dict] = runs) -> list:
            return [r[key] for r in runs]

        rows.append([name, mean_spread(pick("p5_category")), mean_spread(pick("p5_item")),
                     mean_spread(pick("no_match_not_sold")), mean_spread(pick("false_no_match")),
                     mean_spread(pick("keyword_share")), f"{np.mean(pick('text_ms')):.1f}",
                     f"{np.mean(pick('image_ms')):.1f}", mean_spread(pick("ratio"))])
    return rows


def markdown(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", required=True, type=Path, help="catalogues, models and indexes (kept, reused)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parts", nargs="+", default=["shop", "disjoint"], choices=["shop", "disjoint"])
    parser.add_argument("--save", metavar="MACHINE", help="write benchmarks/results/shop-text[-disjoint]-MACHINE.json")
    args = parser.parse_args()
    check_queries()
    args.work.mkdir(parents=True, exist_ok=True)
    model, zero_shot = exported_model(args.work)
    features = features_present(zero_shot)
    results: dict = {"seeds": args.seeds, "features": {k: str(v) if isinstance(v, Path) else v
                                                       for k, v in features.items()}}
    command = "python benchmarks/shop_text.py " + " ".join(sys.argv[1:])
    if "shop" in args.parts:
        results["shop"] = shop_part(args.work, args.seeds, model, features)
        (args.work / "results-shop.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
        rows = shop_rows(results["shop"])
        print(markdown(SHOP_COLUMNS, rows))
        if args.save:
            from results_io import write_result

            write_result("shop-text", args.save, command, SHOP_COLUMNS, rows, notes=(
                f"{len(QUERIES)} customer queries with answers, {len(NOT_SOLD_QUERIES)} for products not sold; "
                f"seeds {args.seeds} (mean ± half the spread); P@5 over min(5, the query's relevant items); latency "
                f"through retrieval serve, {LATENCY_QUERIES} queries of each kind, one at a time, interleaved"))
    if "disjoint" in args.parts:
        from shop_disjoint import DISJOINT_PER_CLASS, TRAIN_CLASSES, disjoint_part, disjoint_rows

        results["disjoint"] = disjoint_part(args.work, args.seeds, model, features)
        columns = ["text tower", "caption -> own photo Recall@10", "class Precision@10"]
        rows = disjoint_rows(results["disjoint"])
        print(markdown(columns, rows))
        if args.save:
            from results_io import write_result

            write_result("shop-text-disjoint", args.save, command, columns, rows, notes=(
                f"Fashion-MNIST test photos, train classes {', '.join(TRAIN_CLASSES)} ({2 * DISJOINT_PER_CLASS} "
                f"each), test classes the other 5 ({DISJOINT_PER_CLASS} each, the gallery); seeds {args.seeds}"))
        (args.work / "results-disjoint.json").write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
