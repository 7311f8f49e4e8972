"""``retrieval.utils.heap.kept_heap``: inside it, a loop that frees and allocates the same large blocks stops paying
them in page faults; leaving it gives the memory back. Measured in a fresh process each (the heap is process-wide)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from retrieval.utils import heap

pytestmark = pytest.mark.skipif(heap._MALLOPT is None, reason="needs glibc's mallopt (Linux)")

PROBE = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from retrieval.utils.heap import kept_heap

    BLOCK = 64 * 2**20  # over glibc's largest mmap threshold: a fresh mapping at every allocation by default

    def faults_of_loop(rounds=8):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(rounds):
            block = np.ones(BLOCK, dtype=np.uint8)  # touches every page
            del block
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    def resident_mb():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096 / 2**20

    result = {"default": faults_of_loop()}
    with kept_heap():
        faults_of_loop(1)  # the first block is paid once
        result["kept"] = faults_of_loop()
        with kept_heap():
            pass
        result["after_inner_block"] = faults_of_loop()  # a nested block's end leaves the outer one's setting
        big = np.ones(4 * BLOCK, dtype=np.uint8)
        del big
        result["held_mb"] = resident_mb()
    result["released_mb"] = resident_mb()
    result["default_again"] = faults_of_loop()
    print(json.dumps(result))
""")


@pytest.fixture(scope="module")
def probe() -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout)


def test_a_kept_heap_reuses_freed_blocks_instead_of_faulting_them_in_again(probe):
    assert probe["default"] >= 8 * 32, probe  # by default every round faults its pages in (2 MiB ones at least)
    assert probe["kept"] < probe["default"] / 10, probe


def test_a_nested_kept_heap_ending_keeps_the_outer_setting(probe):
    assert probe["after_inner_block"] < probe["default"] / 10, probe


def test_leaving_a_kept_heap_gives_the_memory_back_and_restores_the_defaults(probe):
    assert probe["held_mb"] > 200, probe  # the freed 256 MiB stayed in the heap inside the block
    assert probe["released_mb"] < probe["held_mb"] - 200, probe
    assert probe["default_again"] > probe["default"] / 2, probe


class HeapWitness(torch.nn.Module):
    """A model that records whether the heap was kept while it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3 * 8 * 8, 4)
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(heap._kept_depth)
        return self.linear(x.flatten(1))


def test_embedding_a_dataset_runs_with_the_heap_kept_and_restores_it_after():
    from torch.utils.data import TensorDataset

    from retrieval.inference import embed_samples

    model = HeapWitness()
    dataset = TensorDataset(torch.randn(10, 3, 8, 8), torch.arange(10))
    embed_samples(model, dataset, batch_size=4, workers=0, progress=False)
    assert model.seen == [1, 1, 1] and heap._kept_depth == 0


def test_a_training_run_runs_with_the_heap_kept_and_restores_it_after(monkeypatch):
    from retrieval.train import trainer
    from retrieval.train.config import TrainConfig

    monkeypatch.setattr(trainer.Trainer, "__init__", lambda self, cfg, progress=True: None)
    monkeypatch.setattr(trainer.Trainer, "run", lambda self: {"kept_depth": heap._kept_depth})
    assert trainer.train(TrainConfig()) == {"kept_depth": 1} and heap._kept_depth == 0
