"""An index is a portable folder: the index, its model and its gallery moved or renamed together keep searching,
serving (results and item images), adding, upgrading and repairing; the model is found by its hash (another file of
the same name is never loaded), a missing one is named by its hash with `--model` as the fix, `--gallery-root` follows
a gallery moved elsewhere, and nothing outside the (new) gallery root is ever served."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner
from embedders import write_projection_onnx
from planted import projection_model, write_digits

from retrieval.cli.main import main
from retrieval.index import Catalogue, Index, IngestOptions, add_images, build_index, load_model, repair_index
from retrieval.index.portable import GALLERY_RELATIVE, MODEL_RELATIVE, ModelNotFoundError
from retrieval.index.writing.upgrade import upgrade_index
from retrieval.records.index_info import IndexInfo

QUICK = IngestOptions(batch_size=16, workers=0, shard_size=16, progress=False)


@pytest.fixture
def site(tmp_path) -> Path:
    """site/gallery (30 digits), site/model.onnx and site/idx built from them: one folder tree to move."""
    root = tmp_path / "site"
    write_digits(root / "gallery", 30)
    model = projection_model(root)  # site/model.onnx
    build_index(root / "gallery", root / "idx", model=model, options=QUICK)
    return root


def move(site: Path, name: str = "moved") -> Path:
    """The whole tree moved to a new name; nothing is left at the old one."""
    target = site.parent / name
    shutil.move(site, target)
    assert not site.exists()
    return target


def info(index_dir: Path) -> dict:
    return json.loads((index_dir / "index.json").read_text())


def query(root: Path) -> Path:
    return root / "gallery" / "3" / "d0003.png"


def test_index_json_records_the_model_and_the_gallery_relative_to_the_index_folder(site):
    recorded = info(site / "idx")
    assert recorded[MODEL_RELATIVE] == "../model.onnx" and recorded[GALLERY_RELATIVE] == "../gallery"
    assert recorded["model_path"] == str((site / "model.onnx").resolve())


def test_a_moved_tree_is_searched_where_it_is_now(site):
    before = Index.open(site / "idx")
    with before:
        shown = [before.public_path(r.path) for r in before.search_images([query(site)], k=3)[0]]
    moved = move(site)
    with Index.open(moved / "idx") as index:  # no embedder given: the model is found by its hash
        found = index.search_images([query(moved)], k=3)[0]
        assert [index.public_path(r.path) for r in found] == shown and shown[0] == "3/d0003.png"
        assert index.image_file(found[0].path) == str(query(moved).resolve())


def test_a_moved_tree_is_searched_on_the_command_line(site):
    moved = move(site, "renamed")
    result = CliRunner().invoke(main, ["search", "--index", str(moved / "idx"), str(query(moved)), "-k", "2",
                                       "--json"])
    assert result.exit_code == 0, result.output
    best = json.loads(result.output)[0]["results"][0]
    assert best["path"] == "3/d0003.png" and best["file"] == str(query(moved).resolve())


def served(index_dir: Path, gallery_root: Path | None = None):
    from fastapi.testclient import TestClient

    from retrieval.serve.api import create_api
    from retrieval.serve.service import SearchService

    service = SearchService(index_dir, reload_interval_s=None, gallery_root=gallery_root)
    return service, TestClient(create_api(service))


def test_a_moved_tree_is_served_with_its_item_images(site):
    moved = move(site)
    service, client = served(moved / "idx")
    with client:
        response = client.post("/search?k=1", files={"image": ("q.png", query(moved).read_bytes(), "image/png")})
        assert response.status_code == 200, response.text
        best = response.json()["results"][0]
        assert best["path"] == "3/d0003.png"
        image = client.get(best["image_url"])
        assert image.status_code == 200 and image.content == query(moved).read_bytes()
    service.close()


def test_images_are_added_to_a_moved_tree_and_its_record_follows(site):
    moved = move(site)
    new = write_digits(moved / "gallery", 4, start=30)
    summary = add_images(moved / "idx", moved / "gallery", options=QUICK)  # the whole gallery again: 4 new
    assert summary["this_run"]["added"] == 4 and summary["this_run"]["duplicates"] == 0
    recorded = info(moved / "idx")
    assert recorded["gallery_root"] == str((moved / "gallery").resolve())
    assert recorded["model_path"] == str((moved / "model.onnx").resolve())
    with Catalogue(moved / "idx" / "catalogue.sqlite") as catalogue:
        paths = [row["path"] for row in catalogue.rows(catalogue.ids_with_status("done")).values()]
    assert len(paths) == 34 and all(p.startswith(str((moved / "gallery").resolve()) + "/") for p in paths)
    with Index.open(moved / "idx") as index:
        best = index.search_images([new[0]], k=1)[0][0]
        assert index.public_path(best.path) == new[0].relative_to(moved / "gallery").as_posix()


def test_a_moved_tree_is_upgraded_and_repaired(site):
    moved = move(site)
    other = write_projection_onnx(moved / "other.onnx", dim=16, seed=7)
    summary = upgrade_index(moved / "idx", model=other, options=QUICK)  # re-reads every image where it is now
    assert summary["reembedded"] == 30 and summary["unreadable"] == 0
    assert info(moved / "idx")[MODEL_RELATIVE] == "../other.onnx"
    repaired = repair_index(moved / "idx", label_from="parent", options=QUICK)  # lists the gallery again
    assert repaired["labels"]["classes"] == 10 and repaired["vectors"] == 30


def test_images_are_removed_from_a_moved_tree_by_the_paths_they_have_now(site):
    moved = move(site)
    gone = [query(moved), moved / "gallery" / "4" / "d0004.png"]
    result = CliRunner().invoke(main, ["index", "remove", str(moved / "idx"), "--paths", str(gone[0]), "--paths",
                                       "4/d0004.png", "--json"])  # absolute where it is now, and gallery-relative
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["removed_ids"]) == 2
    with Index.open(moved / "idx") as index:
        assert len(index) == 28
        shown = {index.public_path(r.path) for r in index.search_images([query(moved)], k=28)[0]}
        assert "3/d0003.png" not in shown and "4/d0004.png" not in shown and len(shown) == 28


def test_images_are_removed_from_a_gallery_moved_elsewhere_with_gallery_root(site, tmp_path):
    elsewhere = tmp_path / "disk" / "pictures"
    elsewhere.parent.mkdir()
    shutil.move(site / "gallery", elsewhere)
    target = elsewhere / "3" / "d0003.png"
    refused = CliRunner().invoke(main, ["index", "remove", str(site / "idx"), "--paths", str(target)])
    assert refused.exit_code == 1 and "nothing was removed" in refused.output  # the index cannot know where it went
    result = CliRunner().invoke(main, ["index", "remove", str(site / "idx"), "--paths", str(target),
                                       "--gallery-root", str(elsewhere), "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["removed_ids"]) == 1
    assert info(site / "idx")["gallery_root"] == str(elsewhere.resolve())


class Killed(Exception):
    """Stands for a kill before an upgrade's end."""


def test_an_upgrade_stopped_then_moved_resumes_without_naming_its_model(site, monkeypatch):
    other = write_projection_onnx(site / "other.onnx", dim=16, seed=7)
    wanted = load_model(other).model_hash

    def killed(*args, **kwargs):
        raise Killed()

    # every image re-embedded, nothing swapped in
    monkeypatch.setattr("retrieval.index.writing.upgrade._finish", killed)
    with pytest.raises(Killed):
        upgrade_index(site / "idx", model=other, options=QUICK)
    monkeypatch.undo()
    moved = move(site)
    summary = upgrade_index(moved / "idx", options=QUICK)  # the new model found where it is now, by its hash
    assert summary["reembedded"] == 0  # the re-embedded shards are kept: only the swap was left
    recorded = info(moved / "idx")
    assert recorded["model_hash"] == wanted and recorded[MODEL_RELATIVE] == "../other.onnx"
    with Index.open(moved / "idx") as index:
        assert index.public_path(index.search_images([query(moved)], k=1)[0][0].path) == "3/d0003.png"


def test_a_stopped_upgrade_whose_model_is_gone_names_its_hash(site, monkeypatch):
    other = write_projection_onnx(site / "other.onnx", dim=16, seed=7)
    wanted = load_model(other).model_hash
    monkeypatch.setattr("retrieval.index.writing.upgrade._finish",
                        lambda *args, **kwargs: (_ for _ in ()).throw(Killed()))
    with pytest.raises(Killed):
        upgrade_index(site / "idx", model=other, options=QUICK)
    monkeypatch.undo()
    moved = move(site)
    (moved / "other.onnx").unlink()
    with pytest.raises(ModelNotFoundError) as caught:
        upgrade_index(moved / "idx", options=QUICK)
    assert f"is being upgraded to the model with model_hash {wanted}" in str(caught.value)


def test_a_moved_model_with_another_hash_is_refused_by_its_hash_unloaded(site, monkeypatch):
    recorded = info(site / "idx")["model_hash"]
    moved = move(site)
    write_projection_onnx(moved / "model.onnx", dim=64, seed=9)  # same name, other weights
    other = load_model(moved / "model.onnx").model_hash

    def never(path, *args, **kwargs):
        raise AssertionError(f"{path} was loaded")

    monkeypatch.setattr("retrieval.index.search.load_model", never)
    with Index.open(moved / "idx") as index, pytest.raises(ModelNotFoundError) as caught:
        index.search_images([query(moved)], k=1)
    message = str(caught.value)  # the command line shows the parameter as --model (the next test)
    assert caught.value.param == "model" and recorded in message and f"model_hash {other}" in message


def test_a_missing_model_is_named_by_its_hash_with_model_as_the_fix(site):
    recorded = info(site / "idx")["model_hash"]
    moved = move(site)
    (moved / "model.onnx").unlink()
    result = CliRunner().invoke(main, ["search", "--index", str(moved / "idx"), str(query(moved))])
    assert result.exit_code == 1
    assert recorded in result.output and "--model" in result.output and "retrieval export" not in result.output
    assert str(site / "model.onnx") in result.output  # where it looked: the recorded place first
    given = CliRunner().invoke(main, ["search", "--index", str(moved / "idx"), str(query(moved)),
                                      "--model", str(projection_model(moved / "elsewhere")), "--json"])
    assert given.exit_code == 0, given.output


def test_gallery_root_follows_a_gallery_moved_elsewhere(site, tmp_path):
    elsewhere = tmp_path / "disk" / "pictures"
    elsewhere.parent.mkdir()
    shutil.move(site / "gallery", elsewhere)  # the index and model stay; ../gallery is gone
    moved_query = elsewhere / "3" / "d0003.png"
    result = CliRunner().invoke(main, ["search", "--index", str(site / "idx"), str(moved_query), "-k", "1",
                                       "--gallery-root", str(elsewhere), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["results"][0]["file"] == str(moved_query.resolve())
    service, client = served(site / "idx", gallery_root=elsewhere)
    with client:
        best = client.post("/search?k=1", files={"image": ("q.png", moved_query.read_bytes(), "image/png")}).json()
        image = client.get(best["results"][0]["image_url"])
        assert image.status_code == 200 and image.content == moved_query.read_bytes()
    service.close()
    write_digits(elsewhere, 2, start=30)
    added = CliRunner().invoke(main, ["index", "add", str(site / "idx"), "--images", str(elsewhere), "--workers",
                                      "0", "--gallery-root", str(elsewhere), "--json"])
    assert added.exit_code == 0, added.output
    assert json.loads(added.stdout)["this_run"]["added"] == 2
    assert info(site / "idx")["gallery_root"] == str(elsewhere.resolve())


def test_a_gallery_root_that_is_not_a_folder_is_refused_naming_the_option(site):
    result = CliRunner().invoke(main, ["search", "--index", str(site / "idx"), str(query(site)), "--gallery-root",
                                       str(site / "nowhere")])
    assert result.exit_code != 0 and "--gallery-root" in result.output and "not a folder" in result.output


def test_a_gallery_root_nested_in_the_recorded_one_is_refused(site):
    """A new root inside the recorded one (or holding it) would read one path two ways: two images, one file."""
    recorded = Path(info(site / "idx")["gallery_root"])
    (recorded / "v2").mkdir()
    for nested in (recorded / "v2", recorded.parent):
        result = CliRunner().invoke(main, ["search", "--index", str(site / "idx"), str(query(site)),
                                           "--gallery-root", str(nested)])
        assert result.exit_code != 0 and "--gallery-root" in result.output and "hold one another" in result.output, \
            result.output


def test_nothing_outside_the_moved_gallery_root_is_served(site, tmp_path):
    """An image added from another folder, and a catalogue path that climbs out with '..', both lie outside the
    gallery root: once the gallery moved, neither is served, though a file is there (under the new tree for the
    climbing path, at its old absolute place for the added one)."""
    extra = tmp_path / "extra"
    write_digits(extra, 1, start=40)
    add_images(site / "idx", extra, options=QUICK)
    secret = site / "secret" / "d9999.png"
    secret.parent.mkdir()
    shutil.copy(query(site), secret)
    with Catalogue(site / "idx" / "catalogue.sqlite") as catalogue:
        outside = catalogue.ids_for_paths([str(p.resolve()) for p in extra.rglob("*.png")])
        (added_id,) = outside.values()
    climbing = f"{(site / 'gallery').resolve()}/../secret/d9999.png"
    database = sqlite3.connect(site / "idx" / "catalogue.sqlite")
    with database:
        database.execute("UPDATE images SET path = ? WHERE id = 1", (climbing,))
    database.close()
    moved = move(site)
    for gallery_root in (None, moved / "gallery"):
        service, client = served(moved / "idx", gallery_root)
        with client:
            assert client.get("/items/2/image").status_code == 200  # an image inside the root is served
            for image_id in (1, added_id):
                assert client.get(f"/items/{image_id}/image").status_code == 404
        service.close()


def test_an_index_without_the_relative_record_works_as_before(site):
    """An index.json written before the relative fields: unmoved, it searches and serves as it always did."""
    recorded = info(site / "idx")
    for key in (MODEL_RELATIVE, GALLERY_RELATIVE):
        recorded.pop(key)
    (site / "idx" / "index.json").write_text(json.dumps(recorded))
    with Index.open(site / "idx") as index:
        best = index.search_images([query(site)], k=1)[0][0]
        assert index.public_path(best.path) == "3/d0003.png"
        assert index.image_file(best.path) == str(query(site).resolve())


def test_a_file_nobody_named_that_keeps_its_weights_elsewhere_is_not_read(tmp_path):
    """Looking beside the index for the model reads only self-contained .onnx files: one whose weights lie in other
    files (which onnx would open) is named as not read, never loaded, though its first fields are an export's."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from retrieval.index.portable import ModelNotFoundError, find_model

    (tmp_path / "idx").mkdir()
    weights = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], [weights])
    model = helper.make_model(graph)
    model.metadata_props.extend(onnx.load(str(projection_model(tmp_path / "export"))).metadata_props)
    onnx.save_model(model, str(tmp_path / "other.onnx"), save_as_external_data=True, location="other.data",
                    size_threshold=0)
    with pytest.raises(ModelNotFoundError) as missing:
        find_model(IndexInfo.from_json({"model_hash": "0123456789abcdef", "model_path": str(tmp_path / "gone.onnx")}),
                   tmp_path / "idx")
    assert "other.onnx (not read: give it as the model if it is the one)" in str(missing.value)


def junk_onnx(path: Path, size: int, head: bytes = b"") -> Path:
    """A sparse ``.onnx`` file of ``size`` bytes (no disk used): ``head``, then zeros."""
    with open(path, "wb") as handle:
        handle.write(head)
        handle.truncate(size)
    return path


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def test_junk_onnx_files_beside_a_moved_index_are_skipped_unread_and_the_model_is_found(site):
    """Large .onnx files beside a moved index that cannot be models (zeros; a model's first fields over a 2 GiB graph
    but no exported model's metadata; more than protobuf reads) are told apart by their first bytes and their size:
    they neither use up what may be read of files nobody named nor take memory, and the model after them is found."""
    import tracemalloc

    from retrieval.index.portable import find_model

    recorded = info(site / "idx")
    moved = move(site)
    (moved / "model.onnx").rename(moved / "exported.onnx")  # not where index.json says: looked for by its hash
    graph = 2**31 - 64
    header = b"\x08\x08" + b"\x3a" + varint(graph)  # ir_version 8, then a graph (field 7) of ~2 GiB of zeros
    junk_onnx(moved / "idx" / "a.onnx", 2**31 - 1)  # zeros: no protobuf field starts with 0
    junk_onnx(moved / "idx" / "b.onnx", len(header) + graph, header)  # a model's start, no metadata
    junk_onnx(moved / "idx" / "c.onnx", 2 * 2**30)  # more than one protobuf message can hold
    tracemalloc.start()
    try:
        found = find_model(IndexInfo.from_json(recorded), moved / "idx")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == moved / "exported.onnx"
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB held while looking"  # the junk was never read whole
    (moved / "exported.onnx").unlink()
    with pytest.raises(ModelNotFoundError) as missing:  # each junk file is named with why it was passed over
        find_model(IndexInfo.from_json(recorded), moved / "idx")
    message = str(missing.value)
    assert "a.onnx (not a readable exported model" in message and "b.onnx (not a readable exported model" in message
    assert "c.onnx (not read: 2.0 GiB" in message
