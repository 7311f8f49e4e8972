"""Near-duplicates verified as copies against cosine cuts (docs/RESULTS.md, "Near-duplicates verified as copies";
docs/BENCHMARKS.md, "Copy verification").

Each gallery (one folder per label, the index's labels) holds distinct images and copies planted of some of them with
this script's own transforms (``benchmark_copy``: random crops of 65-90 %, downscales to 30-70 %, JPEG at quality 20-50,
brightness x0.75-1.35 with contrast, turns of 2-10 degrees, and two of these at once), not the verification's own
calibration copies. Data sets:

- catalogue: real product photos (Fashion-MNIST's Zalando photos, its train split) cut to the object, coloured,
  scaled 3-6x and set on white with margins of their own, JPEG (quality 90): tall dresses, wide bags, 50-230 px a
  side; a third of the products also come in one or two other colours (the same photo coloured otherwise: distinct
  products that look alike, as a shop's colour variants do), filed under the same label;
- emoji: the emoji renderer's images (noto and openmoji, 128 px, transparency kept), stretched to varied shapes; the
  two artists' drawings of one emoji share its label and are not copies;
- fashion-mnist: Fashion-MNIST's test photos as shipped (28 px grey), stretched to varied shapes;
- variants: the catalogue's cut-outs where two thirds of the products come in 2 to 4 of 9 colours (olive 19 degrees
  of hue from yellow, blue 19 from violet), each colour at its own size and margins; with `--per-original 6`, 1 to 6
  copies of each image copied (a photo uploaded again at each size);
- shades: as variants, with burgundy, navy and brown too (red, blue and orange darker: the same hue).

Scored besides: the copies found (of those planted), the size of the largest group holding two originals, and the
gallery images (not planted copies) the removal names (``originals_proposed``: a distinct one, or an original kept
as one of its copies).

Per gallery, `retrieval index build` with the pretrained pad export (`retrieval export --pretrained efficientnet_lite0
--resize pad`), then the same neighbour graph (10 each) read four ways: verified copies (the default, no threshold),
today's `--threshold auto` without verification, and fixed cuts 0.9 and 0.95. Scored: recall (planted copies grouped
with their original), false groups (groups holding two images that are not one original and its copies: colour
variants and the two artists count as distinct), images proposed for removal and how many of them are not copies.

    .venv/bin/retrieval export --pretrained efficientnet_lite0 --resize pad --out cv/model_pad.onnx
    .venv/bin/python benchmarks/copy_verification.py --out cv --model cv/model_pad.onnx [--datasets catalogue,emoji,
        fashion-mnist] [--seeds 0,1,2] [--gallery 300] [--planted 30]
    .venv/bin/python benchmarks/copy_verification.py --out cv --model cv/model_pad.onnx --datasets variants \
        --gallery 540 --planted 60 [--per-original 6] --reads verified

The cost (``--cost``, on a quiet machine; after a run, on its catalogue gallery of seed 0): images prepared per second
(SIFT at level 0, one thread), pairs compared per second from prepared images (one thread, and two), and the whole
verification of the gallery's candidate pairs (two threads, each image read and prepared once while cached); then
the time for galleries of 10^4, 10^5 and 10^6 images projected from the candidates per image and those rates.

    .venv/bin/python benchmarks/copy_verification.py --out cv --model cv/model_pad.onnx --cost
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import shutil
import sys
import time
from itertools import combinations
from pathlib import Path

import numpy as np
from PIL import Image, ImageEnhance

sys.path.insert(0, str(Path(__file__).resolve().parent))
from duplicates_threshold import ASPECTS, emoji_pool, fashion_pool, reshaped  # noqa: E402

COPY_KINDS = ("crop", "downscale", "jpeg", "brightness", "turn", "crop+jpeg", "downscale+brightness")
TINTS = ((196, 40, 40), (40, 150, 70), (45, 75, 200), (225, 190, 40), (130, 60, 170), (235, 120, 40))
# the variants' palette: the catalogue's tints and olive (19 degrees of hue from yellow), teal and pink
VARIANT_TINTS = (*TINTS, (120, 130, 40), (30, 140, 150), (220, 80, 150))
# and shades: burgundy, navy and brown, the hues of red, blue and orange darker (the colour check reads hue alone)
SHADE_TINTS = (*VARIANT_TINTS, (110, 25, 25), (25, 40, 110), (140, 80, 40))
CUTOUT_THRESHOLD = 10
READS = {"verified": {"threshold": "auto", "verify": True}, "auto (cosine)": {"threshold": "auto", "verify": False},
         "0.9": {"threshold": 0.9}, "0.95": {"threshold": 0.95}}


# --- the copies people make, drawn at random (not the calibration's fixed ones)
def benchmark_copy(image: Image.Image, kind: str, rng: np.random.Generator) -> Image.Image:
    """A copy of ``image`` (RGB) of ``kind`` with random strength; "a+b" applies both."""
    for part in kind.split("+"):
        width, height = image.size
        if part == "crop":
            share = rng.uniform(0.65, 0.9)
            w, h = max(8, round(width * share)), max(8, round(height * share))
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            image = image.crop((left, top, left + w, top + h))
        elif part == "downscale":
            share = rng.uniform(0.3, 0.7)
            image = image.resize((max(8, round(width * share)), max(8, round(height * share))),
                                 Image.Resampling.BILINEAR)
        elif part == "jpeg":
            buffer = io.BytesIO()
            image.save(buffer, format="JPEG", quality=int(rng.integers(20, 51)))
            image = Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")
        elif part == "brightness":
            image = ImageEnhance.Contrast(ImageEnhance.Brightness(image).enhance(rng.uniform(0.75, 1.35)))\
                .enhance(rng.uniform(0.85, 1.15))
        elif part == "turn":
            image = image.rotate(float(rng.uniform(2, 10) * rng.choice([-1, 1])), resample=Image.Resampling.BICUBIC,
                                 expand=True, fillcolor=(255, 255, 255))
        else:
            raise ValueError(kind)
    return image


# --- the pools: (key, label, image, product) where images of one product in other colours share ``product``
def catalogue_pool(count: int, seed: int) -> list[tuple[str, str, Image.Image, str]]:
    """Coloured cut-outs of Fashion-MNIST's train photos; a third of the products in 1 or 2 more colours."""
    from retrieval.data.builtin import FASHION_MNIST_CLASSES, read_fashion_mnist

    images, labels = read_fashion_mnist(None, "train")
    rng = np.random.default_rng(seed)
    products = rng.choice(len(images), size=count, replace=False)
    pool = []
    for number, index in enumerate(products.tolist()):
        if len(pool) >= count:
            break
        crop = object_crop(images[index])
        if crop is None:
            continue
        scale = rng.uniform(3, 6)
        margins = rng.uniform(0.05, 0.2, 4)
        colours = rng.choice(len(TINTS), size=1 + (int(rng.integers(1, 3)) if rng.random() < 1 / 3 else 0),
                             replace=False)
        label = FASHION_MNIST_CLASSES[int(labels[index])]
        for colour in colours.tolist():
            pool.append((f"p{number:04d}-c{colour}", label, cutout(crop, TINTS[colour], scale, margins),
                         f"p{number:04d}"))
    return pool[:count]


def object_crop(grey: np.ndarray) -> np.ndarray | None:
    """A Fashion-MNIST photo (uint8) cut to its object, as floats in [0, 1]; None where it is blank."""
    rows, cols = np.nonzero(grey > CUTOUT_THRESHOLD)
    if not len(rows):
        return None
    return grey[rows.min():rows.max() + 1, cols.min():cols.max() + 1].astype(np.float32) / 255.0


def cutout(crop: np.ndarray, tint: tuple[int, int, int], scale: float, margins: np.ndarray) -> Image.Image:
    """``crop`` coloured ``tint`` (its dark parts a quarter of it), scaled, on white with ``margins`` (left, right,
    top, bottom: shares of its size), JPEG at quality 90."""
    colour = np.asarray(tint, np.float32)
    rgb = crop[..., None] * colour + (1 - crop[..., None]) * colour * 0.25
    size = (max(1, round(crop.shape[1] * scale)), max(1, round(crop.shape[0] * scale)))
    obj = Image.fromarray(rgb.clip(0, 255).astype(np.uint8)).resize(size, Image.Resampling.BICUBIC)
    alpha = Image.fromarray(((crop > CUTOUT_THRESHOLD / 255) * 255).astype(np.uint8))\
        .resize(size, Image.Resampling.BILINEAR)
    canvas = Image.new("RGB", (round(size[0] * (1 + margins[0] + margins[1])),
                               round(size[1] * (1 + margins[2] + margins[3]))), (255, 255, 255))
    canvas.paste(obj, (round(size[0] * margins[0]), round(size[1] * margins[2])), alpha)
    buffer = io.BytesIO()
    canvas.save(buffer, format="JPEG", quality=90)
    return Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


def variants_pool(count: int, seed: int, tints: tuple[tuple[int, int, int], ...] = VARIANT_TINTS) -> list[
        tuple[str, str, Image.Image, str]]:
    """Coloured cut-outs of Fashion-MNIST's train photos where most products come in 2 to 4 of ``tints`` (hues as
    near as 19 degrees: olive and yellow), each colour photographed at its own size and margins."""
    from retrieval.data.builtin import FASHION_MNIST_CLASSES, read_fashion_mnist

    images, labels = read_fashion_mnist(None, "train")
    rng = np.random.default_rng(seed)
    pool: list[tuple[str, str, Image.Image, str]] = []
    for number, index in enumerate(rng.choice(len(images), size=count, replace=False).tolist()):
        crop = object_crop(images[index])
        if crop is None:
            continue
        colours = rng.choice(len(tints), size=1 if rng.random() < 0.35 else int(rng.integers(2, 5)), replace=False)
        for colour in colours.tolist():
            pool.append((f"p{number:04d}-v{colour}", FASHION_MNIST_CLASSES[int(labels[index])],
                         cutout(crop, tints[colour], rng.uniform(2.5, 6), rng.uniform(0.03, 0.3, 4)),
                         f"p{number:04d}"))
        if len(pool) >= count:
            break
    return pool[:count]


def shaped_pool(base: list[tuple[str, str, Image.Image]], count: int, seed: int) -> list[tuple[str, str, Image.Image,
                                                                                               str]]:
    """``count`` seeded images of ``base`` stretched to seeded shapes, on white; each its own product."""
    from retrieval.data.colour import flatten_alpha

    rng = np.random.default_rng(seed)
    chosen = sorted(rng.choice(len(base), size=min(count, len(base)), replace=False).tolist())
    out = []
    for position in chosen:
        key, label, image = base[position]
        image = flatten_alpha(image, (255, 255, 255)).convert("RGB")
        out.append((key, label, reshaped(image, ASPECTS[int(rng.integers(len(ASPECTS)))]), key))
    return out


def write_gallery(folder: Path, pool: list[tuple[str, str, Image.Image, str]], planted: int,
                  seed: int, per_original: int = 1, write: bool = True) -> tuple[dict[str, str], dict[str, str]]:
    """The gallery in ``folder/<label>/`` and ``planted`` copies (kinds in turn) of seeded images, 1 to
    ``per_original`` of each; (copy file name -> its original's, file name -> product). ``write`` False: the same
    answer, nothing written (the gallery is there already)."""
    if write and folder.exists():
        shutil.rmtree(folder)
    rng = np.random.default_rng(5000 + seed)
    product_of, names = {}, []
    for key, label, image, product in pool:
        target = folder / label.replace("/", "_")
        name = f"{key}.png"
        if write:
            target.mkdir(parents=True, exist_ok=True)
            image.save(target / name)
        product_of[name] = product
        names.append((name, label, image))
    truth = {}
    sources = sorted(rng.choice(len(names), planted, replace=False).tolist())
    if per_original > 1:  # several copies of one image (a photo re-uploaded at each size, say)
        counts = rng.integers(1, per_original + 1, planted)
        sources = sorted(p for p, c in zip(sources, counts.tolist(), strict=True) for _ in range(c))[:planted]
    for n, position in enumerate(sources):
        name, label, image = names[position]
        kind = COPY_KINDS[n % len(COPY_KINDS)]
        copy = benchmark_copy(image, kind, rng)
        copy_name = f"{Path(name).stem}__{f'{n:03d}-' if per_original > 1 else ''}{kind.replace('+', '-')}.png"
        if write:
            copy.save(folder / label.replace("/", "_") / copy_name)
        truth[copy_name] = name
        product_of[copy_name] = product_of[name]
    return truth, product_of


# --- scoring
def score(summary: dict, truth: dict[str, str], product_of: dict[str, str]) -> dict:
    """Recall of the planted copies; groups holding two images that are not one original and its copies (false);
    the removal proposed and how many of its images are not copies."""
    def original(name: str) -> str:
        return truth.get(name, name)

    groups = [[Path(p).name if p else None for p in group["paths"]] for group in summary["groups"]]
    together = {frozenset(pair) for members in groups for pair in combinations(members, 2)}
    found = sum(frozenset((copy, source)) in together for copy, source in truth.items())
    false = [members for members in groups if len({original(m) for m in members if m is not None}) > 1]
    colour = sum(len({product_of.get(original(m)) for m in members if m}) == 1 for members in false)
    name_of = {i: n for group, members in zip(summary["groups"], groups, strict=True)
               for i, n in zip(group["ids"], members, strict=True)}
    removal = summary.get("removal") or {"ids": []}
    wrong = 0
    for group, members in zip(summary["groups"], groups, strict=True):
        first = original(members[0]) if members[0] else None
        wrong += sum(i in removal["ids"] and original(name_of[i]) != first for i in group["ids"][1:])
    precisions = [g["estimated_precision"] for g in summary["groups"] if "estimated_precision" in g]
    proposed = [name_of[i] for i in removal["ids"] if i in name_of]
    kept_of = {i: members[0] for group, members in zip(summary["groups"], groups, strict=True) for i in group["ids"]}
    # gallery images proposed while a copy of them is kept (the group kept a downscaled or re-encoded copy)
    under_copy = sum(i in name_of and name_of[i] not in truth and truth.get(kept_of[i]) == name_of[i]
                     for i in removal["ids"])
    return {"threshold": summary["threshold"], "groups": len(groups), "false_groups": len(false),
            "found": found, "largest_false_group": max(map(len, false), default=0),
            # gallery images (not planted copies) the removal names: a distinct one, or an original kept as its copy
            "originals_proposed": sum(name not in truth for name in proposed),
            "originals_proposed_under_copy": under_copy,
            "distinct_originals_proposed": sum(name not in truth for name in proposed) - under_copy,
            "false_share": round(len(false) / len(groups), 3) if groups else 0.0, "colour_variant_groups": colour,
            "recall": round(found / max(1, len(truth)), 3), "proposed": len(removal["ids"]),
            "proposed_not_copies": wrong, "similar": summary.get("similar_found"),
            "estimated_precision_mean": round(float(np.mean(precisions)), 3) if precisions else None,
            "false_estimated": [g.get("estimated_precision") for g, members in zip(summary["groups"], groups,
                                                                                  strict=True)
                                if len({original(m) for m in members if m is not None}) > 1]}


def by_kind(summary: dict, truth: dict[str, str]) -> dict[str, bool]:
    groups = [[Path(p).name if p else None for p in group["paths"]] for group in summary["groups"]]
    together = {frozenset(pair) for members in groups for pair in combinations(members, 2)}
    return {copy: frozenset((copy, source)) in together for copy, source in truth.items()}


def run(out: Path, dataset: str, seed: int, count: int, planted: int, model: Path,
        reads: tuple[str, ...] = tuple(READS), per_original: int = 1, reuse: bool = False) -> dict:
    from retrieval.index import Index, IngestOptions, build_index
    from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates
    from retrieval.index.curation.neighbour_graph import index_graph

    if dataset == "catalogue":
        pool = catalogue_pool(count, seed)
    elif dataset == "variants":
        pool = variants_pool(count, seed)
    elif dataset == "shades":
        pool = variants_pool(count, seed, SHADE_TINTS)
    elif dataset == "emoji":
        pool = shaped_pool(emoji_pool(out), count, seed)
    else:
        pool = shaped_pool(fashion_pool(), count, seed)
    folder = out / f"{dataset}-{count}{f'-x{per_original}' if per_original > 1 else ''}-s{seed}"
    reuse = reuse and (folder / "index").exists()  # the gallery and its index as a run before left them
    truth, product_of = write_gallery(folder / "gallery", pool, planted, seed, per_original, write=not reuse)
    if not reuse:
        if (folder / "index").exists():
            shutil.rmtree(folder / "index")
        build_index(folder / "gallery", folder / "index", model=model,
                    options=IngestOptions(workers=2, progress=False))
    row = {"dataset": dataset, "seed": seed, "planted": len(truth), "per_original": per_original}
    with Index.open(folder / "index") as index:
        graph = index_graph(index, 10, None, seed)
        row["images"] = int(len(graph.ids))
        for name in reads:
            started = time.perf_counter()
            # every member listed: the scores read the groups whole
            summary = find_duplicates(index, DuplicateOptions(**READS[name], seed=seed, max_groups=10_000,
                                                              max_members=10_000), graph=graph)
            row[name] = score(summary, truth, product_of) | {"seconds": round(time.perf_counter() - started, 1)}
            if name == "verified":
                row[name]["verification"] = summary["verification"]
                row[name]["calibration"] = summary["calibration"]
                row[name]["found_by_copy"] = by_kind(summary, truth)
    return row


def aggregate(rows: list[dict]) -> str:
    """Mean ± standard deviation over the seeds, a line per data set and read, as Markdown."""
    lines = ["| data set | read | cut | groups | false groups | recall | proposed (not copies) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]

    def cell(values: list[float], digits: str = ".2f") -> str:
        return f"{np.mean(values):{digits}} ± {np.std(values):{digits}}"

    for dataset in dict.fromkeys(row["dataset"] for row in rows):
        part = [row for row in rows if row["dataset"] == dataset]
        for read in (read for read in READS if read in part[0]):
            r = [row[read] for row in part]

            def column(key: str, digits: str = ".2f", of: list[dict] = r) -> str:
                return cell([x[key] for x in of], digits)

            lines.append(f"| {dataset} ({part[0]['images']} images) | {read} | {column('threshold', '.3f')} "
                         f"| {column('groups', '.1f')} | {column('false_share')} | {column('recall')} "
                         f"| {column('proposed', '.1f')} ({column('proposed_not_copies', '.1f')}) |")
    return "\n".join(lines)


def cost(out: Path, count: int) -> dict:
    """What verification costs on this machine (see the module's docstring)."""
    from concurrent.futures import ThreadPoolExecutor

    from retrieval.index import Index
    from retrieval.index.curation.catalogued_images import catalogued_image_loader
    from retrieval.index.curation.copy_calibration import calibrate_verification
    from retrieval.index.curation.copy_check import compare_pair, image_features
    from retrieval.index.curation.copy_verification import FeatureCache, verify_pairs
    from retrieval.index.curation.linked_groups import duplicate_links
    from retrieval.index.curation.neighbour_graph import index_graph

    folder = out / f"catalogue-{count}-s0"
    with Index.open(folder / "index") as index:
        load = catalogued_image_loader(index)
        started = time.perf_counter()
        graph = index_graph(index, 10, None, 0)
        graph_seconds = time.perf_counter() - started
        started = time.perf_counter()
        calibration = calibrate_verification(index, graph, load, index.embedder, 50, 0, 2)
        calibration_seconds = time.perf_counter() - started
        first, second, cosines = duplicate_links(graph, calibration.candidate_cosine)
        ids = np.unique(np.concatenate([first, second]))
        pictures = {int(i): load(int(i)) for i in ids.tolist()}
        started = time.perf_counter()
        prepared = {i: image_features(picture) for i, picture in pictures.items()}
        features_per_second = len(prepared) / (time.perf_counter() - started)
        pairs = list(zip(first.tolist(), second.tolist(), strict=True))

        def compare(pair: tuple[int, int]) -> None:
            compare_pair(prepared[pair[0]], prepared[pair[1]])

        rates = {}
        for workers in (1, 2):
            started = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(compare, pairs))
            rates[workers] = len(pairs) / (time.perf_counter() - started)
        checked = verify_pairs(first, second, cosines, FeatureCache(load, (255, 255, 255)), calibration.rules, 2,
                               progress=False)
    per_image = len(pairs) / len(graph.ids)
    projected = {f"{n:.0e}": {"pairs": round(n * per_image), "hours": round(n * per_image / checked.pairs_per_second
                                                                             / 3600, 2)}
                 for n in (1e4, 1e5, 1e6)}
    return {"images": int(len(graph.ids)), "candidate_pairs": len(pairs), "pairs_per_image": round(per_image, 2),
            "graph_seconds": round(graph_seconds, 2), "calibration_seconds": round(calibration_seconds, 1),
            "features_per_second_1_thread": round(features_per_second, 1),
            "compare_pairs_per_second": {str(k): round(v, 1) for k, v in rates.items()},
            "verify_pairs_per_second_2_threads": round(checked.pairs_per_second, 1), "projected": projected}


COST_COMMAND = (".venv/bin/python benchmarks/copy_verification.py --out cv --model cv/model_pad.onnx --cost "
                "--save cpu-2core")


def save_cost(measured: dict, machine: str) -> None:
    """The cost table as benchmarks/results/copy-verification-cost-*.json."""
    from results_io import write_result

    from retrieval.index.curation.copy_calibration import COPY_KINDS, VERIFY_SAMPLE

    rows = [["images prepared (SIFT at full detail), 1 thread", f"{measured['features_per_second_1_thread']:,} /s"],
            ["pairs compared from prepared images, 1 thread", f"{measured['compare_pairs_per_second']['1']:,} /s"],
            ["pairs compared from prepared images, 2 threads", f"{measured['compare_pairs_per_second']['2']:,} /s"],
            ["whole verification (read, prepare once, compare), 2 threads",
             f"{measured['verify_pairs_per_second_2_threads']:,} pairs/s"],
            ["candidate pairs per image (10 neighbours, calibrated cosine)", f"{measured['pairs_per_image']}"],
            [f"calibration ({VERIFY_SAMPLE} images: {VERIFY_SAMPLE * len(COPY_KINDS)} copies embedded and compared)",
             f"{measured['calibration_seconds']} s"]]
    rows += [[f"projected: {float(n):,.0f} images ({v['pairs']:,} pairs)", f"{v['hours']} h"]
             for n, v in measured["projected"].items()]
    write_result("copy-verification-cost", machine, COST_COMMAND, ["step", "rate or time"], rows,
                 notes=f"the catalogue gallery of seed 0 ({measured['images']} images, {measured['candidate_pairs']} "
                       "candidate pairs); projections: images x candidate pairs per image / the whole verification's "
                       "rate (the neighbour graph's own time is in Near-duplicates and label audit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("copy-verification"))
    parser.add_argument("--model", type=Path, required=True, help="the pretrained pad export")
    parser.add_argument("--datasets", default="catalogue,emoji,fashion-mnist")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--gallery", type=int, default=300, help="images per gallery before the copies")
    parser.add_argument("--planted", type=int, default=30, help="copies planted in each gallery")
    parser.add_argument("--per-original", type=int, default=1, help="copies planted of one image, at most")
    parser.add_argument("--reuse", action="store_true",
                        help="read the galleries and indexes a run with the same settings left in --out")
    parser.add_argument("--reads", default=",".join(READS), help="the reads measured, of " + ", ".join(READS))
    parser.add_argument("--results", type=Path, help="write the rows here (JSON)")
    parser.add_argument("--cost", action="store_true", help="measure the cost on the catalogue gallery of seed 0")
    parser.add_argument("--from-rows", type=Path, help="render the tables from rows a run wrote (--results)")
    parser.add_argument("--save", metavar="MACHINE", help="with --cost: also write its table to benchmarks/results/")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cost:
        measured = cost(args.out, args.gallery)
        print(json.dumps(measured, indent=2))
        if args.save:
            save_cost(measured, args.save)
        return
    if args.from_rows:
        rows = json.loads(args.from_rows.read_text())["rows"]
        print(aggregate(rows))
        return
    rows = []
    for dataset in args.datasets.split(","):
        for seed in (int(s) for s in args.seeds.split(",")):
            reads = tuple(args.reads.split(","))
            rows.append(run(args.out, dataset, seed, args.gallery, args.planted, args.model, reads,
                            args.per_original, args.reuse))
            brief = {k: v for k, v in rows[-1].items() if k in ("dataset", "seed", "images")}
            print(json.dumps(brief | {read: {k: rows[-1][read][k] for k in (
                "groups", "false_groups", "largest_false_group", "found", "recall", "proposed", "proposed_not_copies",
                "originals_proposed", "originals_proposed_under_copy", "distinct_originals_proposed")}
                for read in reads}), flush=True)
    print(aggregate(rows))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps({"machine": f"{platform.machine()}, {platform.python_version()}, 2 cores",
                                            "date": time.strftime("%Y-%m-%d"), "model": args.model.name,
                                            "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
