"""`retrieval export --int8`: an fp32 export quantized to int8, calibrated on a seeded sample of the user's images,
verified against its parent on others, recorded in its metadata, refused beyond the bounds; an index either model
builds is searched with the other, and nothing else changes which models may search an index."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from planted import write_items

from retrieval.cli.main import main
from retrieval.compatibility import cross_neighbour_overlap, int8_record, label_metrics, neighbour_overlap
from retrieval.errors import ParameterError
from retrieval.export import Int8Refused, OnnxEmbedder, export_int8, export_pretrained
from retrieval.export.int8_export import (
    MIN_LOW_COSINE,
    MIN_MEDIAN_COSINE,
    Int8Recipe,
    verify_int8,
)
from retrieval.extras import EXTRA_MODULES
from retrieval.index import Index, build_index
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.query_embedder import ModelMismatchError

SIZE = 64
QUICK = IngestOptions(batch_size=16, workers=1, progress=False)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The pretrained EfficientNet-Lite0 at 64 px (fp32), its int8 quantization on a folder of 100 product shots of
    10 classes, and another fp32 model (96 px) for contrast."""
    work = tmp_path_factory.mktemp("int8")
    photos = work / "photos"
    write_items(photos, list(range(100)), side=72)
    fp32 = work / "model-fp32.onnx"
    export_pretrained("efficientnet_lite0", fp32, image_size=SIZE, resize="pad", log=lambda line: None)
    other = work / "other.onnx"
    export_pretrained("efficientnet_lite0", other, image_size=96, resize="pad", log=lambda line: None)
    int8 = work / "model.onnx"
    result = export_int8(fp32, int8, photos, images=48, seed=0, log=lambda line: None)
    return {"work": work, "photos": photos, "fp32": fp32, "int8": int8, "other": other, "result": result}


def test_the_int8_model_is_quantized_recorded_and_close_to_its_parent(models):
    proto = onnx.load(str(models["int8"]))
    ops = {node.op_type for node in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # the convolutions run on int8 inputs and weights
    int8, fp32 = OnnxEmbedder(models["int8"]), OnnxEmbedder(models["fp32"])
    meta = int8.metadata
    assert int8.precision == "int8" and meta["model_hash"] == int8.model_hash != fp32.model_hash
    assert meta["fp32_model_hash"] == fp32.model_hash
    assert json.loads(meta["compatible_with"]) == sorted(fp32.model_hashes)  # an index may record either
    record = json.loads(meta["int8"])
    assert record["calibration"]["images"] == 48 and record["calibration"]["of"] == 100
    assert record["calibration"]["seed"] == 0 and record["recipe"]["per_channel"]
    check = record["verification"]
    assert check["held_out"] and check["images"] == 52 and not check["failures"]
    assert check["labels"]["fp32"]["recall@1"] > 0.3  # measured on the folders' labels
    # measured again here, on images the export never saw
    extra = write_items(models["work"] / "unseen", list(range(200, 240)), side=90)
    a, b = fp32.embed(extra), int8.embed(extra)
    cosine = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    assert np.median(cosine) >= MIN_MEDIAN_COSINE and cosine.min() > MIN_LOW_COSINE


def test_the_calibration_sample_follows_its_seed(models, tmp_path):
    first = json.loads(OnnxEmbedder(models["int8"]).metadata["int8"])["calibration"]["paths_sha256"]
    again = export_int8(models["fp32"], tmp_path / "again.onnx", models["photos"], images=48, seed=0,
                        log=lambda line: None)
    other = export_int8(models["fp32"], tmp_path / "other.onnx", models["photos"], images=48, seed=1,
                        log=lambda line: None)
    assert json.loads(again.metadata["int8"])["calibration"]["paths_sha256"] == first
    assert json.loads(other.metadata["int8"])["calibration"]["paths_sha256"] != first


def test_a_quantization_that_loses_too_much_is_refused_and_writes_nothing(models, tmp_path):
    # one scale per tensor for the depthwise convolutions, with only the convolutions quantized (their ReLU6 left
    # outside their ranges): the recipe's study measured it far below the bounds
    lossy = Int8Recipe(per_channel=False, op_types=("Conv",))
    out = tmp_path / "lossy.onnx"
    with pytest.raises(Int8Refused, match="would lose more than the bounds allow.*Nothing was written") as refused:
        export_int8(models["fp32"], out, models["photos"], images=48, recipe=lossy, log=lambda line: None)
    assert refused.value.verification.failures and not out.exists()


def test_indexes_of_either_model_are_searched_with_the_other_and_no_other_model(models, tmp_path):
    photos = models["photos"]
    for builder, searcher in (("fp32", "int8"), ("int8", "fp32")):
        folder = tmp_path / f"by-{builder}"
        build_index(photos, folder, model=models[builder], options=QUICK)
        with Index.open(folder, embedder=OnnxEmbedder(models[searcher])) as index:
            own = index.search_images([next(photos.rglob("*.png"))], k=1)[0][0]
        assert own.score > 0.97  # the query's own image, embedded by the other model, comes first
        with pytest.raises(ModelMismatchError, match="not declared compatible"):
            Index.open(folder, embedder=OnnxEmbedder(models["other"]))


def test_an_upgrade_to_the_int8_model_serves_at_once_and_says_what_its_quantization_measured(models, tmp_path):
    folder = tmp_path / "index"
    build_index(models["photos"], folder, model=models["fp32"], options=QUICK)
    run = CliRunner().invoke(main, ["index", "upgrade", str(folder), "--model", str(models["int8"])])
    assert run.exit_code == 0, run.output
    assert "served as it came (declared compatible)" in run.output
    assert "measured when it was quantized: int8 of fp32 model " + OnnxEmbedder(models["fp32"]).model_hash in run.output


@pytest.mark.parametrize("raw", ["", "not json", "[1]", '{"verification": {}}', '{"verification": 3}'])
def test_an_unreadable_int8_record_is_no_record(raw):
    assert int8_record({"int8": raw}) is None


def test_the_command_quantizes_an_existing_export_and_says_so(models, tmp_path):
    out = tmp_path / "cli.onnx"
    run = CliRunner().invoke(main, ["export", "--int8", "--onnx", str(models["fp32"]), "--calibration",
                                    str(models["photos"]), "--calibration-images", "40", "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert "int8, model_hash" in run.output and "an index either one builds is searched with the other" in run.output
    assert "held-out images: cosine to fp32 median" in run.output and "WARNING" not in run.output
    assert json.loads(OnnxEmbedder(out).metadata["int8"])["calibration"]["images"] == 40


def test_an_existing_export_is_quantized_without_the_train_extra(models, tmp_path):
    """torch and the train extra's other modules blocked in a fresh process, as on the base install."""
    out = tmp_path / "slim.onnx"
    blocked = f"import sys; sys.modules.update(dict.fromkeys({list(EXTRA_MODULES['train'])!r}))\n"
    code = blocked + textwrap.dedent(f"""
        from retrieval.cli.main import main
        try:
            main(["export", "--int8", "--onnx", {str(models["fp32"])!r}, "--calibration", {str(models["photos"])!r},
                  "--calibration-images", "32", "--out", {str(out)!r}], prog_name="retrieval")
        except SystemExit as stop:
            assert not stop.code, stop.code
        assert sys.modules.get("torch") is None
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert OnnxEmbedder(out).precision == "int8"


@pytest.mark.parametrize(("args", "message"), [
    (["--int8", "--onnx", "{fp32}"], "--int8 needs --calibration"),
    (["--onnx", "{fp32}", "--calibration", "{photos}"], "give it with --int8"),
    (["--int8", "--fp16", "--onnx", "{fp32}", "--calibration", "{photos}"], "choose one"),
    (["--calibration", "{photos}", "--pretrained", "efficientnet_lite0"], "apply to --int8"),
    (["--int8", "--onnx", "{fp32}", "--calibration", "{photos}", "--calibration-images", "5"], "at least 16"),
    (["--int8", "--onnx", "{fp32}", "--calibration", "{few}"], "holds 3 image"),
    (["--int8", "--onnx", "{int8}", "--calibration", "{photos}"], "is int8; int8 is quantized from an fp32"),
])
def test_bad_int8_requests_are_refused_with_the_fix(models, tmp_path, args, message):
    few = tmp_path / "few"
    write_items(few, [1, 2, 3], side=40)
    values = {"fp32": models["fp32"], "int8": models["int8"], "photos": models["photos"], "few": few}
    run = CliRunner().invoke(main, ["export", *[a.format(**values) for a in args], "--out", str(tmp_path / "x.onnx")])
    assert run.exit_code != 0 and message in run.output, run.output
    assert not (tmp_path / "x.onnx").exists()


def test_unreadable_calibration_files_are_counted_and_never_stop_the_export(models, tmp_path):
    folder = tmp_path / "mixed"
    write_items(folder, list(range(300, 340)), side=70)
    jpeg = next(folder.rglob("*.png")).read_bytes()
    bad = {"empty.png": b"", "text.png": b"not an image at all", "cut.png": jpeg[: len(jpeg) // 3],
           "header.jpg": b"\xff\xd8\xff\xe0" + b"\x00" * 12}
    for name, data in bad.items():
        (folder / name).write_bytes(data)
    result = export_int8(models["fp32"], tmp_path / "x.onnx", folder, images=44, log=lambda line: None)
    record = json.loads(result.metadata["int8"])["calibration"]
    assert record["sampled"] == 44 and record["unreadable"] == len(bad) and record["images"] == 40
    assert result.verification.images == 40 and not result.verification.held_out


def test_too_many_calibration_images_for_memory_are_refused_before_reading(models, tmp_path):
    with pytest.raises(ParameterError, match="GiB at once"):
        export_int8(models["fp32"], tmp_path / "x.onnx", models["photos"], images=10**6, log=lambda line: None)


def test_the_export_runs_as_its_memory_plan_lowered_it_and_records_the_plan(models, tmp_path, monkeypatch):
    """A budget with room for one image a batch: the quantizer and both models run one image at a time, as the
    log and the record say."""
    from retrieval.export import int8_export

    least = int8_export.plan_memory(SIZE, models["fp32"].stat().st_size, 48, budget=2**40)
    room = 270 * least.image_bytes  # a calibration run of one image, not the verification images and a batch of 2
    budget = least.total - max(least.parts()["calibration run"], least.parts()["verification images"]
                               + least.parts()["batches"]) + room
    monkeypatch.setattr(int8_export, "INT8_MEMORY_BYTES", budget)
    batches, reader = [], int8_export.BatchReader
    monkeypatch.setattr(int8_export, "BatchReader",
                        lambda arrays, batch: batches.append(batch) or reader(arrays, batch))
    lines = []
    result = export_int8(models["fp32"], tmp_path / "x.onnx", models["photos"], images=48, log=lines.append)
    memory = json.loads(result.metadata["int8"])["calibration"]["memory"]
    assert (memory["batch"], memory["calibration_batch"], batches) == (1, 1, [1]), memory
    verified = 270 - int8_export.ACTIVATION_IMAGES - int8_export.DECODED_IMAGES  # the room less a batch of one
    assert memory["verify_images"] == verified and memory["planned_bytes"] <= budget == memory["budget_bytes"]
    assert any(f"calibration batch 8 -> 1, batch 32 -> 1, verification images 256 -> {verified}" in line
               for line in lines), lines


# ---------------------------------------------------------------- the verification's arithmetic

def unit(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def slow_cross_overlap(reference: np.ndarray, queries: np.ndarray, k: int) -> list[float]:
    """Loops: i's k nearest others under reference, and queries[i]'s k nearest reference rows other than i."""
    shares = []
    for i in range(len(reference)):
        others = [j for j in range(len(reference)) if j != i]
        own = sorted(others, key=lambda j: -float(reference[i] @ reference[j]))[:k]
        crossed = sorted(others, key=lambda j: -float(queries[i] @ reference[j]))[:k]
        shares.append(len(set(own) & set(crossed)) / k)
    return shares


def test_cross_model_neighbours_match_a_slow_reference():
    rng = np.random.default_rng(0)
    reference = unit(rng.normal(size=(40, 6)))
    queries = unit(reference + 0.3 * rng.normal(size=(40, 6)))
    expected = slow_cross_overlap(reference, queries, 5)
    np.testing.assert_allclose(cross_neighbour_overlap(reference, queries, 5), expected)
    np.testing.assert_array_equal(cross_neighbour_overlap(reference, reference, 5), np.ones(40))


def slow_label_metrics(queries, gallery, labels):
    """Recall@1 and MAP@R by the definitions, one query at a time."""
    recalls, maps = [], []
    for i in range(len(labels)):
        others = sorted((j for j in range(len(labels)) if j != i), key=lambda j: -float(queries[i] @ gallery[j]))
        relevant = sum(labels[j] == labels[i] for j in others)
        if relevant == 0:
            continue
        recalls.append(float(labels[others[0]] == labels[i]))
        hits, total = 0, 0.0
        for rank, j in enumerate(others[:relevant], 1):
            if labels[j] == labels[i]:
                hits += 1
                total += hits / rank
        maps.append(total / relevant)
    return {"recall@1": np.mean(recalls), "map@r": np.mean(maps)}


def test_label_metrics_match_their_definitions():
    rng = np.random.default_rng(1)
    queries, gallery = unit(rng.normal(size=(50, 5))), unit(rng.normal(size=(50, 5)))
    labels = [f"c{n}" for n in rng.integers(0, 5, 50)]
    labels[7] = "alone"  # a class of one image: asked of nobody, and no answer to anyone
    got, expected = label_metrics(queries, gallery, labels), slow_label_metrics(queries, gallery, labels)
    assert got == pytest.approx(expected)


def test_verification_says_which_bound_was_missed():
    rng = np.random.default_rng(2)
    fp32 = unit(rng.normal(size=(60, 16)))
    close = verify_int8(fp32, unit(fp32 + 0.01 * rng.normal(size=fp32.shape)), held_out=True)
    assert close.passed and close.cosine["median"] > 0.99
    assert close.neighbours_kept == pytest.approx(neighbour_overlap(fp32, unit(fp32 + 0.0), 10).mean(), abs=0.2)
    moved = fp32.copy()
    moved[:3] = unit(rng.normal(size=(3, 16)))  # 3 of 60 images land elsewhere: the 1st percentile sees them
    far = verify_int8(fp32, moved, held_out=False)
    assert any("1st percentile" in failure for failure in far.failures)
    assert not any("median" in failure for failure in far.failures)
    noise = verify_int8(fp32, unit(rng.normal(size=fp32.shape)), held_out=True)
    assert len(noise.failures) == 5 and not noise.passed
