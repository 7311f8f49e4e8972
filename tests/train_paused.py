"""`retrieval train` (cli.main) in a torchrun rank that stops for good once rank 0 has written last.pt at a given
mid-epoch position, so that a test kills the job at a known point instead of racing it.

    python -m torch.distributed.run ... tests/train_paused.py EPOCH:BATCH train --config CONFIG.json ...

Rank 0 prints ``PAUSED`` to stderr and sleeps after that checkpoint is on disk; the other ranks wait for it in
their next collective.
"""

from __future__ import annotations

import sys
import time

PAUSED = "RETRIEVAL_TRAIN_PAUSED"


def pause_after_checkpoint(epoch: int, batch: int) -> None:
    """Wrap the trainer's ``atomic_save`` so that the process stops after saving the ``(epoch, batch)`` checkpoint."""
    import retrieval.train.checkpointing as checkpointing

    save = checkpointing.atomic_save

    def save_then_pause(checkpoint, path):
        save(checkpoint, path)
        position = checkpoint.get("in_epoch") or {}
        if (position.get("epoch"), position.get("batch")) == (epoch, batch):
            print(f"{PAUSED} {epoch}:{batch}", file=sys.stderr, flush=True)
            time.sleep(600)

    checkpointing.atomic_save = save_then_pause


if __name__ == "__main__":
    epoch, batch = map(int, sys.argv[1].split(":"))
    pause_after_checkpoint(epoch, batch)
    from retrieval.cli.main import main

    sys.exit(main(args=sys.argv[2:], prog_name="retrieval"))
