"""`retrieval index build --embeddings DIR`: an index of vectors someone already has (an export of ours, autofaiss'
or clip-retrieval's layout), with no images and no model; the input read as hostile; searched by embedding."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from embedders import FakeEmbedder
from index_builds import write_embeddings_folder
from sample_images import png_bytes, write_images

from retrieval.cli.main import main
from retrieval.errors import ParameterError
from retrieval.index import (
    Catalogue,
    Index,
    add_images,
    build_from_embeddings,
    build_index,
    index_stats,
    remove_images,
    repair_index,
)
from retrieval.index.embedding.engine import IngestOptions
from retrieval.index.faiss_backend import faiss_keys
from retrieval.index.faiss_backend.faiss_params import index_ids
from retrieval.index.formats.embedding_checks import MAX_DIM
from retrieval.index.formats.table_export import export_index
from retrieval.index.query_embedder import NoModelError
from retrieval.index.shards import ShardStore
from retrieval.index.sources import MAX_EXTRA_CHARS, MAX_LABEL_CHARS
from retrieval.index.vectors import done_chunks

QUICK = IngestOptions(workers=0, shard_size=4, progress=False)  # several shards even for a few rows
DIM = 24


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def answers(found) -> list[list[tuple]]:
    return [[(r.id, r.path, r.label, r.score) for r in results] for results in found]


def stored(index_dir: Path) -> dict[int, np.ndarray]:
    """id -> the vector the shards hold for each indexed row."""
    with Catalogue(index_dir / "catalogue.sqlite") as catalogue:
        done = catalogue.done_shards()
    out = {}
    for ids, vectors in done_chunks(ShardStore(index_dir / "shards", read_only=True), done):
        out.update(zip(ids.tolist(), vectors, strict=True))
    return out


def nothing_recorded(out: Path) -> bool:
    """No build record and no catalogued row in ``out`` (the folder may not even exist)."""
    if not (out / "catalogue.sqlite").exists():
        return True
    with Catalogue(out / "catalogue.sqlite") as catalogue:
        return catalogue.get_meta("state") is None and catalogue.counts()["total"] == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """An image index built from a manifest with columns of its own, one image removed (ids have a gap), and its
    npy export in three parts."""
    root = tmp_path_factory.mktemp("from_embeddings")
    gallery = root / "gallery"
    write_images(gallery / "cat", 5, 0)
    write_images(gallery / "dog", 4, 10)
    write_images(gallery, 1, 20)
    lines = ["path,label,split,price"] + [
        f"{path.relative_to(gallery).as_posix()},{path.parent.name if path.parent != gallery else ''},"
        f"{'test' if n % 3 == 0 else 'train'},{n * 1.5}"
        for n, path in enumerate(sorted(gallery.rglob("*.png")))]
    (gallery / "manifest.csv").write_text("\n".join(lines) + "\n")
    build_index(gallery / "manifest.csv", root / "idx", embedder=FakeEmbedder(DIM), options=QUICK)
    remove_images(root / "idx", ids=[2])
    export_index(root / "idx", root / "export", "npy", rows_per_file=3, progress=False)
    return root / "idx", root / "export", gallery


def test_an_exported_index_builds_again_with_the_same_rows_vectors_and_answers(exported, tmp_path):
    """export (npy) -> build --embeddings -> export gives the same files: ids (with their gap), paths, labels, the
    manifest's columns, sha256, size and the vectors bit for bit; and the two indexes answer alike, filters too."""
    idx, export, _ = exported
    # the export's gallery lies beside it, not in it: building it again takes the operator's word
    summary = build_from_embeddings(export, tmp_path / "again", options=QUICK, allow_outside_paths=True)
    assert summary["indexed"] == 9 and summary["source"] == "embeddings" and summary["labels"]["classes"] == 2
    export_index(tmp_path / "again", tmp_path / "export2", "npy", rows_per_file=3, progress=False)
    first, second = sorted((export / "metadata").iterdir()), sorted((tmp_path / "export2" / "metadata").iterdir())
    assert [p.name for p in first] == [p.name for p in second]
    for a, b in zip(first, second, strict=True):
        assert pq.read_table(a).equals(pq.read_table(b)), a.name
    assert pq.read_table(first[0]).column_names == ["id", "path", "label", "split", "sha256", "size", "price"]
    for a in sorted((export / "embeddings").iterdir()):
        assert np.load(a).tobytes() == np.load(tmp_path / "export2" / "embeddings" / a.name).tobytes()
    info = json.loads((tmp_path / "again" / "index.json").read_text())
    assert info["model_path"] is None and info["model_hash"] is None and info["source"] == "embeddings"
    assert info["embedding_dim"] == DIM and info["gallery_root"] == json.loads((idx / "index.json").read_text())[
        "gallery_root"]
    queries = np.random.default_rng(1).standard_normal((4, DIM)).astype(np.float32)
    with Index.open(idx) as before, Index.open(tmp_path / "again") as after:
        assert 2 not in after.ids and answers(after.search(queries, 5)) == answers(before.search(queries, 5))
        where = 'split = "train" and price > 2'
        assert answers(after.search(queries, 5, where=where)) == answers(before.search(queries, 5, where=where))
        assert {r.label for r in after.search(queries, 9, where='label = "dog"')[0]} == {"dog"}


def test_a_clip_retrieval_folder_without_metadata_is_indexed_by_place(tmp_path):
    """img_emb/img_emb_N.npy alone: float64 and float16 parts, not of unit length; ids by place from 1, paths made
    from the part and row, no labels, the vectors normalised."""
    rng = np.random.default_rng(0)
    parts = [3 * rng.standard_normal((7, 16)), rng.standard_normal((5, 16)).astype(np.float16)]
    write_embeddings_folder(tmp_path / "clip", parts, folder="img_emb")
    summary = build_from_embeddings(tmp_path / "clip", tmp_path / "idx", options=QUICK)
    assert summary["indexed"] == 12 and summary["labels"]["classes"] == 0
    expected = unit(np.concatenate([p.astype(np.float64) for p in parts]))
    vectors = stored(tmp_path / "idx")
    assert sorted(vectors) == list(range(1, 13))
    np.testing.assert_allclose(np.stack([vectors[i] for i in range(1, 13)]), expected, atol=1e-6)
    with Index.open(tmp_path / "idx") as index:
        found = index.search(expected, 1)
        assert [r[0].id for r in found] == list(range(1, 13))
        assert [index.public_path(r[0].path) for r in found[6:8]] == ["img_emb/img_emb_0.npy#6",
                                                                       "img_emb/img_emb_1.npy#0"]
        assert {r[0].label for r in found} == {None}


def test_metadata_urls_name_the_rows_and_their_columns_filter(tmp_path):
    """clip-retrieval's metadata: a url column names each row (kept as it is), a caption is a column to filter on,
    and `index remove` takes a row back by its URL."""
    rng = np.random.default_rng(2)
    urls = [f"https://example.org/img/{i}.jpg" for i in range(6)]
    write_embeddings_folder(tmp_path / "clip", [rng.standard_normal((6, 8)).astype(np.float32)],
                            [{"url": urls, "caption": ["a cat", "a dog"] * 3, "key": list(range(6))}], "img_emb")
    build_from_embeddings(tmp_path / "clip", tmp_path / "idx", options=QUICK)
    with Index.open(tmp_path / "idx") as index:
        rows = index.indexed_rows(list(range(1, 7)))
        assert [index.public_path(rows[i]["path"]) for i in range(1, 7)] == [rows[i]["path"] for i in range(1, 7)] \
            == urls
        assert index.matching_ids('caption = "a dog" and key > 2').tolist() == [4, 6]
    removed = remove_images(tmp_path / "idx", paths=[urls[3]])
    assert removed["removed_ids"] == [4] and removed["indexed"] == 5


def test_a_pickled_npy_is_refused_from_its_header_without_unpickling(tmp_path):
    """A .npy of Python objects is refused from its header: nothing is unpickled (np.load would need
    allow_pickle=True to read it at all)."""
    folder = tmp_path / "in" / "embeddings"
    folder.mkdir(parents=True)
    objects = np.empty((2, 4), dtype=object)
    objects[:] = {"a": 1}
    np.save(folder / "part-00000.npy", objects, allow_pickle=True)
    with pytest.raises(ValueError, match=r"part-00000\.npy holds Python objects \(a pickle\)"):
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)
    assert not (tmp_path / "out").exists()


def _write(root: Path, parts: list[np.ndarray], metadata: list[dict] | None = None) -> None:
    write_embeddings_folder(root, parts, metadata)


def _rows(n: int, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def _with(rows: np.ndarray, row: int, value: float) -> np.ndarray:
    rows = rows.copy()
    rows[row] = value
    return rows


def _truncated(root: Path) -> None:
    _write(root, [_rows(4)])
    path = root / "embeddings" / "part-00000.npy"
    path.write_bytes(path.read_bytes()[:-8])


HOSTILE = {
    # name: (writes the input folder, the file the message names, what it says)
    "3-D array": (lambda r: _write(r, [np.zeros((2, 3, 4), np.float32)]), "embeddings/part-00000.npy",
                  "holds a 3-D array of shape (2, 3, 4)"),
    "mixed d": (lambda r: _write(r, [_rows(3), _rows(3, d=6)]), "embeddings/part-00001.npy", "holds 6-d vectors"),
    "NaN": (lambda r: _write(r, [_rows(3), _with(_rows(4), 2, np.nan)]), "embeddings/part-00001.npy row 2",
            "not finite"),
    "zero row": (lambda r: _write(r, [_with(_rows(4), 1, 0.0)]), "embeddings/part-00000.npy row 1", "is all zeros"),
    "integers": (lambda r: _write(r, [np.ones((2, 4), np.int64)]), "embeddings/part-00000.npy",
                 "holds int64 values, not floats"),
    "not a .npy": (lambda r: (r / "embeddings").mkdir(parents=True) or
                   (r / "embeddings" / "part-00000.npy").write_bytes(b"hello"), "embeddings/part-00000.npy",
                   "is not a .npy file"),
    "cut short": (_truncated, "embeddings/part-00000.npy", "cut short"),
    "metadata rows": (lambda r: _write(r, [_rows(3), _rows(3, seed=1)], [{"path": ["a", "b", "c"]},
                                                                          {"path": ["d", "e"]}]),
                      "metadata/part-00001.parquet holds 2 rows", "embeddings/part-00001.npy holds 3 vectors"),
    "metadata parts": (lambda r: _write(r, [_rows(3), _rows(3, seed=1)], [{"path": ["a", "b", "c"]}]),
                       "metadata holds 1 .parquet parts for 2 .npy parts", "needs its metadata"),
    "same path twice": (lambda r: _write(r, [_rows(3)], [{"path": ["a.jpg", "b.jpg", "a.jpg"]}]),
                        "metadata/part-00000.parquet row 2", "is another row's too"),
    "empty folder": (lambda r: r.mkdir(), "in holds no embeddings or img_emb folder", "give the folder"),
    "no .npy": (lambda r: (r / "embeddings").mkdir(parents=True), "embeddings holds no .npy files", "numpy.save"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_refused_naming_the_file_and_nothing_is_recorded(tmp_path, case):
    write, names, says = HOSTILE[case]
    write(tmp_path / "in")
    with pytest.raises(ValueError) as refused:
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)
    message = str(refused.value)
    assert names in message and says in message, message
    assert nothing_recorded(tmp_path / "out")


def test_a_refused_input_once_fixed_builds_in_the_same_folder(tmp_path):
    good = _rows(6)
    _write(tmp_path / "in", [_with(good, 4, np.inf)])
    with pytest.raises(ValueError, match="part-00000.npy row 4 holds a value that is not finite"):
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK, chunk_rows=2)  # a later chunk
    np.save(tmp_path / "in" / "embeddings" / "part-00000.npy", good)
    assert build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)["indexed"] == 6


class Killed(Exception):
    """The build's process dying, as far as the build can tell."""


def _interrupted(tmp_path: Path, monkeypatch) -> tuple[Path, np.ndarray]:
    """A build of 30 rows (3 parts, shards of 4) killed after its third shard file was written but before its rows
    were recorded."""
    parts = [_rows(10, seed=n) for n in range(3)]
    _write(tmp_path / "in", parts, [{"label": [f"c{i % 3}" for i in range(10)]} for _ in parts])
    write, written = ShardStore.write, []

    def write_then_die(self, ids, vectors, outcomes):
        written.append(write(self, ids, vectors, outcomes))
        if len(written) == 3:
            raise Killed()
        return written[-1]

    monkeypatch.setattr(ShardStore, "write", write_then_die)
    with pytest.raises(Killed):
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK, chunk_rows=7)
    monkeypatch.setattr(ShardStore, "write", write)
    return tmp_path / "out", unit(np.concatenate(parts))


@pytest.mark.parametrize("finish", ["the same build again", "repair"])
def test_an_interrupted_build_resumes_where_it_stopped(tmp_path, monkeypatch, finish):
    out, expected = _interrupted(tmp_path, monkeypatch)
    with pytest.raises(FileNotFoundError, match="not finished"):
        Index.open(out)
    if finish == "repair":
        summary = repair_index(out, options=QUICK)
    else:
        summary = build_from_embeddings(tmp_path / "in", out, options=QUICK, chunk_rows=7)
    assert summary["reconciled_rows"] == 4 and summary["indexed"] == 30  # the shard written before the kill
    names = ShardStore(out / "shards").names()
    assert len(names) == 8  # 30 rows in shards of 4: none written twice
    shard_ids = np.concatenate([ShardStore(out / "shards").read_ids(name) for name in names])
    assert sorted(shard_ids.tolist()) == list(range(1, 31))
    vectors = stored(out)
    np.testing.assert_allclose(np.stack([vectors[i] for i in range(1, 31)]), expected, atol=1e-6)
    with Index.open(out) as index:
        assert sorted(index_ids(index.faiss_index).tolist()) == list(range(1, 31))
        assert index.search(expected[11:12], 1)[0][0].label == "c1"  # part 1, row 1


def test_a_resumed_build_refuses_an_input_that_changed(tmp_path, monkeypatch):
    out, _ = _interrupted(tmp_path, monkeypatch)
    np.save(tmp_path / "in" / "embeddings" / "part-00002.npy", _rows(10, seed=9))
    with pytest.raises(FileExistsError, match="are not those the interrupted build"):
        build_from_embeddings(tmp_path / "in", out, options=QUICK)


@pytest.fixture(scope="module")
def from_embeddings(tmp_path_factory):
    """An index built from 40 labelled vectors with metadata (paths relative to the input folder)."""
    root = tmp_path_factory.mktemp("no_model")
    vectors = _rows(40, d=DIM, seed=3)
    metadata = {"path": [f"photos/{i}.jpg" for i in range(40)], "label": [f"c{i % 4}" for i in range(40)]}
    write_embeddings_folder(root / "in", [vectors], [metadata])
    build_from_embeddings(root / "in", root / "idx", options=QUICK)
    return root, unit(vectors)


def test_what_needs_a_model_is_refused_saying_what_works_instead(from_embeddings, tmp_path):
    root, _ = from_embeddings
    (tmp_path / "q.png").write_bytes(png_bytes())
    with Index.open(root / "idx") as index, pytest.raises(NoModelError, match="built from embeddings") as refused:
        index.search_images([tmp_path / "q.png"])
    assert "Index.search" in str(refused.value) and f"{DIM} numbers" in str(refused.value)
    with pytest.raises(NoModelError, match="no model is known to embed into their space"):
        Index.open(root / "idx", embedder=FakeEmbedder(DIM))
    write_images(tmp_path / "more", 2, 0)
    with pytest.raises(NoModelError, match="images cannot be added to it"):
        add_images(root / "idx", tmp_path / "more", embedder=FakeEmbedder(DIM), options=QUICK)
    from retrieval.index.writing.upgrade import upgrade_index

    with pytest.raises(NoModelError, match="build an index of the images with the new model"):
        upgrade_index(root / "idx", embedder=FakeEmbedder(DIM))
    from retrieval.index.curation.duplicates import DuplicateOptions, find_duplicates

    with Index.open(root / "idx") as index, pytest.raises(ParameterError, match="threshold auto embeds copies"):
        find_duplicates(index, DuplicateOptions("auto"))
    result = CliRunner().invoke(main, ["search", "--index", str(root / "idx"), str(tmp_path / "q.png")])
    assert result.exit_code == 1 and "built from embeddings and has no model" in result.output, result.output
    assert "Traceback" not in result.output


def test_stats_remove_and_export_work_without_a_model(from_embeddings, tmp_path):
    root, vectors = from_embeddings
    import shutil

    shutil.copytree(root / "idx", tmp_path / "idx")
    stats = index_stats(tmp_path / "idx", queries=20)
    assert stats["recall_10_at_10"] == 1.0 and stats["vectors"] == 40  # Flat: exact
    assert stats["model"]["source"] == "embeddings" and stats["model"]["model_hash"] is None
    removed = remove_images(tmp_path / "idx", ids=[3], paths=["photos/7.jpg"])
    assert removed["removed_ids"] == [3, 8] and removed["indexed"] == 38
    with Index.open(tmp_path / "idx") as index:
        assert {r.id for r in index.search(vectors[[2, 7]], 40)[0]}.isdisjoint({3, 8})
    summary = export_index(tmp_path / "idx", tmp_path / "export", "npy", progress=False)
    table = pq.read_table(tmp_path / "export" / "metadata" / "part-00000.parquet")
    assert summary["rows"] == 38 and summary["model_hash"] is None
    assert table.column("path").to_pylist()[:3] == ["photos/0.jpg", "photos/1.jpg", "photos/3.jpg"]


def test_the_memory_budget_chooses_the_index_type(tmp_path):
    """--max-index-memory below what exact search needs: the best key that fits, as for images; an explicit key
    over it is refused naming the option."""
    n, d = 600, 32
    centres = np.random.default_rng(5).standard_normal((12, d))
    x = centres[np.random.default_rng(6).integers(0, 12, n)] + 0.3 * np.random.default_rng(7).standard_normal((n, d))
    write_embeddings_folder(tmp_path / "in", [x.astype(np.float32)])
    budget = faiss_keys.estimated_index_bytes("Flat", n, d) - 1
    expected = faiss_keys.choose_index_key(n, d, policy=faiss_keys.AutoPolicy(max_index_memory=budget))
    assert expected != "Flat"
    args = ["index", "build", "--embeddings", str(tmp_path / "in"), "--shard-size", "256"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "idx"), "--max-index-memory", str(budget)])
    assert result.exit_code == 0, result.output
    info = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert info["index_key"] == expected and info["budget"]["memory_met"]
    assert info["budget"]["estimated_bytes"] <= budget == info["budget"]["max_index_memory"]
    over = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "flat"), "--index-key", "Flat",
                                     "--max-index-memory", "1K"])
    assert over.exit_code == 1 and "--index-key Flat needs about" in over.output, over.output


def test_the_command_line_takes_one_of_the_two_ways_to_build(from_embeddings, tmp_path):
    root, _ = from_embeddings
    build = ["index", "build", "--out", str(tmp_path / "idx")]
    both = CliRunner().invoke(main, [*build, "--embeddings", str(root / "in"), "--images", str(tmp_path)])
    assert both.exit_code == 2 and "leave out --images and --model" in both.output
    neither = CliRunner().invoke(main, build)
    assert neither.exit_code == 2 and "give --images and --model" in neither.output and "--embeddings DIR" in \
        neither.output
    split = CliRunner().invoke(main, [*build, "--embeddings", str(root / "in"), "--split", "train", "--workers", "2"])
    assert split.exit_code == 2 and "--split, --workers apply to a build from images" in split.output
    missing = CliRunner().invoke(main, [*build, "--embeddings", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and f"--embeddings {tmp_path / 'nope'} does not exist" in missing.output
    built = CliRunner().invoke(main, [*build, "--embeddings", str(root / "in")])
    assert built.exit_code == 0, built.output
    lines = built.output.splitlines()
    assert lines[-2].startswith(f"indexed 40 {DIM}-d embeddings of ") and "4 classes from the label column" in lines[-2]
    assert lines[-1].startswith("next: retrieval index stats ")
    again = CliRunner().invoke(main, [*build, "--embeddings", str(root / "in")])
    assert again.exit_code == 1 and "already holds a finished index" in again.output


def _sparse_npy(path: Path, rows: int, d: int) -> None:
    """A float32 .npy of ``rows`` x ``d`` whose data is a hole in a sparse file (no disk used): its header written by
    hand, its first value 1 so that the first row is not all zeros."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, {"descr": "<f4", "fortran_order": False, "shape": (rows, d)})
        start = handle.tell()
        handle.write(np.float32(1).tobytes())
        handle.truncate(start + 4 * rows * d)


@pytest.mark.parametrize("d", [MAX_DIM + 1, 10**8])
def test_a_dimension_over_the_bound_is_refused_from_the_header_before_anything_is_allocated(tmp_path, d):
    """One row of 10^8 floats (400 MB, a hole on disk) is refused from its header, naming the file, its d and the
    bound: nothing read, nothing allocated, nothing recorded."""
    _sparse_npy(tmp_path / "in" / "embeddings" / "part-00000.npy", 1, d)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError) as refused:
            build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(refused.value)
    assert f"embeddings/part-00000.npy holds {d}-d vectors" in message and f"at most {MAX_DIM}" in message, message
    assert peak < 4 * 2**20, peak  # a row of that d alone would be 256 KB to 400 MB, its float64 copy twice that
    assert nothing_recorded(tmp_path / "out")


def test_a_dimension_at_the_bound_builds(tmp_path):
    write_embeddings_folder(tmp_path / "in", [_rows(2, d=MAX_DIM)])
    assert build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)["embedding_dim"] == MAX_DIM


def _with_metadata(root: Path, columns: dict[str, list], **write) -> Path:
    """An input folder of one part: random vectors, one per row of ``columns``, and their metadata part written by
    pyarrow (zstd unless ``write`` says otherwise, as a bomb would be)."""
    rows = len(next(iter(columns.values())))
    write_embeddings_folder(root, [_rows(rows)])
    (root / "metadata").mkdir()
    pq.write_table(pa.table(columns), root / "metadata" / "part-00000.parquet", **{"compression": "zstd", **write})
    return root / "metadata" / "part-00000.parquet"


@pytest.mark.parametrize("column", ["label", "caption", "path", "sha256"])
def test_a_compressed_bomb_is_refused_from_the_parquet_metadata_before_it_is_read(tmp_path, monkeypatch, column):
    """A 2 MB value that zstd stores in a few kilobytes is refused from the column chunk's uncompressed size in the
    file's metadata, naming the file, the column, the row group, its size and the bound; no value is read."""
    part = _with_metadata(tmp_path / "in", {column: ["a" * 2_000_000, "b"]})
    assert part.stat().st_size < 20_000
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", lambda *a, **k: pytest.fail("a metadata value was read"))
    with pytest.raises(ValueError) as refused:
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)
    message = str(refused.value)
    size = pq.ParquetFile(part).metadata.row_group(0).column(0).total_uncompressed_size
    assert f"metadata/part-00000.parquet: column {column!r} of row group 0 (2 rows) holds {size:,} bytes" in message, \
        message
    assert "more than the " in message and "write the part again" in message, message
    assert nothing_recorded(tmp_path / "out")


@pytest.mark.parametrize("column, bound", [("caption", MAX_EXTRA_CHARS), ("label", MAX_LABEL_CHARS)])
def test_a_value_over_its_bound_is_refused_naming_its_row_never_cut(tmp_path, column, bound):
    """A value just over its bound passes the column's size check (its row group's bound is the sum) and is refused
    by itself, naming the file and the row: an extra column's value too, never cut to fit."""
    _with_metadata(tmp_path / "in", {column: ["a", "x" * (bound + 1), "c"]})
    with pytest.raises(ValueError) as refused:
        build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)
    message = str(refused.value)
    assert "metadata/part-00000.parquet row 1: its" in message and f"has {bound + 1} characters, more than {bound}" \
        in message, message
    assert nothing_recorded(tmp_path / "out")


@pytest.mark.parametrize("write", [{"row_group_size": 1}, {"use_dictionary": False}, {"compression": "none"},
                                   {"data_page_size": 1, "write_page_index": True}])
def test_metadata_with_every_value_at_its_bound_builds(tmp_path, write):
    """The size check never refuses an honest file: every value at its bound in 4-byte characters (the most bytes a
    character takes), however pyarrow lays the pages out, statistics included."""
    wide = "\U0001F600"
    columns = {"path": [f"{wide * 200}/{n}.jpg" for n in range(3)], "label": [wide * MAX_LABEL_CHARS] * 3,
               "caption": [wide * MAX_EXTRA_CHARS, wide * (MAX_EXTRA_CHARS - 1), "a"], "sha256": ["ab" * 32] * 3,
               "size": [1, 2, 3], "id": [5, 6, 7], "price": [1.5, 2.5, None]}
    _with_metadata(tmp_path / "in", columns, **write)
    assert build_from_embeddings(tmp_path / "in", tmp_path / "out", options=QUICK)["indexed"] == 3
    with Index.open(tmp_path / "out") as index:
        assert index.indexed_rows([6])[6]["label"] == wide * MAX_LABEL_CHARS


def _outside(root: Path, how: str) -> str:
    """A metadata path that names ``private/secret.png`` beside the input folder ``root``, written ``how``."""
    secret = root.parent / "private" / "secret.png"
    secret.parent.mkdir(exist_ok=True)
    secret.write_bytes(png_bytes())
    if how == "absolute":
        return str(secret)
    if how == "dot-dot":
        return "photos/../../private/secret.png"
    os.symlink(secret.parent, root / "photos")  # inside by its name, outside once the link is followed
    return "photos/secret.png"


@pytest.mark.parametrize("how", ["absolute", "dot-dot", "symlink"])
def test_a_metadata_path_outside_the_input_folder_is_refused_unless_allowed(tmp_path, how):
    """A server sends a catalogued file to whoever searches: a path resolving outside the folder the input's paths
    are taken from is refused, naming the row, the path, the folder and the parameter that allows it."""
    root = tmp_path / "in"
    root.mkdir()
    path = _outside(root, how)
    _with_metadata(root, {"path": ["cats/a.jpg", path, "https://example.org/c.jpg"]})  # not through the link
    with pytest.raises(ValueError) as refused:
        build_from_embeddings(root, tmp_path / "out", options=QUICK)
    message = str(refused.value)
    assert "metadata/part-00000.parquet row 1: its path" in message and path in message, message
    assert f"outside {root.resolve()}" in message and "`allow_outside_paths`" in message, message
    assert nothing_recorded(tmp_path / "out")
    build_from_embeddings(root, tmp_path / "out", options=QUICK, allow_outside_paths=True)
    with Catalogue(tmp_path / "out" / "catalogue.sqlite") as catalogue:
        assert os.path.realpath(catalogue.rows([2])[2]["path"]) == str(tmp_path / "private" / "secret.png")


def test_the_command_line_allows_outside_paths_only_when_asked(tmp_path):
    root = tmp_path / "in"
    root.mkdir()
    path = _outside(root, "absolute")
    _with_metadata(root, {"path": ["photos/a.jpg", path]})
    build = ["index", "build", "--embeddings", str(root)]
    shown = CliRunner().invoke(main, ["index", "build", "--help"], terminal_width=200).output
    assert "--allow-outside-paths" in shown and "outside DIR" in shown, shown
    refused = CliRunner().invoke(main, [*build, "--out", str(tmp_path / "idx")])
    assert refused.exit_code == 1 and "give --allow-outside-paths" in refused.output and path in refused.output, \
        refused.output
    assert "Traceback" not in refused.output
    allowed = CliRunner().invoke(main, [*build, "--out", str(tmp_path / "idx"), "--allow-outside-paths"])
    assert allowed.exit_code == 0, allowed.output
    images = CliRunner().invoke(main, ["index", "build", "--images", str(root), "--model", "m.onnx", "--out",
                                       str(tmp_path / "other"), "--allow-outside-paths"])
    assert images.exit_code == 2 and "--allow-outside-paths applies to a build from --embeddings" in images.output, \
        images.output


def test_an_export_record_naming_a_root_outside_the_input_is_refused_unless_allowed(exported, tmp_path):
    """A forged _export.json naming "/" as the gallery root would make every absolute path "inside": the recorded
    root must itself lie in the input folder, or the operator allows it."""
    import shutil

    _, export, _ = exported
    forged = tmp_path / "forged"
    shutil.copytree(export, forged)
    record = json.loads((forged / "_export.json").read_text())
    (forged / "_export.json").write_text(json.dumps(record | {"gallery_root": "/"}))
    with pytest.raises(ValueError) as refused:
        build_from_embeddings(forged, tmp_path / "out", options=QUICK)
    message = str(refused.value)
    assert "_export.json takes the input's paths from /, outside" in message and "`allow_outside_paths`" in message
    assert nothing_recorded(tmp_path / "out")
    # the same export, its gallery moved into it, builds as it is
    (forged / "_export.json").write_text(json.dumps(record | {"gallery_root": str(forged.resolve())}))
    assert build_from_embeddings(forged, tmp_path / "inside", options=QUICK)["indexed"] == 9
