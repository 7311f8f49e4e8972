"""Run several training configurations one after the other in each torchrun rank (one process group for all).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/ddp_runs.py CONFIGS.json

CONFIGS.json holds a list of ``TrainConfig`` dicts; tests/train/test_train_ddp.py launches it so that one pair of
processes (one torch import, one rendezvous) trains every configuration of a group.
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from retrieval.train import TrainConfig, train

if __name__ == "__main__":
    dist.init_process_group("gloo")
    for values in json.loads(open(sys.argv[1]).read()):
        train(TrainConfig(**values), progress=False)
    dist.destroy_process_group()
