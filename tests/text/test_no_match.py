"""An honest "no good match" for text queries: the floor calibrated when a text model is recorded (compared with a
slow reference), a text query's answer saying `no_match` both ways (CLI, --json, API, batch, client), a keyword hit
overriding it, a floor of another text model ignored, and hostile index.json values refused with a clear message.
Real index folder, real ONNX text model (a small BERT whose projection is fitted onto gallery images' vectors)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from serve_fixtures import export_model, write_gallery
from text_towers import minilm_folder, small_text_model

from retrieval.cli.main import main
from retrieval.index import Index, IngestOptions, build_index
from retrieval.index.search import SearchResult
from retrieval.records.index_info import IndexInfo
from retrieval.text.no_match import TEXT_NO_MATCH, NoMatchFloor, calibration_record, floor_of, read_floor
from retrieval.text.no_match_texts import CALIBRATION_TEXTS
from retrieval.text.text_index import record_text_model
from retrieval.text.text_onnx import TextEmbedder

pytestmark = pytest.mark.timeout(300)

# each caption fitted onto one gallery image's vector: the text model finds those images
CAPTIONS = [f"{colour} {thing}" for colour in ("a red", "a blue", "a green", "a yellow")
            for thing in ("apple", "star", "heart", "flag", "moon")]
MATCHING = "a red apple"
ABSENT = ["a laptop", "a garden hose", "a violin", "a tractor", "a wedding cake", "a snow shovel", "a lighthouse",
          "a dentist", "a bicycle pump", "a kettle", "a submarine", "a tennis racket"]


def run(*args: object):
    """`retrieval ARGS` through CliRunner."""
    return CliRunner().invoke(main, [str(arg) for arg in args])


def fitted_text_model(path: Path, index_dir: Path) -> Path:
    """A text.onnx of a small BERT whose projection is the ridge regression of gallery images' vectors on the
    captions' sentence features (LiT's linear start): each of ``CAPTIONS`` lands on its own image."""
    from retrieval.export.text_export import export_text_tower
    from retrieval.text.encoder import EncoderConfig, SentenceEncoder
    from retrieval.text.tokens import TextTokenizer
    from retrieval.text.tower import TextTower

    with Index.open(index_dir) as index:
        vectors = index.reconstructed_vectors(index.ids[: len(CAPTIONS)])
        model_hash = index.model_hash
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=512, type_vocab_size=2,
                           layer_norm_eps=1e-12)
    tower = TextTower(SentenceEncoder(config), vectors.shape[1]).eval()
    tokenizer = TextTokenizer.from_file(str(minilm_folder() / "tokenizer.json"), 32)
    ids, mask = tokenizer(CAPTIONS)
    with torch.no_grad():
        features = tower.encoder(torch.from_numpy(ids), torch.from_numpy(mask))
    tower.fit_projection(features, torch.from_numpy(np.asarray(vectors)), ridge=1e-6)
    export_text_tower(tower, tokenizer, path, model_hash, {"name": "small-test-bert"}, CAPTIONS)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A small real index (emoji, or digits without the fonts), its fitted text model and one of random weights."""
    root = tmp_path_factory.mktemp("no_match")
    gallery, _, _ = write_gallery(root / "data")
    model = export_model(root / "model.onnx")
    build_index(gallery, root / "index", model=model, options=IngestOptions(batch_size=16, workers=0, progress=False))
    model_hash = json.loads((root / "index" / "index.json").read_text())["model_hash"]
    return {"index": root / "index", "text": fitted_text_model(root / "text.onnx", root / "index"),
            "other": small_text_model(root / "other.onnx", model_hash, 32, seed=3)}


@pytest.fixture
def index_copy(built, tmp_path) -> Path:
    """A test's own copy of the index, its fitted text model recorded (and the floor calibrated)."""
    copy = Path(shutil.copytree(built["index"], tmp_path / "index"))
    record_text_model(copy, built["text"])
    return copy


def info_of(index_dir: Path) -> dict:
    return json.loads((index_dir / "index.json").read_text())


def best_score(index_dir: Path, text_model: Path, query: str) -> float:
    """A query's best cosine over the gallery, by brute force over the stored vectors."""
    with Index.open(index_dir) as index:
        vectors = index.reconstructed_vectors(index.ids)
    return float((vectors @ TextEmbedder(text_model).embed([query])[0]).max())


def slow_quantile(values: list[float], q: float) -> float:
    """The q-quantile with linear interpolation between order statistics (numpy's default), written out."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def slow_floor(gallery: np.ndarray, texts: np.ndarray, quantile: float) -> tuple[float, set[int]]:
    """The floor by the definition, in loops: each text's best dot product, the texts above Q3 + 1.5 IQR left out,
    the quantile of the rest. Returns the floor and the left-out texts' positions."""
    best = [max(float(np.dot(t, g)) for g in gallery) for t in texts]
    q1, q3 = slow_quantile(best, 0.25), slow_quantile(best, 0.75)
    fence = q3 + 1.5 * (q3 - q1)
    left_out = {i for i, score in enumerate(best) if score > fence}
    return slow_quantile([s for i, s in enumerate(best) if i not in left_out], quantile), left_out


def unit_rows(array: np.ndarray) -> np.ndarray:
    return array / np.linalg.norm(array, axis=1, keepdims=True)


@pytest.mark.parametrize("quantile", [0.5, 0.9, 0.97])
def test_the_floor_matches_a_slow_reference_and_leaves_out_what_the_gallery_answers(quantile):
    rng = np.random.default_rng(7)
    gallery = unit_rows(rng.standard_normal((300, 24)))
    texts = unit_rows(rng.standard_normal((120, 24)))
    texts[:6] = unit_rows(gallery[:6] + 0.05 * rng.standard_normal((6, 24)))  # six the gallery answers
    expected, left_out = slow_floor(gallery, texts, quantile)
    best = (texts @ gallery.T).max(axis=1)
    floor, kept = floor_of(best, quantile)
    assert floor == pytest.approx(expected, abs=1e-9)
    assert set(np.flatnonzero(~kept)) == left_out and left_out >= set(range(6))
    names = [f"text {i}" for i in range(len(texts))]
    record = calibration_record(best, names, "texthash", "imagehash", 300, quantile)
    assert record["floor"] == pytest.approx(expected, abs=1e-6) and record["texts"] == 120 - len(left_out)
    assert record["left_out_texts"][0] == names[int(np.argmax(best))]  # the best answered first


def test_recording_a_text_model_calibrates_the_floor_with_the_index_search(index_copy, built):
    record = info_of(index_copy)[TEXT_NO_MATCH]
    with Index.open(index_copy) as index:
        gallery = index.reconstructed_vectors(index.ids)
    expected, left_out = slow_floor(gallery, TextEmbedder(built["text"]).embed(list(CALIBRATION_TEXTS)),
                                    record["quantile"])
    assert record["floor"] == pytest.approx(expected, abs=1e-5)
    assert record["text_model_hash"] == TextEmbedder(built["text"]).model_hash
    assert record["model_hash"] == info_of(index_copy)["model_hash"] and record["images"] == len(gallery)
    assert record["texts"] + record["left_out"] == len(CALIBRATION_TEXTS) and record["left_out"] == len(left_out)


def test_a_text_query_says_no_match_only_when_nothing_scores_above_the_floor(index_copy, built):
    floor = info_of(index_copy)[TEXT_NO_MATCH]["floor"]
    texts = [MATCHING, *ABSENT]
    searched = run("search", "--index", index_copy, *[a for t in texts for a in ("--text", t)], "-k", "3", "--json")
    assert searched.exit_code == 0, searched.output
    answers = {answer["query"]: answer for answer in json.loads(searched.stdout)}
    assert answers[MATCHING]["no_match"] is False and answers[MATCHING]["results"][0]["score"] > 0.99
    for query in ABSENT:
        assert answers[query]["no_match"] is (best_score(index_copy, built["text"], query) < floor), query
        assert len(answers[query]["results"]) == 3  # the nearest are still given
    absent = [query for query in ABSENT if answers[query]["no_match"]]
    assert absent, "no absent product scored under the floor"

    plain = run("search", "--index", index_copy, "--text", absent[0], "--text", MATCHING, "-k", "2")
    assert plain.exit_code == 0, plain.output
    lines = plain.stdout.splitlines()
    assert lines[:2] == [json.dumps(absent[0]), f"  no good match for '{absent[0]}'; the nearest:"]
    assert lines[2].startswith("    1  ") and "no good match" not in plain.stdout.split(json.dumps(MATCHING))[1]


def test_the_server_the_batch_the_client_and_the_app_say_no_match(index_copy, built, tmp_path):
    import gradio as gr
    from fastapi.testclient import TestClient

    from retrieval.client.results import SearchResults
    from retrieval.serve.api import create_api
    from retrieval.serve.service import SearchService
    from retrieval.serve.ui.search import ExampleSet, SearchTab
    from retrieval.serve.upload_cache import UploadRecords

    floor = info_of(index_copy)[TEXT_NO_MATCH]["floor"]
    absent = [query for query in ABSENT if best_score(index_copy, built["text"], query) < floor]
    service = SearchService(index_copy, max_upload_bytes=200_000, reload_interval_s=None)
    try:
        with TestClient(create_api(service)) as client:
            matching = client.post("/search", json={"text": MATCHING, "k": 3}).json()
            missing = client.post("/search", json={"text": absent[0], "k": 3}).json()
            assert matching["no_match"] is False and missing["no_match"] is True and missing["count"] == 3
            assert SearchResults.from_json(missing).no_match is True
            assert SearchResults.from_json(matching).no_match is False
            batch = client.post("/search/batch", json={"k": 3, "queries": [{"text": MATCHING}, {"text": absent[0]}]})
            assert [a["no_match"] for a in batch.json()["results"]] == [False, True], batch.text
            image = client.post("/search", json={"embedding": [0.1] * 32, "k": 3}).json()
            assert "no_match" not in image and SearchResults.from_json(image).no_match is None
            stats = client.get("/stats").json()
            described = json.dumps(stats)
            assert '"text_no_match"' in described and str(info_of(index_copy)[TEXT_NO_MATCH]["floor"]) in described
        tab = SearchTab(service, ExampleSet(service, tmp_path, count=0), UploadRecords(gr.Blocks()))
        items, status, _ = tab.search(None, 4, text=absent[0])  # the app: nothing matches, the nearest shown
        assert len(items) == 4 and "Nothing here matches this description well" in status
        items, status, _ = tab.search(None, 4, text=MATCHING)
        assert len(items) == 4 and "Nothing here matches" not in status
    finally:
        service.close()


def test_a_keyword_hit_is_a_match_whatever_its_score():
    floor = NoMatchFloor(0.5)
    low = [SearchResult(1, "a.png", None, 0.2), SearchResult(2, "b.png", None, 0.1)]
    assert floor.verdict(low) is True and floor.verdict([]) is True
    assert floor.verdict([SearchResult(1, "a.png", None, 0.6)]) is False
    for source in ("keyword", "both"):
        hits = [{"score": 0.2, "source": "vector"}, {"score": 0.05, "source": source}]
        assert floor.verdict(hits) is False, source
    assert floor.verdict([{"score": 0.9, "source": "keyword"}, {"score": 0.2, "source": "vector"}]) is False
    assert NoMatchFloor(problem="not calibrated").verdict(low) is None


def test_a_floor_calibrated_for_another_text_model_is_ignored(index_copy, built):
    other = TextEmbedder(built["other"]).model_hash
    searched = run("search", "--index", index_copy, "--text-model", built["other"], "--text", "a laptop", "--json")
    assert searched.exit_code == 0, searched.output
    assert "no_match" not in json.loads(searched.stdout)[0]
    assert "calibrated for another text model" in searched.stderr and other in searched.stderr
    floor = read_floor(IndexInfo.from_json(info_of(index_copy)), other)
    assert floor.floor is None and floor.verdict([SearchResult(1, "a.png", None, -1.0)]) is None
    assert "retrieval index text" in floor.problem

    recorded = run("index", "text", index_copy, "--text-model", built["other"])  # recording it calibrates it
    floor = info_of(index_copy)[TEXT_NO_MATCH]
    assert recorded.exit_code == 0 and floor["text_model_hash"] == other, recorded.output
    assert f"a text query whose best score is under {floor['floor']:.3f} says \"no good match\"" in recorded.stdout
    again = run("search", "--index", index_copy, "--text", "a laptop", "--json")
    assert isinstance(json.loads(again.stdout)[0]["no_match"], bool)


def test_an_index_without_a_calibration_makes_no_claim_and_stats_say_why(index_copy):
    info = info_of(index_copy)
    del info[TEXT_NO_MATCH]
    (index_copy / "index.json").write_text(json.dumps(info))
    searched = run("search", "--index", index_copy, "--text", "a laptop", "--json")
    assert searched.exit_code == 0 and "no_match" not in json.loads(searched.stdout)[0]
    assert "not calibrated" in searched.stderr
    stats = run("index", "stats", index_copy, "--queries", "5", "--json")
    assert json.loads(stats.stdout)["text_no_match"]["calibrated"] is False


@pytest.mark.parametrize("floor", [float("nan"), "0.3", 1e300, float("inf"), True, None, [0.3], {"x": 1}])
def test_hostile_floor_values_are_refused_with_a_clear_message(index_copy, floor):
    info = info_of(index_copy)
    info[TEXT_NO_MATCH]["floor"] = floor
    (index_copy / "index.json").write_text(json.dumps(info))  # NaN and Infinity as Python's json writes them
    searched = run("search", "--index", index_copy, "--text", MATCHING, "--json")
    assert searched.exit_code == 0, searched.output
    assert "no_match" not in json.loads(searched.stdout)[0]
    assert "text_no_match floor is" in searched.stderr and "not a cosine score in [-1, 1]" in searched.stderr
    assert f"retrieval index text {index_copy}" in searched.stderr  # the fix
    stats = json.loads(run("index", "stats", index_copy, "--queries", "5", "--json").stdout)["text_no_match"]
    assert stats["calibrated"] is False and "floor is" in stats["problem"]


@pytest.mark.parametrize("record", ["0.3", [0.3], 7, "x" * 10_000])
def test_a_record_that_is_no_calibration_is_refused(record):
    floor = read_floor(IndexInfo.from_json({TEXT_NO_MATCH: record, "model_hash": "m"}), "t")
    assert floor.floor is None and "not the record of a calibration" in floor.problem and len(floor.problem) < 400


def test_a_recorded_calibration_is_described_without_its_hostile_extras():
    info = {"model_hash": "m", TEXT_NO_MATCH: {"floor": 0.42, "text_model_hash": "t", "model_hash": "m",
                                               "quantile": 0.9, "texts": 300, "source": "x" * 100_000,
                                               "best_scores": {"min": float("nan")}, "images": [1] * 10}}
    described = read_floor(IndexInfo.from_json(info), "t").describe()
    assert described["calibrated"] is True and described["floor"] == 0.42 and described["quantile"] == 0.9
    assert "source" not in described and "best_scores" not in described and "images" not in described
    moved = read_floor(IndexInfo.from_json(info).with_fields({"model_hash": "upgraded"}), "t")
    assert moved.floor is None and "another image model" in moved.problem
