"""Reading back the files a training run writes in its folder."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """One dict per line of a JSON-lines file."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def metrics_rows(run: Path) -> list[dict]:
    """A run's metrics.jsonl: one row per evaluated or trained epoch, in order."""
    return read_jsonl(run / "metrics.jsonl")
