"""An IVF index whose lists live on disk (the Ray engine's ``merge_ondisk``): the folder can be moved, updates are
copy-on-write (readers and a crash mid-update never see half-changed lists), and stdout stays JSON."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pytest
from embedders import FakeEmbedder
from index_builds import QUICK, copy_gallery

from retrieval.data.synthetic import write_digits
from retrieval.index import Index, add_images, build_index, l2_normalize_rows, remove_images, repair_index
from retrieval.index.faiss_backend import faiss_files, faiss_params

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("digits")
    return root / "gallery", write_digits(root / "gallery", 40)


def move_lists_to_disk(index_dir: Path) -> Path:
    """Rewrite a built IVF index as the Ray engine's on-disk merge leaves it: lists in index-<n>.ivfdata."""
    index = faiss.read_index(str(index_dir / "index.faiss"))
    ivf = faiss.extract_index_ivf(index)
    lists_file = index_dir / "index-1.ivfdata"
    lists = faiss.OnDiskInvertedLists(ivf.nlist, ivf.code_size, str(lists_file))
    sources = faiss.InvertedListsPtrVector()
    sources.push_back(ivf.invlists)
    lists.merge_from_multiple(sources.data(), sources.size())
    ivf.replace_invlists(lists, True)
    lists.this.disown()
    faiss.write_index(index, str(index_dir / "index.faiss"))
    return lists_file


def lists_files(index_dir: Path) -> list[str]:
    return sorted(p.name for p in index_dir.glob("index-*.ivfdata"))


def named_lists_file(index_dir: Path) -> str:
    with Index.open(index_dir) as index:
        return Path(faiss_files.on_disk_lists(index.faiss_index).filename).name


def named_lists_file_raw(index_dir: Path) -> str:
    """The lists file that index.faiss names, read without the catalogue's checks."""
    return Path(faiss_files.on_disk_lists(faiss_files.read_index(index_dir / "index.faiss")).filename).name


@pytest.fixture
def on_disk(digits, tmp_path) -> tuple[Path, list[Path]]:
    folder, paths = copy_gallery(digits, tmp_path)
    build_index(folder, tmp_path / "idx", embedder=FakeEmbedder(), index_key="IVF4,Flat", options=QUICK)
    move_lists_to_disk(tmp_path / "idx")
    return tmp_path / "idx", paths


def search_all(index_dir: Path, queries: list[Path], k: int = 5) -> list[list[tuple[str, float]]]:
    with Index.open(index_dir, embedder=FakeEmbedder()) as index:
        faiss_params.set_search_params(index.faiss_index, {"nprobe": 4})
        return [[(h.path, round(h.score, 5)) for h in hits] for hits in index.search_images(queries, k=k)]


def test_an_on_disk_index_folder_opens_after_it_is_moved(on_disk, tmp_path):
    index_dir, paths = on_disk
    before = search_all(index_dir, paths[:5])
    with Index.open(index_dir) as index:
        assert faiss_files.on_disk_lists(index.faiss_index) is not None and len(index) == 40
    moved = tmp_path / "elsewhere" / "idx"
    shutil.move(str(index_dir), moved)
    assert search_all(moved, paths[:5]) == before  # faiss recorded the old absolute path; it is not used


def test_updates_write_a_new_lists_file_and_delete_the_old_one(on_disk, tmp_path):
    index_dir, paths = on_disk
    extra = write_digits(tmp_path / "extra", 6, start=600)
    assert lists_files(index_dir) == ["index-1.ivfdata"]
    with Index.open(index_dir, embedder=FakeEmbedder()) as reader:  # a server that opened the index before
        faiss_params.set_search_params(reader.faiss_index, {"nprobe": 4})
        seen_before = [[h.path for h in hits] for hits in reader.search_images(paths[:5], k=5)]
        summary = add_images(index_dir, tmp_path / "extra", embedder=FakeEmbedder(), options=QUICK)
        assert summary["indexed"] == 46 and "added 6" in summary["updated_by"]
        # the reader's mapped lists were never written: it answers as before the update, until it reopens
        assert [[h.path for h in hits] for hits in reader.search_images(paths[:5], k=5)] == seen_before
    assert lists_files(index_dir) == [named_lists_file(index_dir)] != ["index-1.ivfdata"]
    hit = search_all(index_dir, extra[:1], k=1)[0][0]
    assert hit == (str(extra[0].resolve()), pytest.approx(1.0, abs=1e-4))
    named = named_lists_file(index_dir)
    summary = remove_images(index_dir, paths=[str(extra[0]), str(paths[0])])
    assert summary["indexed"] == 44 and summary["removed"] == 2
    assert lists_files(index_dir) == [named_lists_file(index_dir)] != [named]
    found = {path for hits in search_all(index_dir, [extra[0], paths[0]], k=44) for path, _ in hits}
    assert str(extra[0].resolve()) not in found and str(paths[0].resolve()) not in found
    assert len(found) == 44


def test_a_failed_update_leaves_the_on_disk_index_whole(on_disk, tmp_path, monkeypatch):
    index_dir, _ = on_disk
    queries = l2_normalize_rows(np.random.default_rng(0).standard_normal((20, FakeEmbedder().embedding_dim)))

    def raw_search() -> tuple[int, np.ndarray]:
        index = faiss_files.read_index(index_dir / "index.faiss")
        faiss_params.set_search_params(index, {"nprobe": 4})
        return index.ntotal, index.search(np.asarray(queries, np.float32), 10)[1]

    count, before = raw_search()
    write_digits(tmp_path / "extra", 6, start=600)

    def crash(*args, **kwargs):
        raise OSError("disk full (simulated) before index.faiss was replaced")

    with monkeypatch.context() as patch:
        patch.setattr(faiss_files, "write_index_atomic", crash)
        with pytest.raises(OSError, match="simulated"):
            add_images(index_dir, tmp_path / "extra", embedder=FakeEmbedder(), options=QUICK)
    # the lists file that index.faiss names was not touched: the faiss part is the old one, whole
    assert named_lists_file_raw(index_dir) == "index-1.ivfdata" and len(lists_files(index_dir)) == 2
    after_count, after = raw_search()
    assert (after_count, after.tolist()) == (count, before.tolist())
    # the catalogue had recorded the 6 new images: repair brings faiss in line, and drops the half-written copy
    repair_index(index_dir)
    with Index.open(index_dir) as index:
        assert len(index) == 46
    assert lists_files(index_dir) == [named_lists_file(index_dir)]


def test_stdout_stays_json_for_an_on_disk_index(on_disk):
    """faiss prints its on-disk messages with printf; the CLI's stdout must still parse as JSON."""
    index_dir, _ = on_disk
    result = subprocess.run(
        [sys.executable, "-m", "retrieval", "index", "stats", str(index_dir), "--queries", "5", "--json"],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stdout)
    assert stats["counts"]["done"] == 40 and stats["size_on_disk_bytes"]["faiss"] > 0
    assert "IO_FLAG_ONDISK_SAME_DIR" in result.stderr  # faiss' own line, sent to stderr
    assert np.isfinite(stats["recall_10_at_10"])


@pytest.mark.parametrize("wrapped", [False, True])
def test_lists_copied_for_an_update_keep_every_entry_when_others_grow(tmp_path, wrapped):
    """The copy-on-write copy of on-disk lists takes its space list by list: lists that grow after the copy are
    given new space, never space holding another list's entries (ids, codes and search answers stay whole)."""
    vectors = l2_normalize_rows(np.random.default_rng(0).standard_normal((400, 8))).astype(np.float32)
    ids = np.arange(400, dtype=np.int64) + 100
    index = faiss.index_factory(8, "IDMap2,IVF4,Flat" if wrapped else "IVF4,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(vectors)
    index.add_with_ids(vectors[:340], ids[:340])
    faiss.write_index(index, str(tmp_path / "index.faiss"))
    move_lists_to_disk(tmp_path)
    index = faiss_files.read_index(tmp_path / "index.faiss")
    assert faiss_files.detach_on_disk_lists(index, tmp_path)
    index.add_with_ids(vectors[340:], ids[340:])  # every list grows past the space the copy gave it
    faiss_params.set_search_params(index, {"nprobe": 4})
    assert np.array_equal(np.sort(faiss_params.index_ids(index)), ids)
    assert np.array_equal(index.search(vectors, 1)[1].ravel(), ids)
    inner = faiss.extract_index_ivf(faiss_params.inner(index))
    stored = np.concatenate([faiss.rev_swig_ptr(inner.invlists.get_ids(n), inner.invlists.list_size(n)).copy()
                             for n in range(4)])
    assert np.array_equal(np.sort(stored), np.arange(400) if wrapped else ids)
