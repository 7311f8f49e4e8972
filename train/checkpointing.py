"""A run's checkpoints and logs: ``last.pt`` and ``best.pt``, ``--resume`` (also from inside an epoch),
``--checkpoint-every``, ``metrics.jsonl`` (a row per epoch) and ``steps.jsonl`` (a row per optimizer step).

Rank 0 alone writes the run folder: every method that writes does nothing on the other ranks.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from retrieval.compatibility import KEPT
from retrieval.data import BadImageLog
from retrieval.models import BEST_CHECKPOINT, LAST_CHECKPOINT, Checkpoint, config_hash, load_checkpoint
from retrieval.records.run_config import RunConfig
from retrieval.reports import STEPS_LOG
from retrieval.train.config import TrainConfig
from retrieval.train.distributed import restarted
from retrieval.train.state import EpochProgress, RunRecord, TrainData, TrainParts, restore_rng_states, rng_states
from retrieval.utils.io import atomic_write

BEST_METRIC = "recall@1"  # the evaluation metric whose highest value makes best.pt
METRICS_LOG = "metrics.jsonl"
VALIDATION = "validation"  # an epoch row's validation metrics, and the split best.pt is chosen on where it exists
KEPT_SELECTION = "kept"  # without labels: best.pt is the latest epoch that keeps --kept-floor of the neighbours
LAST_SELECTION = "last"  # no validation split: best.pt is the last epoch, never one chosen on the test split


def selection_score(row: dict[str, Any], selected_on: str, kept_floor: float = 0.0) -> float | None:
    """The value best.pt is chosen by in an epoch's row: BEST_METRIC of the row's validation metrics ("validation";
    "test", in reports written before the test split stopped choosing: the row's own); None where the epoch did
    not evaluate that split. Without labels (``KEPT_SELECTION``): the epoch itself where its images keep
    ``kept_floor`` of their pretrained neighbours, so the latest such epoch wins; ``LAST_SELECTION``: the epoch
    itself, so the last one wins."""
    if selected_on == KEPT_SELECTION:
        return float(row["epoch"]) if row.get(KEPT, -1.0) >= kept_floor else None
    if selected_on == LAST_SELECTION:
        return float(row["epoch"])
    metrics = row.get(VALIDATION) if selected_on == VALIDATION else row
    return None if not metrics or BEST_METRIC not in metrics else float(metrics[BEST_METRIC])


def best_row(history: list[dict[str, Any]], selected_on: str, kept_floor: float = 0.0,
             with_start: bool = False) -> dict[str, Any] | None:
    """The epoch best.pt holds: the highest ``selection_score``, the first of equal ones (as ``save_epoch_end``
    keeps it); a trained epoch, or the start (epoch 0) too ``with_start`` (a head that starts at the baseline:
    ``save_start``); None before an evaluated epoch."""
    scored = [r for r in history if (r.get("epoch", 0) > 0 or with_start)
              and selection_score(r, selected_on, kept_floor) is not None]
    return max(scored, key=lambda r: selection_score(r, selected_on, kept_floor)) if scored else None


def atomic_save(obj: Any, path: Path) -> None:
    """Save a checkpoint whole or not at all: a crash never leaves half a checkpoint."""
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def resuming(cfg: TrainConfig, out: Path) -> bool:
    """Whether this run continues the one in ``out``; a run already there and no --resume is an error."""
    last_path = out / LAST_CHECKPOINT
    # a worker that torchrun restarted (--max-restarts) continues from the last checkpoint
    resume = cfg.resume or (restarted() and last_path.exists())
    if last_path.exists() and not resume:
        raise FileExistsError(
            f"{out} already holds a run ({LAST_CHECKPOINT}); pass --resume to continue it or choose another --out"
        )
    return resume


class Checkpointer:
    """Writes and reads one run folder's checkpoints and logs for the parts that train."""

    def __init__(self, cfg: TrainConfig, out: Path, main: bool, parts: TrainParts, data: TrainData,
                 bad_images: BadImageLog) -> None:
        self.cfg = cfg
        self.out = out
        self.main = main
        self.parts = parts
        self.data = data
        self.bad_images = bad_images
        self.last_path = out / LAST_CHECKPOINT

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, record: RunRecord, epoch: int, metrics: dict[str, Any],
                   progress: EpochProgress | None = None) -> dict[str, Any]:
        """The on-disk checkpoint: model and everything a resume needs; ``epoch`` epochs are complete, ``progress``
        is the one under way."""
        parts = self.parts
        evaluated = parts.robust.eval_model(parts.model)
        train_config = RunConfig.from_json(self.cfg.to_dict())
        return Checkpoint(
            model_config=parts.model.config,
            state_dict=evaluated.state_dict(),  # the model people use: the EMA when there is one
            train_config=train_config,
            config_hash=config_hash(train_config),
            epoch=epoch,
            metrics=metrics,
            class_names=self.data.trained_class_names,
            optimizer=parts.optimizer.state_dict(),
            scheduler=parts.scheduler.state_dict(),
            scaler=parts.scaler.state_dict(),
            loss_state=parts.loss_fn.state_dict(),
            aux_state=parts.aux.state_dict() if parts.aux is not None else None,
            best_recall=record.best_recall,
            history=record.history,
            baseline=record.baseline,
            bad_images=self.bad_images.records(),
            steps_per_epoch=parts.steps_per_epoch,
            in_epoch=asdict(progress) if progress is not None else None,
            rng=rng_states(),
            training_weights=parts.model.state_dict() if evaluated is not parts.model else None,
            robust=parts.robust.state_dict(),
            reference=record.reference,
        ).to_dict()

    def save(self, name: str, record: RunRecord, epoch: int, metrics: dict[str, Any],
             progress: EpochProgress | None = None) -> None:
        """Write the checkpoint as RUN/``name`` (rank 0)."""
        if self.main:
            atomic_save(self.checkpoint(record, epoch, metrics, progress), self.out / name)

    def mid_epoch_due(self) -> bool:
        """--checkpoint-every: rank 0 saves last.pt every that many optimizer steps of the run."""
        every = self.cfg.checkpoint_every
        return bool(every) and self.main and self.parts.scheduler.last_epoch % every == 0  # counts optimizer steps

    def save_mid_epoch(self, record: RunRecord, epoch: int, progress: EpochProgress) -> None:
        """last.pt inside an epoch: ``epoch`` epochs complete with the last one's metrics, and where this one stands."""
        last_row = record.history[-1] if record.history else {}
        self.save(LAST_CHECKPOINT, record, epoch, last_row, progress=progress)

    def save_start(self, record: RunRecord, row: dict[str, Any]) -> None:
        """A head that starts at the baseline: its start (epoch 0, ``row`` its metrics) is best.pt until a trained
        epoch beats it on the selection split, so that best.pt is never worse there than the start."""
        self._best_if_best(record, 0, row)

    def save_epoch_end(self, record: RunRecord, epoch: int, row: dict[str, Any], evaluated: bool) -> None:
        """After an epoch: best.pt when its recall@1 on the selection split (validation where the run has one) is
        the best yet (every rank tracks it), then last.pt."""
        if evaluated:
            self._best_if_best(record, epoch + 1, row)
        self.save(LAST_CHECKPOINT, record, epoch + 1, row)

    def _best_if_best(self, record: RunRecord, epochs: int, row: dict[str, Any]) -> None:
        """best.pt (``epochs`` complete) where ``row``'s score on the selection split is the best yet."""
        score = selection_score(row, self.data.selected_on, self.cfg.kept_floor)
        if score is not None and score > record.best_recall:
            record.best_recall = score
            self.save(BEST_CHECKPOINT, record, epochs, row)

    def resume(self, device: torch.device) -> tuple[RunRecord, EpochProgress | None]:
        """Load last.pt into the parts; returns the run's record and the epoch it stopped inside (None: between)."""
        path = self.last_path
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint to resume at {path}; start without --resume")
        ckpt = load_checkpoint(path, map_location=device)
        if not ckpt.resumable:
            raise ValueError(f"--resume: {path} holds a model only, no training state; start without --resume")
        trained = ckpt.train_config
        if trained.holds("val_fraction") and trained.val_fraction != self.cfg.val_fraction:
            # another held-out share trains on other classes and chooses best.pt on another split
            then, now = (("auto" if value is None else value) for value in (trained.val_fraction,
                                                                            self.cfg.val_fraction))
            raise ValueError(f"--resume: {path} was trained with --val-fraction {then}, this configuration has "
                             f"{now}; resume with the run's own options (config.json)")
        parts = self.parts
        parts.model.load_state_dict(ckpt.training_weights or ckpt.state_dict)
        if ckpt.robust is not None:
            parts.robust.load_state_dict(ckpt.robust)
        parts.optimizer.load_state_dict(ckpt.optimizer)
        parts.scheduler.load_state_dict(ckpt.scheduler)
        parts.scaler.load_state_dict(ckpt.scaler)
        parts.loss_fn.load_state_dict(ckpt.loss_state)
        if parts.aux is not None and ckpt.aux_state:
            parts.aux.load_state_dict(ckpt.aux_state)
        record = RunRecord(ckpt.epoch, ckpt.best_recall, ckpt.history, ckpt.baseline, ckpt.reference)
        self.bad_images.restore(ckpt.bad_images)
        progress = None
        if ckpt.in_epoch:
            if ckpt.steps_per_epoch != parts.steps_per_epoch:
                raise ValueError(
                    f"--resume: {path} stopped inside an epoch of {ckpt.steps_per_epoch} batches but this "
                    f"configuration has {parts.steps_per_epoch}; resume with the run's own options (config.json)"
                )
            progress = EpochProgress(**ckpt.in_epoch)
        restore_rng_states(ckpt.rng)
        # metrics.jsonl and steps.jsonl keep exactly the epochs and steps the checkpoint has seen
        self.rewrite_metrics_log(record.history)
        self.rewrite_steps_log()
        return record, progress

    # --- logs --------------------------------------------------------------------------------------
    def log_step(self, step: int, epoch: float, loss: float) -> None:
        """One optimizer step's loss in steps.jsonl, the report's per-step curve."""
        if self.main:
            with (self.out / STEPS_LOG).open("a") as f:
                f.write(json.dumps({"step": step, "epoch": round(epoch, 6), "loss": loss}) + "\n")

    def rewrite_steps_log(self) -> None:
        """A resumed run's steps.jsonl keeps the steps its checkpoint has taken (the later ones are taken again)."""
        path, done = self.out / STEPS_LOG, self.parts.scheduler.last_epoch
        if self.main and path.is_file():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= done]
            atomic_write(path, "".join(line + "\n" for line in kept))

    def rewrite_metrics_log(self, history: list[dict[str, Any]]) -> None:
        """metrics.jsonl as exactly ``history``'s rows."""
        if self.main:
            atomic_write(self.out / METRICS_LOG, "".join(json.dumps(row) + "\n" for row in history))

    def append_metrics(self, row: dict[str, Any]) -> None:
        """One epoch's row at the end of metrics.jsonl."""
        if self.main:
            with (self.out / METRICS_LOG).open("a") as f:
                f.write(json.dumps(row) + "\n")
