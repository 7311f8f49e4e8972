"""The Milvus Lite commands docs/SCALE.md prints, run as written (paths swapped for a test folder's) in fresh
processes, on the Milvus Lite that `make install` installs: the push, the same push again (it resumes and sends
nothing twice), then the serve line the push prints, which answers searches. Neither prints a traceback. A path the
installed Milvus Lite cannot open is refused before anything connects, saying why."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("milvus_lite")

from serve_fixtures import REPO, first_health, free_port  # noqa: E402

from retrieval.index.milvus.milvus_collection import MilvusError, MilvusPlace, lite_version  # noqa: E402

pytestmark = pytest.mark.timeout(300)
SCALE = REPO / "docs" / "SCALE.md"


def documented_lite_commands() -> list[str]:
    """The command lines of SCALE.md's one-machine block (the one whose --milvus is a NAME.db path)."""
    blocks = re.findall(r"```bash\n(.*?)```", SCALE.read_text(), re.S)
    block = next(b for b in blocks if "--milvus /data/gallery.db" in b)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.startswith("retrieval ")]


def run(line: str, cwd: Path) -> subprocess.CompletedProcess:
    words = shlex.split(line)
    return subprocess.run([sys.executable, "-m", "retrieval", *words[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=240, env=os.environ | {"PYTHONIOENCODING": "utf-8"})


def test_the_documented_lite_push_and_serve_run_as_written(artifacts, tmp_path):
    import httpx

    index_dir = tmp_path / "index"
    shutil.copytree(artifacts.index_dir, index_dir)
    lines = [line.replace("/data/index", str(index_dir)).replace("/data/gallery.db", str(tmp_path / "gallery.db"))
             for line in documented_lite_commands()]
    push, serve = lines
    first, again = run(push, tmp_path), run(push, tmp_path)
    for result in (first, again):
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
        assert f"next: {serve}" in result.stdout  # the serve line the docs show is the one the push prints
    rows = len(artifacts.labels)
    assert f"{rows} sent" in first.stdout and f"0 sent, 0 deleted, {rows} already there" in again.stdout
    assert (tmp_path / "gallery.db").is_dir() == (int(lite_version().split(".")[0]) >= 3)

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "retrieval", *shlex.split(serve)[1:], "--port", str(port)],
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        health = first_health(url, process, 180)
        assert health.status_code == 200 and health.json()["vectors"] == rows
        found = httpx.post(f"{url}/search", files={"image": ("q.png", artifacts.query_paths[0].read_bytes())},
                           params={"k": 3}, timeout=60)
        assert found.status_code == 200, found.text
        assert len(found.json()["results"]) == 3
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert "Traceback" not in output, output[-3000:]


def test_a_lite_store_of_the_other_version_is_refused_before_connecting(tmp_path):
    major = int(lite_version().split(".")[0])
    other = tmp_path / "other.db"
    if major >= 3:  # a Milvus Lite 2 database is one file
        other.write_bytes(b"SQLite format 3\x00")
        expected = "Milvus Lite 2 database (one file)"
    else:
        other.mkdir()
        expected = "keeps a database in one file"
    with pytest.raises(MilvusError, match=re.escape(expected)):
        MilvusPlace.checked(str(other), "gallery")


def test_a_folder_of_other_files_is_never_taken_for_a_lite_store(tmp_path):
    if int(lite_version().split(".")[0]) < 3:
        pytest.skip("Milvus Lite 2 keeps a file: a folder is refused as the other version's")
    folder = tmp_path / "photos.db"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"not milvus")
    with pytest.raises(MilvusError, match="holds no Milvus Lite database"):
        MilvusPlace.checked(str(folder), "gallery")
