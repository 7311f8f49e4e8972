"""retrieval.utils.io.atomic_write: the one write-then-rename helper (index files, checkpoints, reports, caches)."""

import os
import stat

import numpy as np
import pytest

from retrieval.utils.io import TEMPORARY_GLOB, atomic_write


def test_writes_bytes_text_and_writer_output(tmp_path):
    atomic_write(tmp_path / "a.bin", b"\x00\x01")
    atomic_write(tmp_path / "b.txt", "h\u00e9\n")

    def save(tmp):
        with tmp.open("wb") as handle:
            np.save(handle, np.arange(3))

    atomic_write(tmp_path / "c.npy", save)
    assert (tmp_path / "a.bin").read_bytes() == b"\x00\x01"
    assert (tmp_path / "b.txt").read_bytes() == "h\u00e9\n".encode()
    assert np.load(tmp_path / "c.npy").tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.txt", "c.npy"]  # no temporary left


def test_replaces_an_existing_file_and_keeps_it_when_the_writer_fails(tmp_path):
    path = tmp_path / "report.json"
    atomic_write(path, "old")
    atomic_write(path, "new")
    assert path.read_text() == "new"

    seen = []

    def broken(tmp):
        seen.append(tmp)
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, broken)
    assert path.read_text() == "new"
    assert seen[0].parent == tmp_path and seen[0].match(TEMPORARY_GLOB)  # same folder, a name cleaners know
    assert not seen[0].exists()


def test_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "index.faiss", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "index.faiss").stat().st_mode) == 0o644  # readable by a server's user
