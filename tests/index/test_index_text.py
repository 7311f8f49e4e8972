"""Searching an image index by text: `retrieval index text` records the text model in index.json (under the writer
lock, refusing a tower trained for another image model, naming both), `retrieval search --text` embeds the queries
with it (or --text-model) and searches them as embeddings are searched, the text model is found again after the
folders move, and an upgrade to a model declared compatible keeps it. Real index folders, real ONNX files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import QUICK
from sample_images import noisy_png
from text_towers import own_and_foreign_towers, small_text_model

from retrieval.cli.main import main
from retrieval.index import Index, IndexLockedError, build_index, load_model
from retrieval.index.layout import IndexLayout
from retrieval.index.writing.upgrade import upgrade_index
from retrieval.records.index_info import IndexInfo
from retrieval.text.text_index import NoTextModelError, checked_text_model, record_text_model
from retrieval.text.text_onnx import TextEmbedder, TextModelError, check_text_model

pytestmark = pytest.mark.timeout(300)


def run(*args: str):
    """`retrieval ARGS` through CliRunner."""
    return CliRunner().invoke(main, [str(arg) for arg in args])


@pytest.fixture(scope="module")
def towers(artifacts, tmp_path_factory) -> dict[str, Path]:
    """A text tower trained (as recorded) for the shared index's image model, and one for another model."""
    root = tmp_path_factory.mktemp("towers")
    return own_and_foreign_towers(artifacts.index_dir, root, "0123456789abcdef")


@pytest.fixture
def index_copy(artifacts, tmp_path) -> Path:
    """A test's own copy of the shared index folder (its gallery and model stay where they are)."""
    return Path(shutil.copytree(artifacts.index_dir, tmp_path / "index"))


def info_of(index_dir: Path) -> dict:
    return json.loads((index_dir / "index.json").read_text())


def test_index_text_records_the_model_and_search_text_embeds_with_it(index_copy, towers, artifacts):
    recorded = run("index", "text", index_copy, "--text-model", towers["own"], "--json")
    assert recorded.exit_code == 0, recorded.output
    text = TextEmbedder(towers["own"])
    info = info_of(index_copy)
    assert info["text_model_hash"] == text.model_hash == json.loads(recorded.stdout)["text_model_hash"]
    assert info["text_model_path"] == str(towers["own"].resolve())
    assert (index_copy / info["text_model_path_relative"]).resolve() == towers["own"].resolve()
    assert info["model_hash"] == text.image_model_hash  # the image record is untouched

    searched = run("search", "--index", index_copy, "--text", "a red apple", "--text", "a dog", "-k", "5", "--json")
    assert searched.exit_code == 0, searched.output
    answers = json.loads(searched.stdout)
    assert [answer["query"] for answer in answers] == ["a red apple", "a dog"]
    with Index.open(index_copy) as index:  # the same search as an embedding query: Index.search
        expected = index.search(text.embed(["a red apple", "a dog"]), 5)
    for answer, results in zip(answers, expected, strict=True):
        assert [r["id"] for r in answer["results"]] == [r.id for r in results]
        assert np.allclose([r["score"] for r in answer["results"]], [r.score for r in results], atol=1e-5)
        assert all(Path(r["file"]).is_file() for r in answer["results"])

    plain = run("search", "--index", index_copy, "--text", "a red apple", "-k", "3")
    lines = [line for line in plain.output.splitlines() if "no good match" not in line]  # a random tower's may say
    assert plain.exit_code == 0 and lines[0] == '"a red apple"', plain.output
    assert lines[1].startswith("    1  ")


def test_filters_and_reranking_apply_to_a_text_query(index_copy, towers, artifacts):
    assert run("index", "text", index_copy, "--text-model", towers["own"]).exit_code == 0
    label = artifacts.labels[4]
    filtered = run("search", "--index", index_copy, "--text", "a smiling face", "-k", "5", "--json",
                   "--where", f'label = "{label}"')
    assert filtered.exit_code == 0, filtered.output
    (answer,) = json.loads(filtered.stdout)
    assert answer["results"] and {r["label"] for r in answer["results"]} == {label}
    reranked = run("search", "--index", index_copy, "--text", "a smiling face", "-k", "4", "--json",
                   "--rerank", "qe")
    assert reranked.exit_code == 0, reranked.output
    (answer,) = json.loads(reranked.stdout)
    assert len(answer["results"]) == 4 and all("rerank_score" in r for r in answer["results"])


def test_search_by_text_without_a_text_model_says_how_to_give_one(artifacts, towers):
    refused = run("search", "--index", artifacts.index_dir, "--text", "a red apple")
    assert refused.exit_code == 1
    assert "records no text model" in refused.output and "--text-model" in refused.output
    assert f"retrieval index text {artifacts.index_dir}" in refused.output and "Traceback" not in refused.output
    given = run("search", "--index", artifacts.index_dir, "--text", "a red apple", "--text-model", towers["own"],
                "-k", "2", "--json")
    assert given.exit_code == 0, given.output
    assert len(json.loads(given.stdout)[0]["results"]) == 2
    assert "text_model_hash" not in info_of(artifacts.index_dir)  # --text-model records nothing


def test_a_tower_for_another_image_model_is_refused_naming_both_models(index_copy, towers):
    index_hash = info_of(index_copy)["model_hash"]
    before = (index_copy / "index.json").read_bytes()
    for args in (["index", "text", index_copy, "--text-model", towers["foreign"]],
                 ["search", "--index", index_copy, "--text", "a red apple", "--text-model", towers["foreign"]]):
        refused = run(*args)
        assert refused.exit_code == 1, refused.output
        assert "0123456789abcdef" in refused.output and index_hash in refused.output, refused.output
        assert "--text-model" in refused.output and "retrieval text train" in refused.output
    assert (index_copy / "index.json").read_bytes() == before


@pytest.mark.parametrize(("args", "message"), [
    (["--text", "   "], "text is empty"),
    (["--text", "x" * 1001], "at most 1000"),
    (["--text", "a dog", "IMAGE"], "not both"),
    (["--text", "a dog", "--exclude-self"], "--exclude-self"),
    (["IMAGE", "--text-model", "TOWER"], "--text-model embeds --text descriptions"),
    ([], "give a query IMAGE"),
    (["--text", "a", "--text", "b", "--max-queries", "1"], "--max-queries 1"),
])
def test_a_text_search_is_checked_before_any_model_loads(artifacts, towers, args, message):
    args = [str(artifacts.query_paths[0]) if arg == "IMAGE" else str(towers["own"]) if arg == "TOWER" else arg
            for arg in args]
    refused = run("search", "--index", artifacts.index_dir, *args)
    assert refused.exit_code == 2 and message in refused.output, refused.output


def test_recording_waits_for_no_writer(index_copy, towers):
    with IndexLayout(index_copy).write_lock("add images to"):
        with pytest.raises(IndexLockedError, match="cannot record a text model in"):
            record_text_model(index_copy, towers["own"])
    assert "text_model_hash" not in info_of(index_copy)
    assert record_text_model(index_copy, towers["own"])["text_model_hash"] == TextEmbedder(towers["own"]).model_hash


def test_the_text_model_is_found_after_the_folders_move_and_only_by_its_hash(artifacts, towers, tmp_path):
    place = tmp_path / "before"
    shutil.copytree(artifacts.index_dir, place / "index")
    shutil.copy(towers["own"], place / "text.onnx")
    assert run("index", "text", place / "index", "--text-model", place / "text.onnx").exit_code == 0
    assert info_of(place / "index")["text_model_path_relative"] == "../text.onnx"
    moved = tmp_path / "after"
    place.rename(moved)  # the recorded absolute path is gone; the path from the index folder still holds
    found = run("search", "--index", moved / "index", "--text", "a red apple", "-k", "2", "--json")
    assert found.exit_code == 0, found.output

    shutil.copy(towers["foreign"], moved / "text.onnx")  # another file in its place: never loaded
    refused = run("search", "--index", moved / "index", "--text", "a red apple")
    assert refused.exit_code == 1
    recorded = info_of(moved / "index")["text_model_hash"]
    assert f"text_model_hash {recorded}" in refused.output and "no file has that hash" in refused.output
    assert f"retrieval index text {moved / 'index'}" in refused.output


def test_an_index_built_from_embeddings_has_no_image_model_to_check_a_tower_against(towers, tmp_path):
    text = TextEmbedder(towers["own"])
    with pytest.raises(TextModelError, match="built from embeddings"):
        checked_text_model(text, IndexInfo.from_json({"source": "embeddings", "model_hash": None, "embedding_dim": 32}),
                           tmp_path)
    with pytest.raises(NoTextModelError, match="records no text model"):
        from retrieval.text.text_index import open_text_model

        open_text_model(IndexInfo.from_json({"model_hash": "x", "embedding_dim": 32}), tmp_path)


@pytest.fixture(scope="module")
def upgrade_models(tmp_path_factory) -> dict[str, Path]:
    """An old projection model, a new one declared compatible with it, one of another size; a tower for the old."""
    root = tmp_path_factory.mktemp("text_upgrade_models")
    old = write_projection_onnx(root / "old.onnx", dim=24, seed=0)
    old_hash = load_model(old).model_hash
    return {"old": old, "new": write_projection_onnx(root / "new.onnx", dim=24, seed=0, drift=0.3,
                                                     compatible_with=(old_hash,)),
            "other": write_projection_onnx(root / "other.onnx", dim=16, seed=7),
            "tower": small_text_model(root / "text.onnx", old_hash, 24)}


def test_an_upgrade_to_a_compatible_model_keeps_the_text_model(upgrade_models, tmp_path):
    from retrieval.serve.service import SearchService
    from retrieval.serve.service.text import TextQuery

    for label, colour in enumerate([(200, 40, 40), (40, 200, 40), (40, 40, 200)]):
        (tmp_path / "g" / f"class{label}").mkdir(parents=True)
        for n in range(6):
            (tmp_path / "g" / f"class{label}" / f"img_{n}.png").write_bytes(noisy_png(colour, 100 * label + n))
    index_dir = tmp_path / "idx"
    build_index(tmp_path / "g", index_dir, model=upgrade_models["old"], options=QUICK)
    assert run("index", "text", index_dir, "--text-model", upgrade_models["tower"]).exit_code == 0

    upgrade_index(index_dir, upgrade_models["new"], commit_every=8, options=QUICK)
    info = info_of(index_dir)
    text = TextEmbedder(upgrade_models["tower"])
    assert info["model_hash"] == load_model(upgrade_models["new"]).model_hash != text.image_model_hash
    assert info["text_model_hash"] == text.model_hash  # the upgrade kept the record
    with pytest.raises(TextModelError):  # not the index's own model: only its declaration lets the tower in
        check_text_model(text, IndexInfo.from_json(info))
    searched = run("search", "--index", index_dir, "--text", "a red apple", "-k", "3", "--json")
    assert searched.exit_code == 0, searched.output
    assert len(json.loads(searched.stdout)[0]["results"]) == 3
    assert run("index", "text", index_dir, "--text-model", upgrade_models["tower"]).exit_code == 0
    service = SearchService(index_dir, reload_interval_s=None)  # the server reads the declaration too
    try:
        assert service.text_search() and len(service.search(TextQuery("a red apple"), 3).results) == 3
    finally:
        service.close()

    # a swap into another space and size turns the text model off, naming what re-fits one
    upgrade_index(index_dir, upgrade_models["other"], options=QUICK)
    refused = run("search", "--index", index_dir, "--text", "a red apple")
    assert refused.exit_code == 1 and "turned text search off" in refused.output
    assert "retrieval text train --model" in refused.output
