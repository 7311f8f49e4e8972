"""The default number of DataLoader worker processes of training, evaluation and indexing (torch-free: the CLI's
help states it)."""

from __future__ import annotations

import os

MAX_DEFAULT_WORKERS = 4
DEFAULT_WORKERS_TEXT = f"cores - 1, at most {MAX_DEFAULT_WORKERS}"  # the rule, as help texts state it


def default_workers() -> int:
    """Worker processes when none are asked for: one core is left to the main process, at most MAX_DEFAULT_WORKERS."""
    return min(MAX_DEFAULT_WORKERS, max(0, (os.cpu_count() or 1) - 1))
