"""A zero-shot text tower adapted to a gallery with pseudo-captions: the closed-form fit against a float64 least-squares
reference built in loops, the written text.onnx against numpy's normalize(M t + c), degenerate galleries (empty, one
image, duplicates, all alike) giving a finite map or a clear refusal, damaged class lists refused, an adaptation
worse on held-out pseudo-captions not delivered, and `retrieval index text` adapting (or, --no-adapt, not).
Real ONNX files (a small random BERT with MiniLM's tokenizer, tests/text_towers.py)."""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hostile_text_models import with_metadata
from index_builds import write_vector_index
from text_towers import small_text_model

from retrieval.cli.main import main
from retrieval.index.layout import IndexLayout
from retrieval.text import gallery_adapt
from retrieval.text.gallery_adapt import (
    Adaptation,
    AdaptConfig,
    GalleryAdaptError,
    adapt_tower,
    class_prompt,
    fit_adaptation,
    fit_for_gallery,
    normalize,
    pseudo_captions,
    write_adapted_tower,
    zero_shot_classes,
)
from retrieval.text.gallery_index import (
    ADAPTED_NAME,
    adapt_for_index,
    adapt_recorded,
    adaptation_sentence,
    sample_vectors,
)
from retrieval.text.text_index import record_text_model
from retrieval.text.text_onnx import TextEmbedder

pytestmark = pytest.mark.timeout(300)
HASH = "0123456789abcdef"
DIM = 16
CLASSES = ["cat", "dog", "car", "apple", "banana", "shoe", "shirt", "boat", "plane", "tree", "flower", "house",
           "chair", "cup", "clock", "bird", "fish", "horse", "train", "bus"]
TEXTS = ["a red apple", "a photo of a dog", "shoe", "x", "a photo of an apple, a banana or a cat"]


@pytest.fixture(scope="module")
def tower(tmp_path_factory) -> Path:
    """A zero-shot tower: a small text tower for image model HASH whose metadata lists CLASSES."""
    root = tmp_path_factory.mktemp("zero_shot")
    source = small_text_model(root / "source.onnx", HASH, DIM)
    return with_metadata(source, root / "zero_shot.onnx", text_origin="zero-shot",
                         zero_shot_classes=json.dumps(CLASSES))


@pytest.fixture(scope="module")
def embedder(tower) -> TextEmbedder:
    return TextEmbedder(tower)


def gallery(embedder: TextEmbedder, n: int = 400, seed: int = 0) -> np.ndarray:
    """Images of the classes, away from their prompts by one shift shared by the gallery (where a photo gallery's
    images sit apart from the text's class directions) and noise."""
    rng = np.random.default_rng(seed)
    prompts = embedder.embed([class_prompt(c) for c in CLASSES])
    shift = rng.standard_normal(DIM)
    return normalize(prompts[rng.integers(0, len(CLASSES), n)] + 0.5 * shift / np.linalg.norm(shift)
                     + 0.05 * rng.standard_normal((n, DIM))).astype(np.float32)


def reference_fit(texts, images, prompts, weights, lam, anchor, bias_ridge):
    """The objective as one stacked least-squares problem, written out row by row in float64: each pair, each prompt
    and each ridge term is a row of [t; 1] -> target, scaled by the square root of its weight."""
    n, d = images.shape
    rows, targets = [], []
    total = sum(weights)
    for i in range(n):
        scale = np.sqrt(weights[i] * (1 - anchor) / total)
        rows.append([scale * x for x in [*texts[i], 1.0]])
        targets.append([scale * y for y in images[i]])
    for j in range(len(prompts)):
        scale = np.sqrt(anchor / len(prompts))
        rows.append([scale * x for x in [*prompts[j], 1.0]])
        targets.append([scale * y for y in prompts[j]])
    for k in range(d + 1):  # M toward the identity, c toward 0
        scale = np.sqrt(lam / d * (bias_ridge if k == d else 1.0))
        rows.append([scale if m == k else 0.0 for m in range(d + 1)])
        targets.append([scale if (m == k and k < d) else 0.0 for m in range(d)])
    solution = np.linalg.lstsq(np.asarray(rows), np.asarray(targets), rcond=None)[0]
    return solution[:d].T, solution[d]


@pytest.mark.parametrize("chunk", [3, 10_000])
def test_the_fit_matches_a_float64_least_squares_reference(chunk):
    rng = np.random.default_rng(1)
    n, m, d = 37, 9, 6
    texts, images, prompts = (normalize(rng.standard_normal((k, d))) for k in (n, n, m))
    weights = rng.uniform(0.1, 2.0, n)
    fitted = fit_adaptation(texts, images, prompts, weights, lam=0.3, anchor=0.25, bias_ridge=0.05, chunk=chunk)
    matrix, bias = reference_fit(texts, images, prompts, weights, 0.3, 0.25, 0.05)
    assert np.allclose(fitted.matrix, matrix, atol=1e-9) and np.allclose(fitted.bias, bias, atol=1e-9)


def test_a_strong_ridge_keeps_the_identity_and_a_weak_one_learns_a_rotation():
    rng = np.random.default_rng(2)
    d = 8
    rotation = np.linalg.qr(rng.standard_normal((d, d)))[0]
    texts = normalize(rng.standard_normal((500, d)))
    images = texts @ rotation.T
    assert np.allclose(fit_adaptation(texts, images, lam=1e6).matrix, np.eye(d), atol=1e-3)
    learnt = fit_adaptation(texts, images, lam=1e-6, anchor=0.0)
    assert np.allclose(learnt(texts), images, atol=1e-3)


@pytest.mark.parametrize("case", ["empty", "one image", "duplicates", "all alike", "zero vectors"])
def test_degenerate_fits_give_a_finite_map(case):
    rng = np.random.default_rng(3)
    d = 5
    one = normalize(rng.standard_normal((1, d)))
    texts, images = {"empty": (np.zeros((0, d)), np.zeros((0, d))), "one image": (one, one[:, ::-1]),
                     "duplicates": (np.repeat(one, 50, 0), np.repeat(one[:, ::-1], 50, 0)),
                     "all alike": (normalize(rng.standard_normal((50, d))), np.repeat(one, 50, 0)),
                     "zero vectors": (np.zeros((10, d)), np.zeros((10, d)))}[case]
    fitted = fit_adaptation(texts, images, normalize(rng.standard_normal((4, d))))
    assert np.isfinite(fitted.matrix).all() and np.isfinite(fitted.bias).all()
    assert np.isfinite(fitted(np.vstack([texts, np.zeros((1, d))]))).all()


def test_pseudo_captions_name_each_image_s_top_classes_best_first():
    prompts = np.eye(4, dtype=np.float32)
    vectors = normalize(np.asarray([[0.9, 0.1, 0.5, 0.0], [0.05, 0.0, 0.2, 1.0]], np.float32))
    captions, confidence = pseudo_captions(vectors, prompts, ["ant", "bee", "cat", "dog"], 3)
    assert captions == ["a photo of an ant, cat or bee", "a photo of a dog, cat or ant"]
    assert (0 < confidence).all() and (confidence <= 1).all()
    assert pseudo_captions(vectors, prompts, ["ant", "bee", "cat", "dog"], 1)[0] == ["a photo of an ant",
                                                                                      "a photo of a dog"]


def test_the_written_tower_embeds_as_numpy_does_and_says_what_it_is(embedder, tmp_path):
    rng = np.random.default_rng(4)
    adaptation = Adaptation(np.eye(DIM) + 0.3 * rng.standard_normal((DIM, DIM)), 0.2 * rng.standard_normal(DIM))
    written = write_adapted_tower(embedder, adaptation, tmp_path / "adapted.onnx", {"lam": 0.1})
    reloaded = TextEmbedder(tmp_path / "adapted.onnx")  # its load checks pass
    assert reloaded.model_hash == written.model_hash != embedder.model_hash
    assert np.abs(reloaded.embed(TEXTS) - adaptation(embedder.embed(TEXTS))).max() < 1e-5
    metadata = {p.key: p.value for p in onnx.load(str(tmp_path / "adapted.onnx")).metadata_props}
    assert metadata["text_origin"] == "adapted" and metadata["adapted_from"] == embedder.model_hash
    assert json.loads(metadata["gallery_adaptation"]) == {"lam": 0.1}
    assert json.loads(metadata["zero_shot_classes"]) == CLASSES
    assert reloaded.image_model_hash == HASH and reloaded.tokenizer.json == embedder.tokenizer.json
    assert not list(tmp_path.glob("*.tmp"))


def test_a_map_to_zero_gives_zero_vectors_not_nan(embedder, tmp_path):
    written = write_adapted_tower(embedder, Adaptation(np.zeros((DIM, DIM)), np.zeros(DIM)), tmp_path / "z.onnx", {})
    out = written.embed(TEXTS)
    assert np.isfinite(out).all() and not out.any()


def test_an_adapted_tower_is_not_adapted_again(embedder, tmp_path):
    once = write_adapted_tower(embedder, Adaptation(np.eye(DIM), np.zeros(DIM)), tmp_path / "once.onnx", {})
    with pytest.raises(GalleryAdaptError, match="already holds an adaptation"):
        write_adapted_tower(once, Adaptation(np.eye(DIM), np.zeros(DIM)), tmp_path / "twice.onnx", {})


def test_the_adaptation_lifts_held_out_pseudo_caption_recall_on_a_shifted_gallery(embedder):
    adaptation, report = fit_for_gallery(embedder, gallery(embedder), AdaptConfig(classes_per_caption=1))
    assert report["adapted_recall@10"] > report["source_recall@10"] + 0.05
    assert report["fit_images"] + report["held_out_images"] == 400


@pytest.mark.parametrize("n", [0, 1, 49])
def test_a_gallery_too_small_to_check_is_refused_by_name(embedder, n):
    with pytest.raises(GalleryAdaptError, match=f"gallery holds {n} images, under the 50"):
        fit_for_gallery(embedder, gallery(embedder)[:n], AdaptConfig())


def test_a_gallery_all_alike_or_duplicated_gives_a_finite_adaptation(embedder):
    alike = np.repeat(gallery(embedder)[:1], 80, axis=0)
    adaptation, report = fit_for_gallery(embedder, alike, AdaptConfig())
    assert np.isfinite(adaptation.matrix).all() and np.isfinite(adaptation.bias).all()
    assert 0 <= report["source_recall@10"] <= 1 and 0 <= report["adapted_recall@10"] <= 1


def test_a_gallery_with_non_finite_vectors_is_refused(embedder):
    vectors = gallery(embedder)
    vectors[3, 2] = np.nan
    with pytest.raises(GalleryAdaptError, match="not finite"):
        fit_for_gallery(embedder, vectors, AdaptConfig())


def test_an_adaptation_worse_on_held_out_captions_is_not_delivered(embedder, tmp_path, monkeypatch):
    def collapsing(*args, **kwargs):  # every text to one point: no caption finds its images
        return Adaptation(np.zeros((DIM, DIM)), np.ones(DIM))

    monkeypatch.setattr(gallery_adapt, "fit_adaptation", collapsing)
    report = adapt_tower(embedder, gallery(embedder), tmp_path / "adapted.onnx", AdaptConfig())
    assert not report["adapted"] and report["text_model"] == str(embedder.path)
    assert "is below the zero-shot tower's" in report["reason"] and not (tmp_path / "adapted.onnx").exists()


DAMAGED = {  # the class list as a damaged or hostile file holds it (made when the test runs), what the refusal says
    "an object": (lambda: '{"cat": 1}', "not a list of names"), "numbers": (lambda: "[1, 2, 3]", "not a list of names"),
    "not json": (lambda: "not json", "not JSON"), "one class": (lambda: json.dumps(["cat"]), "lists 1 zero_shot"),
    "too many": (lambda: json.dumps(["c"] * 10_001), "lists 10001"),
    "an empty name": (lambda: json.dumps(["cat", ""]), "empty or over 200"),
    "a long name": (lambda: json.dumps(["cat", "x" * 201]), "empty or over 200"),
    "deeply nested": (lambda: "[" * 100_000, "not JSON"),
    "1 GB": (lambda: "x" * (1 << 30), "1,073,741,824 characters"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_class_list_is_refused_naming_why(case):
    make, problem = DAMAGED[case]
    with pytest.raises(GalleryAdaptError) as refused:
        zero_shot_classes({"text_origin": "zero-shot", "zero_shot_classes": make()})
    assert problem in str(refused.value) and "export the zero-shot tower again" in str(refused.value)


def test_a_tower_that_is_not_zero_shot_has_no_classes():
    assert zero_shot_classes({"zero_shot_classes": json.dumps(CLASSES)}) is None
    assert zero_shot_classes({"text_origin": "adapted", "zero_shot_classes": json.dumps(CLASSES)}) is None
    with pytest.raises(GalleryAdaptError, match="lists no zero_shot_classes"):
        zero_shot_classes({"text_origin": "zero-shot"})


def vector_index(root: Path, vectors: np.ndarray) -> Path:
    """A finished index folder of ``vectors`` recorded as built with image model HASH (no images needed)."""
    layout, catalogue, _ = write_vector_index(root, vectors, shard_size=64)
    catalogue.close()
    flat = faiss.IndexIDMap2(faiss.IndexFlatIP(vectors.shape[1]))
    flat.add_with_ids(vectors, np.arange(1, len(vectors) + 1))
    faiss.write_index(flat, str(layout.faiss))
    layout.write_info({"model_hash": HASH, "embedding_dim": vectors.shape[1], "index_key": "Flat", "metric": "ip"})
    return root


def test_sampling_an_index_reads_a_seeded_subset_of_its_stored_vectors(embedder, tmp_path):
    vectors = gallery(embedder, 300)
    index = vector_index(tmp_path / "index", vectors)
    sample = sample_vectors(index, 100, seed=1)
    assert sample.shape == (100, DIM)
    stored = {v.tobytes() for v in vectors}
    assert all(v.tobytes() in stored for v in sample)
    assert np.array_equal(sample, sample_vectors(index, 100, seed=1))
    assert not np.array_equal(sample, sample_vectors(index, 100, seed=2))
    assert len(sample_vectors(index, 1000)) == 300


def run(*args) -> object:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_index_text_adapts_a_zero_shot_tower_and_records_the_adapted_one(embedder, tower, tmp_path):
    index = vector_index(tmp_path / "index", gallery(embedder))
    result = run("index", "text", index, "--text-model", tower)
    assert result.exit_code == 0, result.output
    assert "was adapted to the gallery" in result.output and "the adapted tower is the one recorded" in result.output
    info = IndexLayout(index).read_info()
    adapted = TextEmbedder(info["text_model_path"])
    assert info["text_model_hash"] == adapted.model_hash != embedder.model_hash
    assert [p.name for p in index.glob(ADAPTED_NAME)] == [f"text.adapted.{adapted.model_hash[:16]}.onnx"]
    searched = run("search", "--index", index, "--text", "a photo of a cat", "-k", "3", "--json")
    assert searched.exit_code == 0, searched.output

    kept = run("index", "text", index, "--text-model", tower, "--no-adapt", "--json")
    assert kept.exit_code == 0, kept.output
    assert IndexLayout(index).read_info()["text_model_hash"] == embedder.model_hash


def test_index_text_keeps_the_zero_shot_tower_when_the_gallery_is_too_small_and_says_why(embedder, tower, tmp_path):
    index = vector_index(tmp_path / "index", gallery(embedder, 20))
    result = run("index", "text", index, "--text-model", tower)
    assert result.exit_code == 0, result.output
    assert "was not adapted" in result.output and "holds 20 images" in result.output
    assert IndexLayout(index).read_info()["text_model_hash"] == embedder.model_hash
    assert not list(index.glob(ADAPTED_NAME))


def test_index_text_refuses_a_zero_shot_tower_with_a_damaged_class_list(tower, tmp_path, embedder):
    index = vector_index(tmp_path / "index", gallery(embedder, 60))
    damaged = with_metadata(tower, tmp_path / "damaged.onnx", zero_shot_classes='"cat"')
    result = run("index", "text", index, "--text-model", damaged)
    assert result.exit_code != 0 and "not a list of names" in result.output
    assert "Traceback" not in result.output and "text_model_hash" not in IndexLayout(index).read_info()


def test_a_tower_that_is_not_zero_shot_is_recorded_as_it_is(tmp_path, embedder):
    plain = small_text_model(tmp_path / "plain.onnx", HASH, DIM)
    index = vector_index(tmp_path / "index", gallery(embedder, 60))
    report = adapt_for_index(index, plain)
    assert not report["adapted"] and report["text_model"] == str(plain)


def test_after_a_build_the_recorded_zero_shot_tower_is_replaced_by_the_adapted_one(embedder, tower, tmp_path):
    index = vector_index(tmp_path / "index", gallery(embedder))
    record_text_model(index, tower)
    report = adapt_recorded(index, tower)
    assert report["adapted"] and IndexLayout(index).read_info()["text_model_hash"] == report["adapted_hash"]
    assert "the adapted tower is the one recorded" in adaptation_sentence(report)


def test_after_a_build_a_damaged_class_list_leaves_the_index_as_it_is_and_says_why(embedder, tower, tmp_path):
    index = vector_index(tmp_path / "index", gallery(embedder))
    damaged = with_metadata(tower, tmp_path / "damaged.onnx", zero_shot_classes="[1, 2]")
    record_text_model(index, damaged)
    report = adapt_recorded(index, damaged)
    assert not report["adapted"] and "not a list of names" in adaptation_sentence(report)
    assert IndexLayout(index).read_info()["text_model_hash"] == TextEmbedder(damaged).model_hash


def test_an_adapted_tower_that_cannot_be_recorded_is_removed_and_the_recorded_one_kept(embedder, tower, tmp_path,
                                                                                       monkeypatch):
    from retrieval.text import gallery_index

    index = vector_index(tmp_path / "index", gallery(embedder))
    assert run("index", "text", index, "--text-model", tower).exit_code == 0
    before = IndexLayout(index).read_info()
    recorded = Path(before["text_model_path"])

    def locked(*args, **kwargs):
        raise OSError("the index is locked by another writer")

    monkeypatch.setattr(gallery_index, "record_text_model", locked)
    with pytest.raises(OSError, match="locked"):
        gallery_index.record_adapted(index, tower, gallery_index.AdaptConfig(seed=1))
    assert IndexLayout(index).read_info()["text_model_hash"] == before["text_model_hash"]
    assert recorded.is_file() and TextEmbedder(recorded).model_hash == before["text_model_hash"]
    assert [p.name for p in index.glob(ADAPTED_NAME)] == [recorded.name]  # the new one is gone, the recorded kept
