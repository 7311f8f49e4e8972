"""A text tower runs in the image model's onnxruntime session (a device string names a device, never its letters)
and is identified as an image model is: its hash covers its graph, weights and tokenizer, not node names, doc
strings, the exporter's stack traces or metadata. A record written before names a tower by the sha256 of its file's
bytes: an index, its no-match floor, an image model's metadata and an adapted tower's file name written so still find
and serve it. Real ONNX towers (a small BERT), a real index folder, the real CLI."""

from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from hostile_text_models import with_metadata
from serve_fixtures import export_model, write_gallery
from text_towers import small_text_model

from retrieval.cli.main import main
from retrieval.index import IngestOptions, build_index
from retrieval.index.query_embedder import load_model
from retrieval.records.index_info import IndexInfo
from retrieval.serve.service.text import state_text
from retrieval.text.no_match import TEXT_NO_MATCH, read_floor
from retrieval.text.sibling_text import named_text_model, record_named_text_model
from retrieval.text.text_index import open_text_model, record_text_model
from retrieval.text.text_onnx import TextEmbedder, TextModelError, file_hashes, read_tower

pytestmark = pytest.mark.timeout(300)
HASH = "0123456789abcdef"
QUERIES = ["a red apple", "a smiling face", "a blue star"]


def bytes_hash(path: Path) -> str:
    """What versions before recorded for a text tower: its file's sha256, 16 hex digits, written out here."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def tower(tmp_path_factory) -> Path:
    return small_text_model(tmp_path_factory.mktemp("tower") / "text.onnx", HASH, 16)


def annotated(source: Path, target: Path) -> Path:
    """``source`` with every annotation changed: node names, doc strings and metadata_props (stack traces as an
    exporter writes them), the graph's name, producer, and a model metadata entry beyond the text record."""
    proto = onnx.load(str(source))
    for n, node in enumerate(proto.graph.node):
        node.name = f"renamed_{n}"
        node.doc_string = f"File \"/home/someone/model.py\", line {n}, in forward"
        entry = node.metadata_props.add()
        entry.key, entry.value = "pkg.torch.onnx.stack_trace", f"/elsewhere/tower.py:{n}"
    proto.graph.name, proto.graph.doc_string = "another_name", "a graph's doc string"
    proto.doc_string, proto.producer_name, proto.producer_version = "a model's doc string", "someone", "9.9"
    for value in (*proto.graph.input, *proto.graph.output):
        value.doc_string = "an input's doc string"
    entry = proto.metadata_props.add()
    entry.key, entry.value = "text_origin", "copied by hand"
    onnx.save_model(proto, str(target))
    return target


def with_weight_changed(source: Path, target: Path) -> Path:
    """``source`` with one value of its largest weight nudged."""
    proto = onnx.load(str(source))
    tensor = max(proto.graph.initializer, key=lambda t: len(t.raw_data))
    values = onnx.numpy_helper.to_array(tensor).copy()
    values.flat[0] += 1e-3
    tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save_model(proto, str(target))
    return target


@pytest.mark.parametrize("device", ["cpu", "CPU", "auto"])
def test_a_device_string_names_a_device_not_its_letters(tower, device):
    with warnings.catch_warnings(record=True) as caught:  # onnxruntime warns of each provider name it does not know
        warnings.simplefilter("always")
        embedder = TextEmbedder(tower, providers=device)
    assert not [w for w in caught if "provider" in str(w.message).lower()]
    assert embedder.session.get_providers()[-1] == "CPUExecutionProvider"
    assert embedder.embed(QUERIES).shape == (3, 16)


def test_cuda_asked_for_where_there_is_none_is_refused_not_run_on_the_cpu(tower):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this machine has CUDA")
    with pytest.raises(TextModelError, match="no CUDAExecutionProvider"):
        TextEmbedder(tower, providers="cuda")


def test_a_provider_that_is_not_here_is_refused_naming_those_that_are(tower):
    with pytest.raises(TextModelError, match="not available here"):
        TextEmbedder(tower, providers=["NoSuchExecutionProvider"])


def test_the_text_hash_ignores_names_doc_strings_and_metadata(tower, tmp_path):
    original = TextEmbedder(tower)
    changed = TextEmbedder(annotated(tower, tmp_path / "annotated.onnx"))
    assert changed.model_hash == original.model_hash
    assert bytes_hash(changed.path) != bytes_hash(tower)  # the bytes differ: the file-bytes hash would change
    assert np.allclose(changed.embed(QUERIES), original.embed(QUERIES), atol=1e-6)


def test_the_text_hash_changes_with_a_weight_and_with_what_prepares_a_text(tower, tmp_path):
    original = TextEmbedder(tower).model_hash
    assert TextEmbedder(with_weight_changed(tower, tmp_path / "weight.onnx")).model_hash != original
    shorter = TextEmbedder(with_metadata(tower, tmp_path / "short.onnx", max_length="16"))
    assert shorter.model_hash != original  # texts are cut at 16 tokens, not 32


def test_a_tower_goes_by_its_hash_and_by_the_legacy_file_bytes_hash(tower):
    embedder = TextEmbedder(tower)
    assert embedder.model_hashes == (embedder.model_hash, bytes_hash(tower)) == file_hashes(tower)
    assert embedder.model_hash != bytes_hash(tower)


def test_bytes_that_are_no_text_tower_go_by_their_file_hash_alone(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x08\x07not a model")
    assert file_hashes(junk) == (bytes_hash(junk),)


def test_an_image_model_naming_its_tower_by_the_legacy_hash_finds_it(tower, tmp_path):
    shutil.copy(tower, tmp_path / "model.text.onnx")
    beside = tmp_path / "model.text.onnx"
    for named in (bytes_hash(beside), TextEmbedder(beside).model_hash):
        found, problem = named_text_model(tmp_path / "model.onnx", {"text_model": beside.name,
                                                                    "text_model_hash": named})
        assert found.path == beside and problem is None and named in found.hashes
    found, problem = named_text_model(tmp_path / "model.onnx", {"text_model": beside.name, "text_model_hash": HASH})
    assert found is None and f"not {HASH}" in problem


def test_the_bytes_a_tower_was_hashed_from_are_the_bytes_run_when_the_file_is_replaced_after(tower, tmp_path):
    place = Path(shutil.copy(tower, tmp_path / "text.onnx"))
    found = read_tower(place)
    with_weight_changed(tower, place)  # replaced between finding it by its hash and loading it
    loaded, replaced = TextEmbedder(found), TextEmbedder(place)
    assert loaded.model_hashes == found.hashes == file_hashes(tower) != replaced.model_hashes
    assert np.allclose(loaded.embed(QUERIES), TextEmbedder(tower).embed(QUERIES), atol=1e-6)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A small real index with a text tower of its model recorded (new hashes), and a copy whose index.json names
    the tower (copied into the folder as an adapted tower was named) by its file-bytes hash, as written before."""
    root = tmp_path_factory.mktemp("legacy")
    gallery, _, _ = write_gallery(root / "data")
    model = export_model(root / "model.onnx")
    build_index(gallery, root / "index", model=model, options=IngestOptions(batch_size=16, workers=0, progress=False))
    model_hash = json.loads((root / "index" / "index.json").read_text())["model_hash"]
    text = small_text_model(root / "text.onnx", model_hash, 32, seed=1)
    legacy_index = Path(shutil.copytree(root / "index", root / "legacy"))
    record_text_model(root / "index", text)
    old_name = legacy_index / f"text.adapted.{bytes_hash(text)}.onnx"
    shutil.copy(text, old_name)
    record_text_model(legacy_index, old_name)
    info = json.loads((legacy_index / "index.json").read_text())
    info["text_model_hash"] = info[TEXT_NO_MATCH]["text_model_hash"] = bytes_hash(old_name)
    (legacy_index / "index.json").write_text(json.dumps(info))
    return {"index": root / "index", "legacy": legacy_index, "text": text, "model": model}


def info_of(index_dir: Path) -> dict:
    return json.loads((index_dir / "index.json").read_text())


def searched(index_dir: Path) -> list[dict]:
    texts = [a for q in QUERIES for a in ("--text", q)]
    result = CliRunner().invoke(main, ["search", "--index", str(index_dir), *texts, "-k", "4", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_an_index_recorded_with_the_legacy_hash_answers_text_queries_as_a_new_one_does(built):
    new, legacy = info_of(built["index"]), info_of(built["legacy"])
    assert new["text_model_hash"] == TextEmbedder(built["text"]).model_hash != legacy["text_model_hash"]
    answers, legacy_answers = searched(built["index"]), searched(built["legacy"])
    assert [[(r["id"], round(r["score"], 5)) for r in a["results"]] for a in legacy_answers] == \
        [[(r["id"], round(r["score"], 5)) for r in a["results"]] for a in answers]
    assert [a["no_match"] for a in legacy_answers] == [a["no_match"] for a in answers]  # the floor was read


def test_the_legacy_floor_and_tower_are_served(built):
    info = info_of(built["legacy"])
    record = IndexInfo.from_json(info)
    text = open_text_model(record, built["legacy"])
    floor = read_floor(record, text.model_hashes)
    assert floor.problem is None and floor.floor == info[TEXT_NO_MATCH]["floor"]
    assert read_floor(record, text.model_hash).problem.startswith("calibrated for another text model")
    image_model = load_model(built["model"])
    first = state_text(record, built["legacy"], image_model, None, None)
    assert first.problem is None and first.embedder.model_hashes[1] == info["text_model_hash"]
    assert state_text(record, built["legacy"], image_model, None, first).embedder is first.embedder  # kept on reload


def test_a_file_named_by_neither_hash_is_refused(built, tmp_path):
    copy = Path(shutil.copytree(built["legacy"], tmp_path / "index"))
    info = info_of(copy)
    recorded = copy / info["text_model_path_relative"]
    assert open_text_model(IndexInfo.from_json(info | {"text_model_path": str(recorded)}), copy).path == recorded
    annotated(built["text"], recorded)  # same hash, other bytes: no longer the file the legacy hash names
    with pytest.raises(TextModelError, match="no file has that hash"):
        open_text_model(IndexInfo.from_json(info | {"text_model_path": str(recorded)}), copy)


def test_the_tower_beside_the_image_model_is_compared_with_a_legacy_record_by_both_hashes(built, tmp_path):
    from retrieval.export.text_export import link_text_model

    model = Path(shutil.copy(built["model"], tmp_path / "model.onnx"))
    other = small_text_model(tmp_path / "model.text.onnx", load_model(model).model_hash, 32, seed=2)
    link_text_model(model, other)
    copy = Path(shutil.copytree(built["legacy"], tmp_path / "index"))
    before = info_of(copy)
    assert record_named_text_model(copy, model) is None and info_of(copy) == before  # another tower: kept
    shutil.copy(built["text"], other)  # the very tower the index records by its legacy hash
    link_text_model(model, other)
    recorded = record_named_text_model(copy, model)
    assert recorded is not None and info_of(copy)["text_model_hash"] == TextEmbedder(built["text"]).model_hash


@pytest.fixture()
def tower_reads(monkeypatch) -> dict[str, list]:
    """Each read of a file's whole bytes and each text tower's graph hashed, as they happen."""
    from retrieval.text import text_onnx

    seen: dict[str, list] = {"read": [], "hashed": []}
    read_bytes, proto_model_hash = Path.read_bytes, text_onnx.proto_model_hash
    monkeypatch.setattr(Path, "read_bytes", lambda self: seen["read"].append(self.name) or read_bytes(self))
    monkeypatch.setattr(text_onnx, "proto_model_hash",
                        lambda *args: seen["hashed"].append(1) or proto_model_hash(*args))
    return seen


def test_the_text_model_an_index_records_is_read_and_hashed_once_when_opened(built, tower_reads):
    info = info_of(built["index"])
    assert open_text_model(IndexInfo.from_json(info), built["index"]).model_hash == info["text_model_hash"]
    assert tower_reads["read"].count(Path(info["text_model_path"]).name) == 1 and tower_reads["hashed"] == [1]


def test_the_tower_beside_the_image_model_is_read_and_hashed_once_when_recorded(built, tmp_path, tower_reads):
    from retrieval.export.text_export import link_text_model

    model = Path(shutil.copy(built["model"], tmp_path / "model.onnx"))
    beside = Path(shutil.copy(built["text"], tmp_path / "model.text.onnx"))
    link_text_model(model, beside)
    copy = Path(shutil.copytree(built["index"], tmp_path / "index"))
    tower_reads["read"].clear(), tower_reads["hashed"].clear()
    recorded = record_named_text_model(copy, model)
    assert recorded is not None and recorded["text_model_hash"] == info_of(built["index"])["text_model_hash"]
    assert tower_reads["read"].count(beside.name) == 1 and tower_reads["hashed"] == [1]
