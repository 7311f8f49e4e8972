"""Serving loads no torch: search runs on onnxruntime, and torch takes seconds to import.

Each check runs in a fresh process: a module imported by this pytest process proves nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# what the driver prints last: the torch modules it loaded (none, we hope)
LOADED_TORCH = "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'torchvision')))[:5])"

SERVE = f"""
import sys
from pathlib import Path
from retrieval.serve.service import SearchService

service = SearchService(sys.argv[1])
response = service.search(Path(sys.argv[2]).read_bytes(), k=3)
assert len(response.results) == 3 and response.query_item is not None
assert service.index_stats()["vectors"] == len(service)
assert service.leave_one_out().queries > 0
service.close()
{LOADED_TORCH}
"""

# a click command run in this process (``python -m retrieval`` runs ``retrieval.cli.main:main``), then its modules
RUN_COMMAND = f"""
import importlib, sys
module, name = sys.argv[1].split(":")
getattr(importlib.import_module(module), name).main(sys.argv[2:], prog_name="retrieval", standalone_mode=False)
{LOADED_TORCH}
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_a_search_service_answers_without_torch(artifacts):
    """Open the service on a real index, search by image bytes, index stats and leave-one-out diagnostics."""
    result = _run(SERVE, str(artifacts.index_dir), str(artifacts.query_paths[0]))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-2000:]


@pytest.mark.parametrize("command", ["retrieval.cli.main:main", "retrieval.cli.index:search_command"])
def test_retrieval_search_loads_no_torch(artifacts, command):
    """``retrieval search`` (the ``retrieval`` group, as ``python -m retrieval`` runs it) and the command alone."""
    args = ["--index", str(artifacts.index_dir), "-k", "2", "--json", str(artifacts.query_paths[0])]
    result = _run(RUN_COMMAND, command, *(["search", *args] if command.endswith(":main") else args))
    assert result.returncode == 0, result.stderr[-3000:]
    *output, loaded = result.stdout.strip().splitlines()
    assert len(json.loads("\n".join(output))[0]["results"]) == 2
    assert loaded == "[]", loaded
