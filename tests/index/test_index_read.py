"""The index's one read path: ``Index`` over a read-only, per-thread ``CatalogueReader``; excluded ids; ``k``."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sqlite3
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder

from retrieval.cli.index import search_command
from retrieval.data.synthetic import write_digits
from retrieval.index import Index, IngestOptions, build_index, index_stats, remove_images
from retrieval.index.catalogue import Catalogue
from retrieval.index.search import MAX_K, check_k
from retrieval.index.shards import ShardStore
from retrieval.index.vectors import done_chunks

QUICK = IngestOptions(batch_size=8, workers=0, shard_size=8, progress=False)
NOBODY = 65534


def stored_vectors(index_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(ids, vectors) of every indexed image, read from the shards."""
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
    ids, vectors = zip(*done_chunks(ShardStore(index_dir / "shards"), done), strict=True)
    return np.concatenate(ids), np.concatenate(vectors)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, np.ndarray, np.ndarray]:
    """A 40-image Flat index (exact search) and its stored vectors."""
    root = tmp_path_factory.mktemp("read")
    write_digits(root / "gallery", 40)
    build_index(root / "gallery", root / "idx", embedder=FakeEmbedder(), options=QUICK)
    return (root / "idx", *stored_vectors(root / "idx"))


def snapshot(folder: Path) -> dict[str, tuple[str, int]]:
    """relative path -> (sha256, mtime in ns) of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def brute_force(query: np.ndarray, ids: np.ndarray, vectors: np.ndarray, k: int, exclude: set[int]) -> list:
    """The top-k (id, cosine) by a float64 loop over every stored vector, excluded ids left out."""
    scored = []
    for image_id, vector in zip(ids.tolist(), vectors.astype(np.float64), strict=True):
        if image_id not in exclude:
            scored.append((image_id, sum(float(a) * float(b) for a, b in zip(query, vector, strict=True))))
    return sorted(scored, key=lambda pair: -pair[1])[:k]


# --- the reader never writes -------------------------------------------------------------------------------
def test_searches_leave_the_index_files_untouched(built, tmp_path):
    index_dir = tmp_path / "idx"
    shutil.copytree(built[0], index_dir)
    before = snapshot(index_dir)
    ids, vectors = built[1], built[2]
    with Index.open(index_dir) as index:
        for start in range(0, 40, 8):
            index.search(vectors[start : start + 8], k=5, exclude_ids=ids[start : start + 2].tolist())
        index.search_arrays(vectors, k=3)
    index_stats(index_dir, queries=20)  # opens the index too, and reads the shards
    after = snapshot(index_dir)
    assert {name: after[name] for name in before} == before  # same bytes, same mtimes: the catalogue included
    # all SQLite may add in a folder it can write: a read-only connection's WAL shared memory, and an empty WAL
    assert set(after) - set(before) <= {"catalogue.sqlite-shm", "catalogue.sqlite-wal"}
    wal = index_dir / "catalogue.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0


def _search_as(uid: int | None, index_dir: Path, queries: np.ndarray, exclude: list[int], queue) -> None:
    """Child process: drop to ``uid`` (root ignores permission bits), then open the index and search it."""
    try:
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        with Index.open(index_dir) as index:
            found = [[(r.id, r.path, r.score) for r in hits] for hits in index.search(queries, 4, exclude)]
            queue.put((found, index.catalogue.counts()))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent, which fails the test)
        queue.put(repr(exc))


def test_a_read_only_index_folder_can_be_searched(built):
    """Folder and files read-only (chmod 555/444, searched as nobody when run as root): search works and creates
    nothing, although the catalogue's WAL shared memory cannot be created there."""
    work = Path(tempfile.mkdtemp(prefix="retrieval-read-only-"))  # pytest's tmp_path is private to root
    try:
        work.chmod(0o755)
        index_dir = work / "idx"
        shutil.copytree(built[0], index_dir)
        ids, vectors = built[1], built[2]
        queries, exclude = vectors[:6], [int(ids[0]), int(ids[3])]
        with Index.open(index_dir) as index:  # in a writable copy, as the owner: the expected answer
            expected = [[(r.id, r.path, r.score) for r in hits] for hits in index.search(queries, 4, exclude)]
            counts = index.catalogue.counts()
        for leftover in index_dir.glob("catalogue.sqlite-*"):  # as a finished build leaves it: no -shm, no -wal
            leftover.unlink()
        for path in [index_dir, *index_dir.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        before = snapshot(index_dir)
        context = multiprocessing.get_context("spawn")  # a fork copies thread pools (OpenMP, faiss) mid-use: deadlocks
        queue = context.Queue()
        uid = NOBODY if os.geteuid() == 0 else None
        child = context.Process(target=_search_as, args=(uid, index_dir, queries, exclude, queue))
        child.start()
        answer = queue.get(timeout=120)
        child.join(timeout=30)
        assert isinstance(answer, tuple), answer
        found, child_counts = answer
        assert found == expected and child_counts == counts
        assert all(len(hits) == 4 and not {h[0] for h in hits} & set(exclude) for hits in found)
        assert snapshot(index_dir) == before  # not a file added or changed
    finally:
        for path in [work, *work.rglob("*")]:
            path.chmod(0o755)
        shutil.rmtree(work, ignore_errors=True)


# --- one connection per thread -----------------------------------------------------------------------------
def test_threads_search_with_their_own_connections(built):
    index_dir, ids, vectors = built
    with Index.open(index_dir) as index:
        reference = [[(r.id, r.score) for r in hits] for hits in index.search(vectors, 5)]
        barrier = threading.Barrier(8)
        connections = {}

        def worker(t: int) -> list:
            barrier.wait()
            connections[t] = index.catalogue.db
            found = []
            for _ in range(5):
                rows = list(range(t, 40, 8))
                hits = index.search(vectors[rows], 5)
                found += [(row, [(r.id, r.score) for r in h]) for row, h in zip(rows, hits, strict=True)]
            return found

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(worker, range(8)))
        main_connection = index.catalogue.db
    for found in results:
        assert all(hits == reference[row] for row, hits in found)
    assert len({id(c) for c in connections.values()} | {id(main_connection)}) == 9  # one per thread
    for connection in [*connections.values(), main_connection]:  # Index.close closed every thread's
        with pytest.raises(sqlite3.ProgrammingError):
            connection.execute("SELECT 1")


def test_a_removed_image_leaves_the_results_of_an_open_index(built, tmp_path):
    """A writer commits while the index is open: the reader sees it (WAL), and the removed image, still in the
    faiss index loaded before, is left out of the results (which then hold one fewer)."""
    index_dir = tmp_path / "idx"
    shutil.copytree(built[0], index_dir)
    ids, vectors = built[1], built[2]
    with Index.open(index_dir) as index:
        before = [r.id for r in index.search(vectors[0], 5)[0]]
        assert before[0] == ids[0]
        remove_images(index_dir, ids=[int(ids[0])])
        after = [r.id for r in index.search(vectors[0], 5)[0]]
    assert after == before[1:]


# --- excluded ids, k ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("k", "exclude_ranks", "extra"),
    [(5, [0], []), (5, [0, 1, 2, 3, 4], []), (3, [1, 6], [999_999]), (10, list(range(35)), []), (1, [], [])],
)
def test_exclude_ids_against_a_brute_force_loop(built, k, exclude_ranks, extra):
    """Excluded ids never come back, and k results are kept where the index holds enough (35 of 40 excluded:
    5 left); ids are those of a float64 loop, scores too."""
    index_dir, ids, vectors = built
    queries = vectors[[0, 7, 19, 33]]
    with Index.open(index_dir) as index:
        for query in queries:
            ranked = brute_force(query, ids, vectors, 40, set())
            exclude = {ranked[r][0] for r in exclude_ranks} | set(extra)
            expected = brute_force(query, ids, vectors, k, exclude)
            (hits,) = index.search(query, k, exclude_ids=sorted(exclude))
            assert [h.id for h in hits] == [i for i, _ in expected]
            assert [h.score for h in hits] == pytest.approx([s for _, s in expected], abs=1e-5)
            assert len(hits) == min(k, 40 - len(exclude - set(extra)))


def test_k_is_checked_in_one_place(built):
    assert check_k(1) == 1 and check_k(np.int64(MAX_K)) == MAX_K
    for bad in (0, -1, MAX_K + 1, True, 2.5, "3", None):
        with pytest.raises(ValueError, match=f"k must be an integer between 1 and {MAX_K}"):
            check_k(bad)
    with Index.open(built[0]) as index:
        for call in (lambda: index.search(built[2][0], 0), lambda: index.search_arrays(built[2][0], MAX_K + 1)):
            with pytest.raises(ValueError, match="k must be an integer"):
                call()
        with pytest.raises(ValueError, match=f"at most {MAX_K} can be left out"):
            index.search(built[2][0], 5, exclude_ids=range(MAX_K + 1))
    # the CLI refuses it before loading any model
    result = CliRunner().invoke(search_command, ["--index", str(built[0]), "-k", "0", str(built[0] / "index.json")])
    assert result.exit_code == 2 and f"k must be an integer between 1 and {MAX_K}, got 0" in result.output


def test_a_catalogue_from_before_listing_errors_were_kept_is_read(built, tmp_path):
    """Catalogues written before the listing_errors table existed: stats and search read them without a writer."""
    index_dir = tmp_path / "old"
    shutil.copytree(built[0], index_dir)
    with sqlite3.connect(index_dir / "catalogue.sqlite") as db:
        db.execute("DROP TABLE listing_errors")
    stats = index_stats(index_dir, queries=5)
    assert stats["counts"]["done"] == 40 and stats["counts"]["not_listed"] == 0
    with Index.open(index_dir) as index:
        assert index.catalogue.error_examples(5) == [] and len(index) == 40
    assert not _has_table(index_dir / "catalogue.sqlite", "listing_errors")  # the reader created nothing


def _has_table(path: Path, name: str) -> bool:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name=?", (name,)).fetchone() is not None
