"""A run stopped inside an epoch, as a kill would stop it, and the check that its resume is the uninterrupted run:
the same weights and the same metrics.jsonl rows (times aside)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_files import read_jsonl

from retrieval.train.state import TIMING_KEYS


def checkpoint(run: Path, name: str = "last.pt") -> dict:
    return torch.load(run / name, map_location="cpu", weights_only=False)


class Crash(RuntimeError):
    """What the test raises to stop a run, as a kill would, right after a checkpoint is on disk."""


def crash_after(monkeypatch, epoch: int, batch: int) -> None:
    """Make the trainer stop (an exception) once it has saved the mid-epoch checkpoint at (epoch, batch)."""
    import retrieval.train.checkpointing as checkpointing

    save = checkpointing.atomic_save

    def save_then_crash(state, path):
        save(state, path)
        position = state.get("in_epoch") or {}
        if (position.get("epoch"), position.get("batch")) == (epoch, batch):
            raise Crash(f"stopped at {epoch}:{batch}")

    monkeypatch.setattr(checkpointing, "atomic_save", save_then_crash)


def flat(value, prefix: str = "") -> dict:
    """Nested dicts and lists (metrics.jsonl rows, the WiSE-FT record) as one flat dict, for pytest.approx."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if items is None:
        return {prefix: value} if value is not None else {}  # approx compares numbers
    return {k: v for key, item in items for k, v in flat(item, f"{prefix}/{key}").items()}


def assert_same_run(a: Path, b: Path) -> None:
    for name in ("last.pt", *(["wise.pt"] if (a / "wise.pt").exists() else [])):
        state_a, state_b = checkpoint(a, name)["state_dict"], checkpoint(b, name)["state_dict"]
        for key in state_a:
            assert torch.allclose(state_a[key].float(), state_b[key].float(), rtol=0, atol=1e-6), (name, key)
    strip = lambda row: flat({k: v for k, v in row.items() if k not in TIMING_KEYS})  # noqa: E731
    for row_a, row_b in zip(read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl"), strict=True):
        flat_a, flat_b = strip(row_a), strip(row_b)
        numbers = {k for k, v in flat_a.items() if isinstance(v, (int, float))}
        assert {k: flat_b.get(k) for k in numbers} == pytest.approx({k: flat_a[k] for k in numbers}, rel=1e-6,
                                                                   abs=1e-9)
        assert {k: v for k, v in flat_b.items() if k not in numbers} == {
            k: v for k, v in flat_a.items() if k not in numbers}
    report_a, report_b = (json.loads((run / "report.json").read_text()) for run in (a, b))
    assert (report_a["wise"] is None) == (report_b["wise"] is None)
    if report_a["wise"]:
        wise_a, wise_b = flat(report_a["wise"]), flat(report_b["wise"])
        numbers = {k for k, v in wise_a.items() if isinstance(v, (int, float))}
        assert {k: wise_b[k] for k in numbers} == pytest.approx({k: wise_a[k] for k in numbers}, rel=1e-6, abs=1e-9)
        assert {k: v for k, v in wise_b.items() if k not in numbers} == {
            k: v for k, v in wise_a.items() if k not in numbers}
    assert report_a["reference"] == report_b["reference"]
