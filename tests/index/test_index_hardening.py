"""Hostile gallery names, unreadable folders, the writer lock, and `index repair`."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import PAUSE_ENV, PAUSED, QUICK, assert_each_indexed_once, copy_gallery, load_models_as, run_fake_cli

from retrieval.cli.index import index_group, search_command
from retrieval.cli.main import main
from retrieval.data.synthetic import write_digits
from retrieval.index import (
    Catalogue,
    Index,
    IndexLockedError,
    add_images,
    build_index,
    index_stats,
    remove_images,
    repair_index,
)
from retrieval.index.faiss_backend.faiss_params import index_ids, set_search_params
from retrieval.index.shards import ShardStore
from retrieval.index.writing.mend import missing_vectors

NOBODY = 65534


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("digits")
    return root / "gallery", write_digits(root / "gallery", 40)


def cli_args(tmp_path: Path, folder: Path, out: Path) -> list[str]:
    """`index build` through the real CLI with the fake model (see index_builds.run_cli_with_fake)."""
    (tmp_path / "fake.onnx").write_bytes(b"fake")
    return [
        "build", "--model", str(tmp_path / "fake.onnx"), "--images", str(folder), "--out", str(out),
        "--batch-size", "4", "--shard-size", "8", "--workers", "1",
    ]  # fmt: skip


def start_paused(args: list[str], pause: str) -> subprocess.Popen:
    """Run the CLI until it stops at the pause point (holding the writer lock), and return it."""
    process = run_fake_cli(args, {PAUSE_ENV: pause})
    deadline = time.monotonic() + 90
    for line in process.stderr:
        if PAUSED in line:
            return process
        assert time.monotonic() < deadline, "the build never reached its pause point"
    process.kill()
    raise AssertionError(f"the build ended before its pause point: {process.wait()}")


# --- hostile names ---------------------------------------------------------------------------------
def test_name_not_utf8_is_recorded_and_the_rest_indexed(digits, tmp_path, monkeypatch):
    folder, paths = copy_gallery(digits, tmp_path)
    bad = os.fsencode(paths[0].parent) + b"/bad\xff\xfe.png"  # Linux names are bytes; not UTF-8 here
    os.rename(os.fsencode(paths[0]), bad)
    odd = paths[1].with_name("new\nline\u202eevil\\x.png")  # valid UTF-8: indexed, shown escaped
    paths[1].rename(odd)
    long_name = paths[2].with_name("n" * 250 + ".png")  # NAME_MAX is 255 bytes
    paths[2].rename(long_name)
    summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)

    assert summary["indexed"] == 39 and summary["errors"] == 1 and summary["not_listed"] == 1
    shown = f"{paths[0].parent}/bad\\xff\\xfe.png"
    assert summary["error_examples"] == [
        {"id": None, "path": shown, "error": "file name is not valid UTF-8; rename it", "duplicate_of": None}
    ]
    assert_each_indexed_once(tmp_path / "idx", [odd, long_name, *paths[3:]])
    stats = index_stats(tmp_path / "idx", queries=5)
    assert stats["errors"] == 1 and stats["error_examples"][0]["path"] == shown
    with pytest.raises(ValueError) as caught:
        remove_images(tmp_path / "idx", paths=[os.fsdecode(bad)])
    assert str(caught.value).startswith(f"nothing was removed: not in the catalogue: {shown} (a path is taken")

    # the search table prints the odd name on one line, escaped; --json keeps it exact
    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    index_args = ["--index", str(tmp_path / "idx"), "-k", "1", "--model", "m.onnx", str(odd)]
    table = CliRunner().invoke(search_command, index_args)
    assert table.exit_code == 0, table.output
    assert "new\\nline\\u202eevil\\\\x.png" in table.output.splitlines()[0]
    assert len(table.output.splitlines()) == 2
    payload = json.loads(CliRunner().invoke(search_command, [*index_args, "--json"]).output)
    assert payload[0]["results"][0]["file"] == str(odd)


def test_manifest_rows_with_unusable_paths_are_recorded(tmp_path):
    paths = write_digits(tmp_path / "data", 4)
    rows = [b"path,label"] + [os.fsencode(f"{p.relative_to(tmp_path / 'data')},{p.parent.name}") for p in paths]
    rows += [
        b"bad\xff.png,x",  # a name that is not UTF-8
        b'"nul\x00.png",x',  # no file can have this name
        b"deep/" + b"d" * 5000 + b".png,x",  # longer than PATH_MAX
        os.fsencode(f"{paths[0].relative_to(tmp_path / 'data')}") + b",label\xff",  # label not UTF-8
        b",x",  # no path
    ]
    (tmp_path / "data" / "manifest.csv").write_bytes(b"\n".join(rows) + b"\n")
    summary = build_index(tmp_path / "data" / "manifest.csv", tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 4 and summary["errors"] == summary["not_listed"] == 5
    errors = {e["path"][-30:]: e["error"] for e in summary["error_examples"]}
    assert errors[str(tmp_path / "data" / "bad\\xff.png")[-30:]] == (
        "file name is not valid UTF-8; rename it (manifest line 6)"
    )
    assert any(e.startswith("path contains a NUL byte") for e in errors.values())
    assert any(e.startswith("path is longer than 4096 bytes") for e in errors.values())
    assert any("label label\\xff is not valid UTF-8" in e for e in errors.values())
    assert any(e == "the row has no path" for e in errors.values())
    assert max(len(e["path"]) for e in summary["error_examples"]) < 600  # long names cut for display
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert info["gallery_root"] == str((tmp_path / "data").resolve())  # the manifest's folder


def _build_as(uid: int | None, folder: Path, out: Path, queue) -> None:
    """Child process: drop to ``uid`` (root ignores permission bits), then build."""
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        queue.put(build_index(folder, out, embedder=FakeEmbedder(), options=QUICK))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails the test)
        queue.put(repr(exc))


def test_unreadable_folder_is_recorded(digits, tmp_path):
    """The build runs in a forked child that gives up root, so that a chmod 700 folder is really unreadable."""
    # a home nobody can reach (pytest's tmp_path is private to root); warm up every lazy import as root,
    # since the child as nobody cannot read the Python installation under /root
    work = Path(tempfile.mkdtemp(prefix="retrieval-unreadable-"))
    try:
        work.chmod(0o755)
        folder, paths = copy_gallery(digits, work)
        build_index(folder, work / "warm", embedder=FakeEmbedder(), options=QUICK)
        hidden = paths[0].parent
        hidden.chmod(0o700)  # owner root: nobody can neither list nor enter it
        uid = NOBODY if os.geteuid() == 0 else None
        if uid is not None:
            os.chown(work, NOBODY, NOBODY)
        else:
            hidden.chmod(0)
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_build_as, args=(uid, folder, work / "idx", queue))
        child.start()
        summary = queue.get(timeout=120)
        child.join(timeout=30)
        assert isinstance(summary, dict), summary
        in_hidden = [p for p in paths if p.parent == hidden]
        assert summary["indexed"] == 40 - len(in_hidden) and summary["not_listed"] == 1
        [error] = summary["error_examples"]
        assert error["path"] == str(hidden) and error["error"].startswith("folder not listed (Permission denied)")
        # made readable again, adding the same folder indexes its images and drops the error
        hidden.chmod(0o755)
        summary = add_images(work / "idx", folder, embedder=FakeEmbedder(), options=QUICK)
        assert summary["indexed"] == 40 and summary["errors"] == 0 and summary["error_examples"] == []
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- one writer at a time --------------------------------------------------------------------------
def test_second_writer_is_refused_and_the_lock_dies_with_its_holder(digits, tmp_path):
    folder, paths = copy_gallery(digits, tmp_path)
    out = tmp_path / "idx"
    holder = start_paused(cli_args(tmp_path, folder, out), "after_shard_write:1")
    try:
        started = time.monotonic()
        with pytest.raises(IndexLockedError, match=rf"being written by PID {holder.pid} .*running `.*build"):
            build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)
        assert time.monotonic() - started < 2  # refused at once, not after a wait
        with pytest.raises(IndexLockedError, match=f"PID {holder.pid}"):
            add_images(out, folder, embedder=FakeEmbedder(), options=QUICK)
        with pytest.raises(IndexLockedError, match=f"PID {holder.pid}"):
            repair_index(out, embedder=FakeEmbedder(), options=QUICK)
        # the whole command line, as a user meets it: one line, exit status 1
        second = CliRunner().invoke(main, ["index", "remove", str(out), "--ids", "1"])
        assert second.exit_code == 1
        assert f"cannot remove images from {out}: it is being written by PID {holder.pid}" in (
            second.output
        )
        # a reader needs no lock: it is told the index is still being built, not to repair it
        with pytest.raises(FileNotFoundError, match=f"being built by PID {holder.pid}"):
            Index.open(out)
    finally:
        holder.kill()  # SIGKILL: no cleanup runs; the kernel drops the flock (its DataLoader worker too)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    summary = build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)  # at once, no stale lock
    assert summary["indexed"] == 40 and summary["reconciled_rows"] == 8
    assert_each_indexed_once(out, paths)


# --- repair ----------------------------------------------------------------------------------------
def assert_whole(out: Path, paths: list[Path]) -> None:
    """Every image is done, its vector is in its shard, faiss holds exactly those ids, and each finds itself."""
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
        assert sorted(r["path"] for r in catalogue.rows(list(done)).values()) == sorted(map(str, paths))
        assert not missing_vectors(catalogue, ShardStore(out / "shards"))
    with Index.open(out, embedder=FakeEmbedder()) as index:
        assert sorted(index_ids(index.faiss_index).tolist()) == sorted(done)
        hits = index.search_images(paths, k=1)
    assert [h[0].path for h in hits] == [str(p) for p in paths]


# --- repair ----------------------------------------------------------------------------------------
def drop_from_faiss(out: Path, ids: list[int]) -> None:
    index = faiss.read_index(str(out / "index.faiss"))
    index.remove_ids(np.asarray(ids, np.int64))
    faiss.write_index(index, str(out / "index.faiss"))


def test_inconsistent_index_is_detected_and_repaired(digits, tmp_path):
    folder, paths = copy_gallery(digits, tmp_path)
    out = tmp_path / "idx"
    build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)
    repair_hint = f"inconsistent: .*run `retrieval index repair {out}`"

    # faiss lacks vectors that the shards hold: repair embeds nothing, only adds them back
    drop_from_faiss(out, [3, 4, 5])
    with pytest.raises(RuntimeError, match=repair_hint):
        Index.open(out)  # what search and serve do
    result = CliRunner().invoke(index_group, ["stats", str(out)])
    assert isinstance(result.exception, RuntimeError) and "retrieval index repair" in str(result.exception)
    with pytest.raises(FileExistsError, match=f"already holds a finished index, but .*index repair {out}"):
        build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)
    embedder = FakeEmbedder()
    summary = repair_index(out, embedder=embedder)
    assert embedder.calls == 0 and summary["vectors"] == 40 and "added 3" in summary["faiss"]
    assert_each_indexed_once(out, paths)
    assert index_stats(out, queries=40)["recall_1_at_1"] == 1.0

    # what two writers at once left: a shard overwritten by another writer's shard of the same name,
    # so catalogue rows marked done point to a shard without their vectors, and faiss lacks them too
    shards = sorted((out / "shards").glob("shard-*.npz"))
    lost = np.load(shards[2])["ids"].tolist()
    shutil.copyfile(shards[1], shards[2])
    drop_from_faiss(out, lost)
    with pytest.raises(RuntimeError, match=repair_hint):
        index_stats(out)
    embedder = FakeEmbedder()
    summary = repair_index(out, embedder=embedder)
    assert summary["requeued_rows"] == len(lost) == 8 and embedder.calls == 1  # one batch: only those 8
    assert_whole(out, paths)  # (the overwritten shard still holds a stale copy: no row points to it)
    remove_images(out, ids=[lost[0]])  # and the index is whole again for the other writers
    with Index.open(out) as index:
        assert len(index) == 39 and lost[0] not in index_ids(index.faiss_index)


def test_repair_finishes_a_half_built_index(digits, tmp_path, monkeypatch):
    folder, paths = copy_gallery(digits, tmp_path)
    out = tmp_path / "idx"
    process = start_paused(cli_args(tmp_path, folder, out), "after_commit:2")
    process.kill()
    process.wait(timeout=30)
    with pytest.raises(FileNotFoundError, match=f"not finished .*run `retrieval index repair {out}`"):
        Index.open(out)
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        assert catalogue.counts()["done"] == 16
    embedder = FakeEmbedder()  # stands in for the model the build recorded
    load_models_as(monkeypatch, lambda path, providers="auto": embedder)
    repaired = CliRunner().invoke(main, ["index", "repair", str(out), "--batch-size", "8", "--workers", "0", "--json"])
    assert repaired.exit_code == 0, repaired.output
    summary = json.loads(repaired.stdout)
    assert summary["indexed"] == 40 and summary["pending"] == 0 and summary["vectors"] == 40
    assert embedder.calls == 3  # the 24 images no shard held, in batches of 8: nothing embedded twice
    assert_each_indexed_once(out, paths)
    info = json.loads((out / "index.json").read_text())
    assert info["gallery_root"] == str(folder.resolve()) and info["count"] == 40
    with pytest.raises(FileExistsError, match="already holds a finished index; add images"):
        build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)  # whole now


@pytest.mark.parametrize("key", ["IVF4,Flat", "HNSW16"])
def test_remove_keeps_the_other_results_right(digits, tmp_path, key):
    """faiss IVF keeps its rows' old positions on remove_ids: the IDMap2 wrapper then named the wrong images."""
    folder, paths = digits
    out = tmp_path / "idx"
    build_index(folder, out, embedder=FakeEmbedder(), index_key=key, options=QUICK)
    summary = remove_images(out, paths=[str(paths[3]), str(paths[20])])
    assert summary["indexed"] == 38
    kept = [p for i, p in enumerate(paths) if i not in (3, 20)]
    with Index.open(out, embedder=FakeEmbedder()) as index:
        set_search_params(index.faiss_index, {"nprobe": 4} if key.startswith("IVF") else {"efSearch": 64})
        hits = index.search_images(kept, k=1)
    assert [h[0].path for h in hits] == [str(p) for p in kept]
