"""``retrieval index upgrade``: a gallery re-embedded by a new model while the index keeps answering; mixed for a
model declared compatible, swapped at the end for any other; kill-safe; the old vectors gone at the end."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from index_builds import PAUSE_ENV, PAUSED, QUICK, run_fake_cli
from sample_images import noisy_png

from retrieval.cli.main import main
from retrieval.index import Index, IndexLockedError, ModelMismatchError, add_images, build_index, load_model
from retrieval.index.catalogue import Catalogue
from retrieval.index.layout import IndexLayout
from retrieval.index.live import Snapshot
from retrieval.index.shards import ShardStore
from retrieval.index.writing.upgrade import upgrade_index


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """An old model, a new one declared compatible with it (a drifted copy), an unrelated one of another size, and
    two of another size declared compatible: one with a compatible output into the old 24-d space (as
    --compatible-with trains it), one without."""
    root = tmp_path_factory.mktemp("upgrade_models")
    old = write_projection_onnx(root / "old.onnx", dim=24, seed=0)
    old_hash = load_model(old).model_hash
    new = write_projection_onnx(root / "new.onnx", dim=24, seed=0, drift=0.3, compatible_with=(old_hash,))
    other = write_projection_onnx(root / "other.onnx", dim=16, seed=7)
    wider = write_projection_onnx(root / "wider.onnx", dim=32, seed=5, drift=0.3, compatible_with=(old_hash,),
                                  compatible=(24, 0))
    unprojected = write_projection_onnx(root / "unprojected.onnx", dim=32, seed=6, compatible_with=(old_hash,))
    return {"old": old, "new": new, "other": other, "wider": wider, "unprojected": unprojected}


COLOURS = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]  # one per class: classes cluster


@pytest.fixture
def gallery_index(tmp_path, models):
    for label, colour in enumerate(COLOURS):
        (tmp_path / "g" / f"class{label}").mkdir(parents=True)
        for n in range(8):
            (tmp_path / "g" / f"class{label}" / f"img_{n}.png").write_bytes(noisy_png(colour, 100 * label + n))
    build_index(tmp_path / "g", tmp_path / "idx", model=models["old"], options=QUICK)
    return tmp_path / "idx"


def kill_at(process) -> None:
    """Wait for the upgrade in ``process`` to reach its pause point, then kill it hard."""
    deadline = time.monotonic() + 120
    for line in process.stderr:
        if PAUSED in line or time.monotonic() > deadline:
            break
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL


def _vectors(index_dir) -> dict[int, np.ndarray]:
    """id -> the vector faiss holds for each indexed image."""
    with Index.open(index_dir) as index:
        ids = np.sort(np.asarray(index.catalogue.ids_with_status("done"), dtype=np.int64))
        return {int(i): index.faiss_index.reconstruct(int(i)) for i in ids}


def _fresh_vectors(tmp_path, model, gallery) -> dict[str, np.ndarray]:
    """path -> vector of a fresh build of ``gallery`` with ``model``, for comparison."""
    build_index(gallery, tmp_path / "fresh", model=model, options=QUICK)
    with Index.open(tmp_path / "fresh") as index:
        rows = index.catalogue.rows(index.catalogue.ids_with_status("done"))
        return {row["path"]: index.faiss_index.reconstruct(int(i)) for i, row in rows.items()}


def _by_path(index_dir) -> dict[str, np.ndarray]:
    vectors = _vectors(index_dir)
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        rows = catalogue.rows(list(vectors))
    return {rows[i]["path"]: v for i, v in vectors.items()}


def test_a_compatible_model_serves_at_once_and_replaces_the_vectors_batch_by_batch(gallery_index, models, tmp_path):
    steps = []

    def look(progress):  # after each publish: a reader opens a consistent state, answered by the new model
        with Snapshot.open(gallery_index, writer_free=False) as snapshot:
            assert snapshot.model_hash == load_model(models["new"]).model_hash and len(snapshot) == 32
            query = snapshot.faiss_index.reconstruct(int(snapshot.ids[0]))
            assert len(snapshot.search(query[None], 10)[0]) == 10
        steps.append(progress)

    summary = upgrade_index(gallery_index, models["new"], commit_every=8, options=QUICK, on_publish=look)
    assert summary["mode"] == "mixed" and summary["reembedded"] == 32 and summary["unreadable"] == 0
    assert [step["left"] for step in steps] == [24, 16, 8, 0, 0]
    info = json.loads((gallery_index / "index.json").read_text())
    new_hash, old_hash = load_model(models["new"]).model_hash, load_model(models["old"]).model_hash
    assert info["model_hash"] == new_hash and info["upgraded_from"] == [old_hash] and "upgrade" not in info
    upgraded, fresh = _by_path(gallery_index), _fresh_vectors(tmp_path, models["new"], tmp_path / "g")
    assert upgraded.keys() == fresh.keys()
    assert all(np.allclose(upgraded[p], fresh[p], atol=1e-6) for p in fresh)
    # the old vectors are gone: every shard left is one the catalogue reads from
    with Catalogue(gallery_index / "catalogue.sqlite") as catalogue:
        assert set(ShardStore(gallery_index / "shards").names()) == set(catalogue.done_shards().values())
        assert catalogue.get_meta("model_hash") == new_hash and catalogue.get_meta("upgrade_model_path") is None
    with pytest.raises(ModelMismatchError, match="upgrade the index to this one"):
        Index.open(gallery_index, embedder=load_model(models["old"]))


def test_a_model_not_declared_compatible_is_swapped_in_at_the_end_with_its_own_size(gallery_index, models, tmp_path):
    seen = []
    summary = upgrade_index(gallery_index, models["other"], options=QUICK, on_publish=seen.append)
    assert summary["mode"] == "swap" and seen == [{"published": 32, "total": 32, "left": 0}]
    with Index.open(gallery_index) as index:
        assert index.dim == 16 and index.model_hash == load_model(models["other"]).model_hash
    upgraded, fresh = _by_path(gallery_index), _fresh_vectors(tmp_path, models["other"], tmp_path / "g")
    assert all(np.allclose(upgraded[p], fresh[p], atol=1e-6) for p in fresh)


def test_a_declared_compatible_model_searches_the_old_index_and_another_is_refused_with_the_upgrade(
        gallery_index, models):
    from retrieval.serve.service import SearchService

    with Index.open(gallery_index, embedder=load_model(models["new"])) as index:
        assert len(index.search_images([next((gallery_index.parent / "g").rglob("*.png"))], k=3)[0]) == 3
    service = SearchService(gallery_index, embedder=load_model(models["new"]), reload_interval_s=None)
    try:  # a server given the compatible model embeds its queries with it
        query = (gallery_index.parent / "g" / "class2" / "img_1.png").read_bytes()
        assert len(service.search(query, k=5).results) == 5
        assert service.current().embedder.model_hash == load_model(models["new"]).model_hash
    finally:
        service.close()
    refused = CliRunner().invoke(main, ["search", "--index", str(gallery_index), "--model", str(models["other"]),
                                        str(next((gallery_index.parent / "g").rglob("*.png")))])
    assert refused.exit_code == 1
    assert f"retrieval index upgrade {gallery_index} --model {models['other']}" in refused.output


def test_the_uncertain_order_re_embeds_images_whose_neighbours_disagree_first(gallery_index, models, tmp_path):
    """An image filed under class3 that looks like class0 (its neighbours disagree with its label) goes first."""
    (tmp_path / "odd" / "class3").mkdir(parents=True)
    stray = tmp_path / "odd" / "class3" / "stray.png"
    stray.write_bytes(noisy_png(COLOURS[0], 999))
    add_images(gallery_index, tmp_path / "odd", options=QUICK)
    upgrade_index(gallery_index, models["new"], order="uncertain", commit_every=1, options=QUICK)
    with Catalogue(gallery_index / "catalogue.sqlite") as catalogue:
        stray_id = catalogue.ids_for_paths([str(stray.resolve())])[str(stray.resolve())]
        shards = catalogue.done_shards()
    assert shards[stray_id] == min(shards.values())  # the first shard the upgrade wrote holds it


def test_other_writers_wait_for_an_unfinished_upgrade_and_a_rerun_finishes_it_after_kill_9(gallery_index, models):
    args = ["upgrade", str(gallery_index), "--model", str(models["new"]), "--commit-every", "8", "--shard-size", "4",
            "--workers", "1"]
    kill_at(run_fake_cli(args, {PAUSE_ENV: "after_commit:4"}))  # the second publish (4 images a shard)
    with Snapshot.open(gallery_index) as snapshot:  # mid-upgrade: consistent, complete, the new model's queries
        assert len(snapshot) == 32 and snapshot.model_hash == load_model(models["new"]).model_hash
    with pytest.raises(IndexLockedError, match="is being upgraded to the model .*retrieval index upgrade"):
        add_images(gallery_index, gallery_index.parent / "g", options=QUICK)
    resumed = CliRunner().invoke(main, ["index", "upgrade", str(gallery_index), "--json"])  # no --model: resumes
    assert resumed.exit_code == 0, resumed.output
    summary = json.loads(resumed.stdout)
    assert summary["mode"] == "mixed" and summary["to_reembed"] == 16 and summary["reembedded"] == 16
    info = json.loads((gallery_index / "index.json").read_text())
    assert info["model_hash"] == load_model(models["new"]).model_hash and "upgrade" not in info
    with Catalogue(gallery_index / "catalogue.sqlite") as catalogue:
        assert set(ShardStore(gallery_index / "shards").names()) == set(catalogue.done_shards().values())
        assert catalogue.counts()["done"] == 32


def test_a_server_answers_every_query_in_full_while_the_gallery_is_upgraded(gallery_index, models):
    from retrieval.serve.service import SearchService

    query = (gallery_index.parent / "g" / "class0" / "img_0.png").read_bytes()
    service = SearchService(gallery_index, reload_interval_s=0.02)
    answers, failures, stop = [], [], threading.Event()

    def ask():
        while not stop.is_set():
            try:
                answers.append((len(service.search(query, k=10).results), service.current().index.model_hash))
            except Exception as exc:  # noqa: BLE001  (every failure is what the test counts)
                failures.append(repr(exc))

    asker = threading.Thread(target=ask)
    asker.start()
    try:
        process = run_fake_cli(["upgrade", str(gallery_index), "--model", str(models["new"]), "--commit-every", "4",
                                "--shard-size", "4", "--workers", "1"])
        assert process.wait(timeout=300) == 0, process.stderr.read()
        time.sleep(0.3)  # the last state swapped in
    finally:
        stop.set()
        asker.join(timeout=30)
        service.close()
    assert not failures and answers and all(count == 10 for count, _ in answers)
    assert answers[-1][1] == load_model(models["new"]).model_hash


def test_an_upgrade_to_the_index_own_model_does_nothing(gallery_index, models):
    summary = upgrade_index(gallery_index, models["old"], options=QUICK)
    assert summary["mode"] == "none" and summary["reembedded"] == 0
    assert IndexLayout(gallery_index).read_info()["model_hash"] == load_model(models["old"]).model_hash


def test_an_image_unreadable_at_upgrade_time_leaves_the_index_with_its_reason(gallery_index, models):
    gone = gallery_index.parent / "g" / "class1" / "img_3.png"
    gone.write_bytes(b"not a png any more")
    summary = upgrade_index(gallery_index, models["new"], commit_every=8, options=QUICK)
    assert summary["unreadable"] == 1 and summary["reembedded"] == 31
    with Index.open(gallery_index) as index:
        assert len(index) == 31
        errors = {row["path"]: row["error"] for row in index.catalogue.error_examples(5)}
    assert errors[str(gone.resolve())].startswith("unreadable when re-embedded: ")


def test_uncertainty_order_puts_disagreeing_labels_first_then_isolated_embeddings():
    from retrieval.index.writing.upgrade import uncertainty_order

    ids = np.array([1, 2, 3, 4])
    found = np.array([[1, 2, 3], [2, 1, 3], [3, 4, 1], [4, 3, -1]])  # each row: itself, then its neighbours
    scores = np.array([[1, .9, .8], [1, .9, .7], [1, .2, .1], [1, .2, 0]])
    labels = {1: "a", 2: "a", 3: "b", 4: "a"}
    # 3 and 4 agree with none of their neighbours, 3 lies farther from them; 1 and 2 agree half, 2 lies farther
    assert uncertainty_order(ids, scores, found, labels).tolist() == [3, 4, 2, 1]
    unlabelled = {i: None for i in ids.tolist()}
    assert uncertainty_order(ids, scores, found, unlabelled).tolist() == [3, 4, 2, 1]  # by mean similarity


def test_a_swap_upgrade_killed_midway_leaves_the_old_index_serving_and_resumes(gallery_index, models):
    args = ["upgrade", str(gallery_index), "--model", str(models["other"]), "--shard-size", "4", "--workers", "1"]
    kill_at(run_fake_cli(args, {PAUSE_ENV: "after_shard_write:3"}))  # 12 of 32 re-embedded, nothing published
    with Snapshot.open(gallery_index) as snapshot:  # untouched: the old model, its 24-d vectors, all 32 images
        assert snapshot.model_hash == load_model(models["old"]).model_hash and snapshot.dim == 24
        assert len(snapshot) == 32
    resumed = upgrade_index(gallery_index, options=QUICK)  # no model: the one under way
    assert resumed["mode"] == "swap" and resumed["to_reembed"] == 32 and resumed["reembedded"] == 20
    with Index.open(gallery_index) as index:
        assert index.model_hash == load_model(models["other"]).model_hash and index.dim == 16 and len(index) == 32


def test_a_swap_killed_inside_its_last_publish_still_answers_with_the_old_model_and_resumes(gallery_index, models):
    args = ["upgrade", str(gallery_index), "--model", str(models["other"]), "--shard-size", "4", "--workers", "1"]
    kill_at(run_fake_cli(args, {PAUSE_ENV: "after_commit:8"}))  # the catalogue points at the new vectors, faiss not
    with Snapshot.open(gallery_index) as snapshot:  # faiss and index.json still agree: the old model answers
        assert snapshot.model_hash == load_model(models["old"]).model_hash and len(snapshot) == 32
    resumed = upgrade_index(gallery_index, options=QUICK)
    assert resumed["mode"] == "swap" and resumed["reembedded"] == 0 and resumed["published"] == 0
    with Index.open(gallery_index) as index:
        assert index.model_hash == load_model(models["other"]).model_hash and index.dim == 16 and len(index) == 32


# --- a new embedding size, declared compatible: through its compatible output ---------------------------------------
def _embedded_by(embedder, index_dir) -> dict[str, np.ndarray]:
    """path -> ``embedder``'s vector of every indexed image (what a fresh embedding with it gives)."""
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        paths = [row["path"] for row in catalogue.rows(catalogue.ids_with_status("done")).values()]
    return dict(zip(paths, embedder.embed(paths), strict=True))


def test_a_new_size_declared_compatible_searches_serves_and_upgrades_through_its_compatible_output(
        gallery_index, models):
    from retrieval.serve.service import SearchService

    wider = load_model(models["wider"])
    projected = wider.with_output("compatible_embedding")
    assert wider.embedding_dim == 32 and projected.embedding_dim == 24 and projected.model_hash == wider.model_hash
    query = gallery_index.parent / "g" / "class2" / "img_1.png"
    with Index.open(gallery_index, embedder=wider) as index:  # before the upgrade: queries in the old 24-d space
        assert index.embedder.output_name == "compatible_embedding" and index.embedder.embedding_dim == 24
        assert index.search_images([query], k=1)[0][0].path == str(query.resolve())
    service = SearchService(gallery_index, embedder=wider, reload_interval_s=None)
    try:
        assert len(service.search(query.read_bytes(), k=5).results) == 5
        assert service.current().embedder.output_name == "compatible_embedding"
    finally:
        service.close()
    searched = CliRunner().invoke(main, ["search", "--index", str(gallery_index), "--model", str(models["wider"]),
                                         "--json", str(query)])
    assert searched.exit_code == 0, searched.output

    summary = upgrade_index(gallery_index, models["wider"], commit_every=8, options=QUICK)
    assert summary["mode"] == "mixed" and summary["model_output"] == "compatible_embedding"
    info = json.loads((gallery_index / "index.json").read_text())
    old_hash = load_model(models["old"]).model_hash
    assert (info["model_hash"], info["embedding_dim"], info["model_output"], info["model_output_space"]) == (
        wider.model_hash, 24, "compatible_embedding", [old_hash])
    expected = _embedded_by(projected, gallery_index)
    assert all(np.allclose(vector, expected[path], atol=1e-6) for path, vector in _by_path(gallery_index).items())
    with Index.open(gallery_index) as index:  # the model index.json names keeps its output
        assert index.embedder.output_name == "compatible_embedding"
        assert index.search_images([query], k=1)[0][0].path == str(query.resolve())
    (gallery_index.parent / "more" / "class0").mkdir(parents=True)
    added = gallery_index.parent / "more" / "class0" / "late.png"
    added.write_bytes(noisy_png(COLOURS[0], 777))
    add_images(gallery_index, gallery_index.parent / "more", options=QUICK)  # the same output embeds new images
    assert np.allclose(_by_path(gallery_index)[str(added.resolve())], projected.embed([added])[0], atol=1e-6)

    # the model's own space: a swap, faiss rebuilt in its size, the output fields follow
    native = upgrade_index(gallery_index, models["wider"], native=True, options=QUICK)
    assert native["mode"] == "swap" and native["embedding_dim"] == 32 and native["reembedded"] == 33
    info = json.loads((gallery_index / "index.json").read_text())
    assert (info["embedding_dim"], info["model_output"]) == (32, "embeddings") and "model_output_space" not in info
    with Catalogue(gallery_index / "catalogue.sqlite") as catalogue:
        assert catalogue.get_meta("model_output") == "embeddings" and catalogue.get_meta("model_output_space") is None
    with Index.open(gallery_index) as index:
        assert index.embedder.output_name == "embeddings" and index.dim == 32
        assert index.search_images([query], k=1)[0][0].path == str(query.resolve())


def test_a_mixed_upgrade_through_the_compatible_output_resumes_with_it_after_kill_9(gallery_index, models):
    args = ["upgrade", str(gallery_index), "--model", str(models["wider"]), "--commit-every", "8", "--shard-size", "4",
            "--workers", "1"]
    kill_at(run_fake_cli(args, {PAUSE_ENV: "after_commit:4"}))
    with Snapshot.open(gallery_index) as snapshot:  # mid-upgrade: the new model's compatible output answers
        assert snapshot.embedder.output_name == "compatible_embedding" and snapshot.dim == 24 and len(snapshot) == 32
    refused = CliRunner().invoke(main, ["index", "upgrade", str(gallery_index), "--native"])
    assert refused.exit_code != 0 and "without --native" in refused.output
    resumed = upgrade_index(gallery_index, options=QUICK)  # no model: the one under way, with its output
    assert resumed["mode"] == "mixed" and resumed["model_output"] == "compatible_embedding"
    expected = _embedded_by(load_model(models["wider"]).with_output("compatible_embedding"), gallery_index)
    assert all(np.allclose(vector, expected[path], atol=1e-6) for path, vector in _by_path(gallery_index).items())


def test_a_compatible_output_index_takes_models_compatible_with_its_space_and_refuses_others(gallery_index, models,
                                                                                              tmp_path):
    """After the upgrade the vectors are in the old model's space: a model declared compatible with the old model
    joins; one declared compatible with the model that projected into it (its own space) does not."""
    upgrade_index(gallery_index, models["wider"], options=QUICK)
    wider_hash, old_hash = load_model(models["wider"]).model_hash, load_model(models["old"]).model_hash
    of_the_old = write_projection_onnx(tmp_path / "of_old.onnx", dim=24, seed=0, drift=0.2, compatible_with=(old_hash,))
    of_the_new = write_projection_onnx(tmp_path / "of_new.onnx", dim=24, seed=9, compatible_with=(wider_hash,))
    with Index.open(gallery_index, embedder=load_model(of_the_old)) as index:
        assert index.embedder.embedding_dim == 24
    with pytest.raises(ModelMismatchError, match=f"projection into the space of model\\(s\\) {old_hash}"):
        Index.open(gallery_index, embedder=load_model(of_the_new))


def test_a_compatible_model_without_an_output_of_the_index_size_is_refused_and_swapped_in(gallery_index, models):
    with pytest.raises(ModelMismatchError, match="declared compatible .* embeds in 32 dimensions .* have 24"):
        Index.open(gallery_index, embedder=load_model(models["unprojected"]))
    refused = CliRunner().invoke(main, ["search", "--index", str(gallery_index), "--model",
                                        str(models["unprojected"]), str(gallery_index.parent / "g" / "class0" /
                                                                        "img_0.png")])
    assert refused.exit_code == 1
    assert f"retrieval index upgrade {gallery_index} --model {models['unprojected']}" in refused.output
    summary = upgrade_index(gallery_index, models["unprojected"], options=QUICK)
    assert summary["mode"] == "swap" and summary["embedding_dim"] == 32


def test_serve_takes_a_model_and_refuses_an_undeclared_one_of_another_size_naming_the_upgrade(gallery_index, models):
    from retrieval.serve.config import ServerConfig
    from retrieval.serve.server import build_app

    _, service = build_app(ServerConfig(index_dir=gallery_index, model=models["wider"], ui=False,
                                        reload_interval_s=None))
    try:
        assert service.current().embedder.output_name == "compatible_embedding"
    finally:
        service.close()
    refused = CliRunner().invoke(main, ["serve", "--index", str(gallery_index), "--model", str(models["other"]),
                                        "--no-ui"])
    assert refused.exit_code == 1, refused.output
    assert "not declared compatible" in refused.output
    assert f"retrieval index upgrade {gallery_index} --model {models['other']}" in refused.output


def test_a_compatible_upgrade_re_embeds_a_milvus_collection_in_place(gallery_index, models, tmp_path):
    """After a mixed upgrade, the push (as `index upgrade --milvus` runs it) re-sends the re-embedded rows into the
    collection that serves, which records the new model; no second collection, the alias untouched."""
    pytest.importorskip("milvus_lite")
    from retrieval.index.milvus.milvus_collection import MilvusPlace, connect
    from retrieval.index.milvus.milvus_index import MilvusIndex
    from retrieval.index.milvus.milvus_push import push_index

    place = MilvusPlace.checked(str(tmp_path / "gallery.db"), "gallery")
    first = push_index(gallery_index, place, index_type="FLAT", progress=False)
    upgrade_index(gallery_index, models["new"], commit_every=8, options=QUICK)
    again = push_index(gallery_index, place, progress=False, switch=True)
    assert again["physical"] == first["physical"] and again["dropped"] is None and again["sent"] == 32
    local = _vectors(gallery_index)
    with MilvusIndex(place) as remote:
        assert remote.model_hash == load_model(models["new"]).model_hash
        ids = np.array(sorted(local), dtype=np.int64)
        np.testing.assert_allclose(remote.reconstructed_vectors(ids), np.stack([local[int(i)] for i in ids]),
                                   atol=1e-5)
    client = connect(place)
    assert [name for name in client.list_collections()] == [first["physical"]]
    client.close()
