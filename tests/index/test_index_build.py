"""Gallery indexing: self-search, resumption after kill -9, broken files, duplicates, add/remove, models."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import PAUSE_ENV, PAUSED, QUICK, assert_each_indexed_once, copy_gallery, load_models_as, run_fake_cli
from sample_images import jpeg_bytes, png_bytes

from retrieval.cli.index import index_group, search_command
from retrieval.data.synthetic import bomb_png, write_digits
from retrieval.index import (
    AutoPolicy,
    Catalogue,
    Index,
    IngestOptions,
    ModelMismatchError,
    add_images,
    build_index,
    index_stats,
    remove_images,
    repair_index,
)
from retrieval.index.catalogue import THROUGHPUT_META
from retrieval.index.embedding.engines import ENGINES
from retrieval.index.embedding.ingest import LocalEngine
from retrieval.index.faiss_backend import faiss_files, faiss_keys, faiss_params
from retrieval.index.shards import ShardStore
from retrieval.index.sources import GalleryItem

TESTS = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("digits")
    return root / "gallery", write_digits(root / "gallery", 40)


def test_self_search_finds_each_image_first(digits, tmp_path):
    folder, paths = digits
    summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 40 and summary["errors"] == 0 and summary["index_key"] == "Flat"
    assert len(list((tmp_path / "idx" / "shards").glob("shard-*.npz"))) == 5
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert info["model_hash"] == FakeEmbedder().model_hash and info["index_key"] == "Flat"
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        results = index.search_images(paths, k=3)
        for path, hits in zip(paths, results, strict=True):
            assert hits[0].path == str(path.resolve())
            assert hits[0].label == path.parent.name  # ImageFolder-style label
            assert hits[0].score == pytest.approx(1.0, abs=1e-5)
            assert hits[0].score >= hits[1].score >= hits[2].score
        scores, ids = index.search_arrays(FakeEmbedder().embed(paths[:2]), k=50)  # k > gallery: padded
        assert ids.shape == (2, 50) and (ids[:, 40:] == -1).all() and (ids[:, :40] >= 0).all()


def test_unnormalised_model_is_normalised(digits, tmp_path):
    folder, paths = digits
    embedder = FakeEmbedder(normalized=False)
    build_index(folder, tmp_path / "idx", embedder=embedder, options=QUICK)
    vectors = np.concatenate([s.vectors for s in ShardStore(tmp_path / "idx" / "shards")])
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)
    with Index.open(tmp_path / "idx", embedder=embedder) as index:
        hits = index.search_images(paths[:1], k=1)[0]
        assert hits[0].score == pytest.approx(1.0, abs=1e-5)  # cosine, not the raw 9x inner product


@pytest.mark.parametrize("pause", ["after_shard_write:2", "after_commit:3"])
def test_resume_after_sigkill(digits, tmp_path, pause):
    """Kill -9 after a shard is written (before / after its rows are marked), rerun: each image once."""
    folder, paths = copy_gallery(digits, tmp_path)
    out = tmp_path / "idx"
    args = [
        "build",
        "--model",
        str(tmp_path / "fake.onnx"),
        "--images",
        str(folder),
        "--out",
        str(out),
        "--batch-size",
        "4",
        "--shard-size",
        "8",
        "--workers",
        "1",
    ]
    (tmp_path / "fake.onnx").write_bytes(b"fake")  # the CLI checks the path; the fake model is patched in
    process = run_fake_cli(args, {PAUSE_ENV: pause})
    deadline = time.monotonic() + 60
    for line in process.stderr:  # wait for the build to reach the pause point, then kill it hard
        if PAUSED in line or time.monotonic() > deadline:
            break
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL
    shards_before = len(list((out / "shards").glob("shard-*.npz")))
    assert shards_before == int(pause.split(":")[1])
    assert not (out / "index.faiss").exists() and not (out / "index.json").exists()
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        counts = catalogue.counts()
    assert counts["total"] == 40  # planned up front
    marked = 8 * shards_before if pause.startswith("after_commit") else 8 * (shards_before - 1)
    assert counts["done"] == marked

    summary = build_index(folder, out, model=tmp_path / "fake.onnx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["reconciled_rows"] == (8 if pause.startswith("after_shard_write") else 0)
    assert summary["indexed"] == 40 and summary["pending"] == 0
    assert_each_indexed_once(out, paths)
    with pytest.raises(FileExistsError, match="already holds a finished index"):
        build_index(folder, out, embedder=FakeEmbedder(), options=QUICK)


def test_interrupted_build_needs_the_same_model(digits, tmp_path):
    folder, _ = digits
    with Catalogue(tmp_path / "catalogue.sqlite") as catalogue:
        catalogue.set_meta(state="building", model_hash=FakeEmbedder(seed=1).model_hash, index_key="auto")
    with pytest.raises(ModelMismatchError, match="use the same model, or upgrade the index"):
        build_index(folder, tmp_path, embedder=FakeEmbedder(), options=QUICK)


def test_broken_files_are_recorded_and_skipped(digits, tmp_path):
    folder, paths = copy_gallery(digits, tmp_path)
    broken = folder / "broken"
    broken.mkdir()
    good_png, good_jpeg = png_bytes(), jpeg_bytes()
    files = {
        "empty.png": b"",
        "truncated.png": good_png[: len(good_png) // 2],
        "truncated.JPG": good_jpeg[: len(good_jpeg) // 2],
        "text.jpg": b"this is not an image\n" * 10,
        "bomb.png": bomb_png(),
    }
    for name, data in files.items():
        (broken / name).write_bytes(data)
    (folder / "notes.txt").write_text("not an image extension: never listed")
    summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 40 and summary["errors"] == len(files)
    with Catalogue(tmp_path / "idx" / "catalogue.sqlite") as catalogue:
        errors = {Path(r["path"]).name: r["error"] for r in catalogue.problems("error")}
    assert set(errors) == set(files)
    assert errors["empty.png"] == "empty file (0 bytes)"
    assert errors["text.jpg"].startswith("not an image")
    assert errors["bomb.png"].startswith("too large") and "decompression bomb" in errors["bomb.png"]
    assert "truncated" in errors["truncated.JPG"].lower()
    assert errors["truncated.png"]  # PIL says "truncated" or a zlib/IDAT error, depending on where it cut
    assert_each_indexed_once(tmp_path / "idx", paths)


def test_pixel_limit_option(digits, tmp_path):
    folder, _ = digits
    options = IngestOptions(workers=0, progress=False, max_pixels=32 * 32 - 1)  # every digit is 32 x 32
    with pytest.raises(ValueError, match="no image could be indexed .*40 errors.*too large: 32 x 32 = 1,024 pixels "
                                         "is over the limit of 1,023 pixels"):
        build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=options)


@pytest.mark.skipif(
    os.geteuid() == 0, reason="running as root: chmod 000 does not stop root from reading a file"
)
def test_unreadable_file_is_recorded(digits, tmp_path):
    folder, paths = copy_gallery(digits, tmp_path)
    paths[0].chmod(0)
    try:
        summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    finally:
        paths[0].chmod(0o644)
    assert summary["errors"] == 1 and "permission denied" in summary["error_examples"][0]["error"]


def test_exact_duplicates_recorded_once(digits, tmp_path):
    folder, paths = copy_gallery(digits, tmp_path)
    shutil.copy(paths[3], folder / "copy_a.png")
    shutil.copy(paths[3], folder / "3" / "copy_b.PNG")
    summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 40 and summary["duplicates"] == 2
    copies = [paths[3], folder / "copy_a.png", folder / "3" / "copy_b.PNG"]
    with Catalogue(tmp_path / "idx" / "catalogue.sqlite") as catalogue:
        dups = catalogue.problems("duplicate")
        ids = catalogue.ids_for_paths([str(p.resolve()) for p in copies])
        statuses = catalogue.status_of(list(ids.values()))
    original = min(ids.values())  # the first catalogued (walk order: top-level files first) is kept
    assert statuses[original] == "done"
    assert {d["id"] for d in dups} == set(ids.values()) - {original}
    assert {d["duplicate_of"] for d in dups} == {original}
    with Index.open(tmp_path / "idx") as index:
        assert len(index) == 40


@pytest.mark.parametrize("key", ["Flat", "HNSW16", "IVF4,Flat"])
def test_add_and_remove(digits, tmp_path, key):
    folder, paths = copy_gallery(digits, tmp_path)
    extra = tmp_path / "extra"
    extra_paths = write_digits(extra, 10, start=600)
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), index_key=key, options=QUICK)
    summary = add_images(tmp_path / "idx", extra, embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 50 and "added 10" in summary["updated_by"]
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert len(index) == 50 and index.info.vectors.index_key == key
        hit = index.search_images(extra_paths[:1], k=1)[0][0]
        assert hit.path == str(extra_paths[0].resolve())
        removed_id = hit.id
    summary = remove_images(tmp_path / "idx", ids=[removed_id], paths=[str(paths[0])])
    assert summary["indexed"] == 48 and summary["removed"] == 2
    if key.startswith("HNSW"):  # HNSW cannot remove ids: emptied and filled again from the shards
        assert "rebuild" in summary["updated_by"]
    else:
        assert "removed 2 in place" in summary["updated_by"]
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert len(index) == 48
        hits = index.search_images([extra_paths[0], paths[0]], k=48)
        found = {h.path for query in hits for h in query}
        assert str(extra_paths[0].resolve()) not in found and str(paths[0].resolve()) not in found
    # adding a removed image again brings it back, changed meanwhile: one vector for it, the new one
    new_content = write_digits(tmp_path / "fresh", 1, start=900)[0]
    old_content = tmp_path / "old.png"
    shutil.copyfile(paths[0], old_content)
    shutil.copyfile(new_content, paths[0])
    summary = add_images(tmp_path / "idx", folder, embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 49
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert len(index) == 49  # opens: faiss holds exactly the catalogue's done rows
        hit = index.search_images([new_content], k=1)[0][0]
        assert hit.path == str(paths[0].resolve()) and hit.score == pytest.approx(1.0, abs=1e-5)
        stale = index.search_images([old_content], k=1)[0][0]  # the old vector is gone
        assert stale.path != str(paths[0].resolve()) or stale.score < 1.0 - 1e-4
    # a full rebuild from the shards (what HNSW does on removal) also keeps only the current vector
    summary = remove_images(tmp_path / "idx", ids=[removed_id])
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert len(index) == 49
    with pytest.raises(ValueError, match="nothing was removed: no catalogue rows"):
        remove_images(tmp_path / "idx", ids=[10_000])


def test_paths_the_tools_print_are_accepted_back(digits, tmp_path, monkeypatch):
    """A path relative to the gallery (as the API and the app show it) or to the working folder names the same
    image; one file can be added; a list with an unknown id removes nothing and says so."""
    folder, paths = copy_gallery(digits, tmp_path)
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    shown = paths[0].resolve().relative_to(folder.resolve()).as_posix()  # e.g. "3/img-0003.png", as the API says
    monkeypatch.chdir(tmp_path / "idx")  # somewhere the relative path means nothing
    summary = remove_images(tmp_path / "idx", paths=[shown])
    assert summary["removed"] == 1 and summary["indexed"] == 39
    monkeypatch.chdir(folder)  # from the gallery folder: the same relative path, resolved from here
    with pytest.raises(ValueError, match="nothing was removed: not in the catalogue"):
        remove_images(tmp_path / "idx", paths=["no/such.png"])
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        kept_id = index.search_images([paths[1]], k=1)[0][0].id
    with pytest.raises(ValueError, match=rf"nothing was removed: no catalogue rows with ids 9999.*`ids` {kept_id}$"):
        remove_images(tmp_path / "idx", ids=[kept_id, 9999])
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert len(index) == 39  # nothing was removed
    single = write_digits(tmp_path / "one", 1, start=700)[0]
    summary = add_images(tmp_path / "idx", single, embedder=FakeEmbedder(), options=QUICK)
    assert summary["indexed"] == 40
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        assert index.search_images([single], k=1)[0][0].path == str(single.resolve())


def test_the_policy_of_the_options_chooses_the_index_key(digits, tmp_path):
    """``--index-key auto`` follows ``IngestOptions.policy`` through build, add and repair (no global to patch)."""
    folder, _ = digits
    policy = AutoPolicy(flat_max=10, hnsw_max=1_000, tune_queries=20)  # 40 images: HNSW instead of Flat
    options = dataclasses.replace(QUICK, policy=policy)
    summary = build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=options)
    assert summary["index_key"] == "HNSW32"
    assert build_index(folder, tmp_path / "flat", embedder=FakeEmbedder(), options=QUICK)["index_key"] == "Flat"
    summary = repair_index(tmp_path / "idx", embedder=FakeEmbedder(), rebuild=True, options=options)
    assert summary["index_key"] == "HNSW32"


class RecordingEngine(LocalEngine):
    """The local engine, noting which of its steps the writer ran through it."""

    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def ingest(self, *args, **kwargs) -> None:
        self.calls.append("ingest")
        super().ingest(*args, **kwargs)

    def add_vectors(self, *args, **kwargs):
        self.calls.append("add_vectors")
        return super().add_vectors(*args, **kwargs)


def test_repair_embeds_with_the_engine_the_options_choose(digits, tmp_path, monkeypatch):
    """``repair_index`` used to embed with the local ``Ingestor`` whatever ``options.engine`` said."""
    folder, _ = copy_gallery(digits, tmp_path)
    engine = RecordingEngine()
    monkeypatch.setitem(ENGINES, "recording", lambda options: engine)
    options = dataclasses.replace(QUICK, engine="recording")
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=options)
    assert engine.calls == ["ingest", "add_vectors"]
    extra = write_digits(tmp_path / "extra", 3, start=600)
    with Catalogue(tmp_path / "idx" / "catalogue.sqlite") as catalogue:  # as an add killed before embedding
        catalogue.plan([GalleryItem(str(p.resolve()), None) for p in extra])
    engine.calls.clear()
    summary = repair_index(tmp_path / "idx", embedder=FakeEmbedder(), rebuild=True, options=options)
    assert summary["indexed"] == 43 and summary["pending"] == 0
    assert engine.calls == ["ingest", "add_vectors"]
    with Catalogue(tmp_path / "idx" / "catalogue.sqlite") as catalogue:  # its throughput record counts the repair
        assert json.loads(catalogue.get_meta(THROUGHPUT_META))["recording"]["images"] == 43
    with pytest.raises(ValueError, match="engine 'nope' is unknown; choose one of local, ray, recording"):
        build_index(folder, tmp_path / "x", embedder=FakeEmbedder(), options=dataclasses.replace(QUICK, engine="nope"))


def test_manifest_with_split(tmp_path):
    paths = write_digits(tmp_path / "data", 12)
    rows = ["path,label,split"] + [
        f"{p.relative_to(tmp_path / 'data').as_posix()},{p.parent.name},{'test' if i % 3 == 0 else 'train'}"
        for i, p in enumerate(paths)
    ]
    (tmp_path / "data" / "manifest.csv").write_text("\n".join(rows) + "\n")
    summary = build_index(
        tmp_path / "data" / "manifest.csv",
        tmp_path / "idx",
        embedder=FakeEmbedder(),
        split="test",
        options=QUICK,
    )
    assert summary["indexed"] == 4
    with pytest.raises(ValueError, match="no rows with split"):
        build_index(
            tmp_path / "data" / "manifest.csv", tmp_path / "idx2", embedder=FakeEmbedder(), split="val"
        )


def test_query_model_mismatch_is_refused(digits, tmp_path):
    folder, paths = digits
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    with pytest.raises(ModelMismatchError, match="built by model .*upgrade the index to this one"):
        Index.open(tmp_path / "idx", embedder=FakeEmbedder(seed=1))
    with Index.open(tmp_path / "idx") as index, pytest.raises(ModelMismatchError, match="model_hash"):
        index.search_images(paths[:1], embedder=FakeEmbedder(seed=2))
    with pytest.raises(ModelMismatchError):
        add_images(tmp_path / "idx", folder, embedder=FakeEmbedder(seed=1))


def test_search_and_stats_cli(digits, tmp_path, monkeypatch):
    folder, paths = digits
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    monkeypatch.setattr("retrieval.index.search.load_model", lambda path, providers="auto": FakeEmbedder())
    result = CliRunner().invoke(
        search_command,
        ["--index", str(tmp_path / "idx"), "-k", "2", "--json", "--model", "m.onnx", str(paths[5])],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    top = payload[0]["results"][0]
    assert top["file"] == str(paths[5].resolve()) and len(payload[0]["results"]) == 2
    assert top["path"] == paths[5].resolve().relative_to(folder.resolve()).as_posix()  # as --where and the API
    assert set(top) == {"id", "path", "file", "label", "score"}
    result = CliRunner().invoke(index_group, ["stats", str(tmp_path / "idx"), "--queries", "20", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.output)
    assert stats["counts"]["done"] == 40 and stats["recall_1_at_1"] == 1.0 and stats["recall_10_at_10"] == 1.0
    assert stats["latency"]["p99_ms"] >= stats["latency"]["p50_ms"] > 0
    assert stats["size_on_disk_bytes"]["total"] > stats["size_on_disk_bytes"]["shards"] > 0
    assert index_stats(tmp_path / "idx", queries=5)["queries"] == 5


def test_gpu_flag_without_gpu_fails_clearly(digits, tmp_path):
    import faiss

    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        pytest.skip("a faiss GPU is present here; this test checks the message when there is none")
    folder, _ = digits
    (tmp_path / "m.onnx").write_bytes(b"x")
    result = CliRunner().invoke(
        index_group,
        [
            "build",
            "--model",
            str(tmp_path / "m.onnx"),
            "--images",
            str(folder),
            "--out",
            str(tmp_path / "idx"),
            "--gpu",
        ],
    )
    assert result.exit_code == 1 and "--gpu" in result.output and (
        "faiss-gpu" in result.output or "no CUDA GPU" in result.output
    )
    assert not (tmp_path / "idx").exists()  # failed before doing any work


WRITER_MODULES = {f"retrieval.index.{name}" for name in (
    "writer", "engines", "ingest", "mend", "faiss_build", "faiss_tuning")}


@pytest.mark.parametrize(
    ("module", "must_not_load"),
    [
        # the read side: search, stats, the live view, the serving diagnostics
        ("retrieval.index.stats", WRITER_MODULES | {"torch"}),
        ("retrieval.index.live", WRITER_MODULES | {"torch"}),
        ("retrieval.serve.diagnostics", WRITER_MODULES | {"torch"}),
        ("retrieval.index", WRITER_MODULES | {"torch"}),  # the package: its writer commands load on first use
        # no circle: the interface knows no engine, an engine knows neither the registry nor the commands
        ("retrieval.index.embedding.engine", WRITER_MODULES | {"retrieval.index.embedding.ray_engine", "torch"}),
        ("retrieval.index.embedding.ray_engine",
         {"retrieval.index.writing.writer", "retrieval.index.embedding.engines", "ray"}),
    ],
)
def test_import_graph(module, must_not_load):
    code = f"import sys, {module}; print(sorted(set({sorted(must_not_load)!r}) & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=TESTS.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"importing {module} loaded {result.stdout.strip()}"


def test_search_answers_the_good_queries_names_the_bad_and_can_exclude_itself(digits, tmp_path, monkeypatch):
    folder, paths = copy_gallery(digits, tmp_path)
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    args = ["--index", str(tmp_path / "idx"), "--model", "m.onnx", "-k", "3"]
    result = CliRunner().invoke(search_command, [*args, str(paths[0]), str(broken), str(paths[1])])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == str(paths[0].resolve())  # the query as given, resolved
    assert lines[1].endswith(f"  {paths[0].resolve().relative_to(folder.resolve()).as_posix()}")  # top-1: itself
    assert lines[4] == str(broken.resolve()) and lines[5].startswith("  cannot search with it: ")
    assert lines[6] == str(paths[1].resolve())
    assert "1 of 3 queries could not be read" in result.output and "Error" not in lines[5]
    payload = json.loads(CliRunner().invoke(search_command, [*args, "--json", "--exclude-self", str(paths[0])])
                         .output)
    own = payload[0]["excluded_self"]
    assert own is not None and all(r["id"] != own for r in payload[0]["results"])
    assert len(payload[0]["results"]) == 3 and payload[0]["results"][0]["file"] != str(paths[0].resolve())


def test_a_build_names_the_images_it_could_not_read_and_stats_failed_lists_them_all(digits, tmp_path, monkeypatch):
    """The first 10 unreadable images by name with why, and the command that lists the rest."""
    folder, _ = copy_gallery(digits, tmp_path)
    load_models_as(monkeypatch, lambda path, providers="auto": FakeEmbedder())
    (tmp_path / "m.onnx").write_bytes(b"x")
    broken = sorted(f"broken-{n:02d}.png" for n in range(12))
    for name in broken:
        (folder / name).write_bytes(b"not a png")
    out = str(tmp_path / "idx")
    built = CliRunner().invoke(index_group, ["build", "--model", str(tmp_path / "m.onnx"), "--images", str(folder),
                                             "--out", out, "--workers", "0"])
    assert built.exit_code == 0, built.output
    named = [name for name in broken if f"{name}: " in built.stdout]
    assert len(named) == 10 and "could not be read (12 in the index):" in built.stdout
    assert f"... and 2 more: retrieval index stats {out} --failed" in built.stdout
    listed = CliRunner().invoke(index_group, ["stats", out, "--failed"])
    assert listed.exit_code == 0, listed.output
    assert sorted(Path(line.split(": ")[0]).name for line in listed.stdout.splitlines()) == broken
    as_json = json.loads(CliRunner().invoke(index_group, ["stats", out, "--failed", "--json"]).stdout)
    assert sorted(Path(row["path"]).name for row in as_json) == broken and all(row["error"] for row in as_json)


def test_index_commands_end_with_a_line_for_people_and_the_next_command(digits, tmp_path, monkeypatch):
    """One summary line and the next command (JSON only with --json); add reports what it did."""
    folder, paths = copy_gallery(digits, tmp_path)
    load_models_as(monkeypatch, lambda path, providers="auto": FakeEmbedder())
    (tmp_path / "m.onnx").write_bytes(b"x")
    (folder / "broken.png").write_bytes(b"not a png")
    out = str(tmp_path / "idx")
    built = CliRunner().invoke(index_group, ["build", "--model", str(tmp_path / "m.onnx"), "--images", str(folder),
                                             "--out", out, "--workers", "0"])
    assert built.exit_code == 0, built.output
    lines = [line for line in built.stdout.splitlines() if line.strip()]
    assert lines[-2].startswith(f"indexed 40 images into {out} (") and "1 could not be read" in lines[-2]
    assert lines[-1] == f"next: retrieval serve --index {out}   (or: retrieval search --index {out} IMAGE)"
    more = tmp_path / "more"
    write_digits(more, 3, start=800)
    added = CliRunner().invoke(index_group, ["add", out, "--images", str(more), "--workers", "0"])
    assert added.exit_code == 0, added.output
    line = [line for line in added.stdout.splitlines() if line.startswith("added")][0]
    assert line.startswith(f"added 3 images to {out}") and "0 could not be read" in line  # not the build's error
    assert line.endswith("it now holds 43")
    shown = paths[0].resolve().relative_to(folder.resolve()).as_posix()  # as the API prints it
    removed = CliRunner().invoke(index_group, ["remove", out, "--paths", shown])
    assert removed.exit_code == 0, removed.output
    assert removed.stdout.splitlines() == [f"removed 1 images from {out}; 42 remain indexed",
                                           f"next: retrieval index stats {out}"]
    stats = CliRunner().invoke(index_group, ["stats", out, "--queries", "10"])
    assert stats.stdout.splitlines()[0].startswith(f"{out}: 42 images, Flat,") and "recall@10" in stats.stdout
    as_json = CliRunner().invoke(index_group, ["stats", out, "--queries", "10", "--json"])
    assert json.loads(as_json.stdout)["vectors"] == 42


def test_search_names_a_fifo_query_without_waiting_on_it(digits, tmp_path, monkeypatch):
    """A query path that is a FIFO (or another non-regular file) is refused before reading, never waited on."""
    folder, paths = copy_gallery(digits, tmp_path)
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), options=QUICK)
    monkeypatch.setattr("retrieval.index.searchable.opening.load_model", lambda path, providers="auto": FakeEmbedder())
    fifo = tmp_path / "query.png"
    os.mkfifo(fifo)
    started = time.monotonic()
    result = CliRunner().invoke(search_command, ["--index", str(tmp_path / "idx"), "--model", "m.onnx", "-k", "2",
                                                 "--exclude-self", str(fifo), str(paths[2])])
    assert time.monotonic() - started < 30 and result.exit_code == 1
    assert "not a regular file" in result.output and "1 of 2 queries could not be read" in result.output
    assert str(paths[2].resolve()) in result.output


def test_an_ivf_index_built_inside_idmap2_still_adds_removes_and_searches(digits, tmp_path, monkeypatch):
    """Indexes written before IVF kept the ids in its lists are IDMap2 wrappers around an IVF of positions: they
    keep working, a removal rebuilding their lists from the shards."""
    folder, paths = copy_gallery(digits, tmp_path)
    with monkeypatch.context() as patched:
        patched.setattr(faiss_keys, "keeps_ids_in_lists", lambda index: False)
        build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), index_key="IVF4,Flat", options=QUICK)
    assert faiss_params.has_id_map(faiss_files.read_index(tmp_path / "idx" / "index.faiss"))
    extra = write_digits(tmp_path / "extra", 5, start=600)
    assert "added 5" in add_images(tmp_path / "idx", tmp_path / "extra", embedder=FakeEmbedder(),
                                   options=QUICK)["updated_by"]
    summary = remove_images(tmp_path / "idx", paths=[str(paths[0]), str(extra[0])])
    assert summary["removed"] == 2 and "rebuild" in summary["updated_by"]
    with Index.open(tmp_path / "idx", embedder=FakeEmbedder()) as index:
        faiss_params.set_search_params(index.faiss_index, {"nprobe": 4})
        assert faiss_params.has_id_map(index.faiss_index) and len(index) == 43
        hit = index.search_images(extra[1:2], k=1)[0][0]
        assert hit.path == str(extra[1].resolve()) and hit.score == pytest.approx(1.0, abs=1e-5)
        found = {h.path for h in index.search_images(paths[:1], k=43)[0]}
        assert str(paths[0].resolve()) not in found and len(found) == 43
