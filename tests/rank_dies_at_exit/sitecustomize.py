"""In the first attempt of a torchrun job, rank 1 dies (SIGKILL) as it exits, once rank 0 has finished: the moment a
`kill` of a rank lands on a run that has just ended (torchrun then restarts every rank, rank 0 included).

Python imports this module at start-up in every process whose PYTHONPATH names this folder; it acts only in the
ranks of a job whose environment gives RANK_DIES_AT_EXIT (a marker file's path: rank 0 creates it as it exits,
after flushing its output; rank 1 waits for it, then kills itself).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

MARKER = os.environ.get("RANK_DIES_AT_EXIT")
WAIT_S = 120  # rank 0 finishes long before; the bound only keeps a broken job from hanging


def rank_0_done(marker: Path) -> None:
    sys.stdout.flush()  # what rank 0 printed is out before rank 1's death stops it
    sys.stderr.flush()
    marker.touch()


def rank_1_dies(marker: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)


if MARKER and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    if os.environ.get("RANK") == "0":
        atexit.register(rank_0_done, Path(MARKER))
    elif os.environ.get("RANK") == "1":
        atexit.register(rank_1_dies, Path(MARKER))
