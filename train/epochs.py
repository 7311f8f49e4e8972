"""One training epoch of optimizer steps: forward, loss, the one read-back a step (finite? the loss's checks), the
step (AMP loss scaling, --grad-clip, the schedule), skipped non-finite steps, and the losses read back from the
device in batches (``READ_BACK_SECONDS``) into the epoch's row, steps.jsonl and the trackers.

``EpochLoop`` is the ``Trainer``'s epoch half: the ``Trainer`` sets up what it reads (declared below) and runs it
epoch after epoch, evaluating and checkpointing between epochs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from retrieval.data import BadImageLog
from retrieval.train.checkpointing import Checkpointer
from retrieval.train.config import TrainConfig
from retrieval.train.state import READ_BACK_SECONDS, EpochProgress, RunRecord, StepValues, TrainParts, WaitTimer
from retrieval.train.tracking import Tracking
from retrieval.utils.progress import progress_bar
from retrieval.utils.reads import deferred_checks, known_on_host, read_checks, read_numbers, stat_tensors, to_device


class TrainingDiverged(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite losses."""


class EpochLoop:
    """Trains one epoch at a time (``train_epoch``); a base of ``Trainer``, which provides what it reads."""

    # set by the Trainer (its __init__ and setup)
    cfg: TrainConfig
    parts: TrainParts
    record: RunRecord
    checkpoints: Checkpointer
    tracking: Tracking
    bad_images: BadImageLog
    amp_dtype: torch.dtype | None
    progress: bool  # whether this process shows progress bars
    last_path: Path  # named when the run stops on non-finite losses
    device: torch.device  # the one this process trains on (a Trainer property)
    # called once with the seconds of the first step that trains the backbone (the Trainer's estimate), then unset
    on_first_step: Callable[[float], None] | None = None

    def train_epoch(self, epoch: int, progress: EpochProgress | None = None) -> dict[str, float]:
        """Train one epoch (from where ``progress`` stopped, if given); returns its metrics row."""
        parts, cfg = self.parts, self.cfg
        state = progress or EpochProgress(epoch)
        head_only = epoch < cfg.lp_epochs  # LP-FT: the head learns on the pretrained features first
        if cfg.lp_epochs and epoch == cfg.lp_epochs and state.batch == 0:
            parts.robust.restart_from(parts.model)  # fine-tuning starts from the trained head
        parts.step.fix_backbone(head_only)
        parts.features.train_mode(parts.model)
        if head_only:
            parts.model.backbone.eval()
        start = time.perf_counter() - state.elapsed
        batches = WaitTimer(parts.features.batches(parts.sampler, epoch, state.batch), state.data_wait)
        bar = progress_bar(batches, total=parts.steps_per_epoch, initial=state.batch,
                           desc=f"epoch {epoch + 1}/{self.cfg.epochs}", disable=not self.progress, leave=False)
        pending: list[StepValues] = []  # the steps taken whose loss is not yet read back from the device
        read_at = state.elapsed
        try:
            for inputs, labels, unreadable in bar:
                state.batch += 1
                started = time.perf_counter()
                step = self._train_step(state, inputs, labels, unreadable, head_only)
                if step is None:
                    continue
                if self.on_first_step is not None and not head_only:
                    timed, self.on_first_step = self.on_first_step, None
                    timed(time.perf_counter() - started)
                pending.append(step)
                state.elapsed, state.data_wait = time.perf_counter() - start, batches.waited
                checkpoint_due = self.checkpoints.mid_epoch_due()
                if checkpoint_due or state.elapsed - read_at >= READ_BACK_SECONDS:
                    self._read_back(state, pending)
                    read_at = state.elapsed
                    bar.set_postfix(loss=f"{state.totals['loss'] / state.steps:.4f}",
                                    img_s=f"{state.seen / max(state.elapsed, 1e-9):.0f}",
                                    data=f"{state.data_wait / max(state.elapsed, 1e-9):.0%}")
                if checkpoint_due:
                    self.checkpoints.save_mid_epoch(self.record, epoch, state)
            self._read_back(state, pending)
        except BaseException:
            with contextlib.suppress(Exception):  # the losses of the steps taken before the error are logged
                self._read_back(state, pending)
            raise
        self.bad_images.restore(parts.step.all_records(self.bad_images.records()))  # the report lists every rank's
        if state.seen == 0 and state.skipped_images:
            raise ValueError(
                f"no training image of epoch {epoch + 1} could be read ({state.skipped_images} failed; the warnings "
                "above name them): check the data folder"
            )
        state.data_wait = batches.waited
        return self._epoch_row(state, time.perf_counter() - start)

    def _train_step(self, state: EpochProgress, inputs: torch.Tensor, labels: torch.Tensor, unreadable: int,
                    head_only: bool) -> StepValues | None:
        """One batch: the forward pass, the loss and (when it is finite) the optimizer step; returns the step's
        values, still on the device, or None when the step was skipped."""
        parts, cfg = self.parts, self.cfg
        # counts of the global batch (summed over the ranks)
        usable, images, unreadable = parts.step.batch_counts(labels, unreadable, cfg.gather)
        state.skipped_images += unreadable
        if not usable:  # (almost) every image of the batch failed to load
            state.skipped_steps += 1
            return None
        inputs = inputs.to(self.device, non_blocking=True)
        host_labels, labels = labels, to_device(labels, self.device)  # from pinned memory: no wait
        replay = None  # --chunks: re-runs the chunks with their part of the gradient after the backward
        # the loss's batch checks are read with the finiteness check below; a hard-negative method pairs the batch
        # from the host labels instead of copying the device's back
        with deferred_checks() as checks, known_on_host(labels, host_labels):
            if cfg.chunks > 1:
                embeddings, replay = parts.step.chunked(inputs, labels, self.amp_dtype, cfg.chunks)
                local_terms = {}
            else:  # float32 embeddings: losses run in float32
                embeddings, local_terms = parts.step(inputs, labels, self.amp_dtype)
            # the global batch's loss (gathered over the ranks) plus the per-sample terms (auxiliary head,
            # distillation)
            old = None if parts.old_model is None else parts.old_model(inputs)  # --compatible-with
            objective = parts.objective(embeddings, labels, local_terms, old=old)
        loss, backward = objective.total, objective.backward
        penalty = None if head_only else parts.robust.penalty_term()  # the same on every rank
        terms = {name: value.detach() for name, value in objective.local_terms.items()}
        if penalty is not None:
            loss, backward = loss + penalty.detach(), backward + penalty
            terms["l2sp"] = penalty.detach()
        # the trainer's one read-back a step: the loss's batch checks, and whether the loss is finite (a skipped step
        # must not reach the weights; the same on every rank)
        (finite,), failed = read_checks(checks, torch.isfinite(loss))
        if failed is not None:
            raise failed
        if not finite:
            self._skip_non_finite(state)
            return None
        state.bad_in_row = 0
        self._optimizer_step(backward, replay)
        parts.robust.after_step(parts.model)
        state.steps += 1
        state.seen += images
        stats = dict(getattr(parts.loss_fn, "last_stats", None) or {})  # read back with the loss
        return StepValues(parts.scheduler.last_epoch, state.epoch + state.batch / parts.steps_per_epoch,
                          loss.detach(), terms, stats)

    def _read_back(self, state: EpochProgress, pending: list[StepValues]) -> None:
        """The losses (and the loss's statistics) of the ``pending`` steps, copied from the device in one transfer:
        added to the epoch's sums and logged (steps.jsonl, the report's per-step curve, and the trackers on rank 0);
        ``pending`` is emptied.

        Reading a step's loss waits for the device to finish it; read every step, the next batch could not be
        prepared while the device still works on this one."""
        if not pending:
            return
        values = [step.loss for step in pending] + [value for step in pending for value in step.terms.values()]
        values += [value for step in pending for value in stat_tensors(step.stats)]
        numbers = read_numbers(values)
        read = iter(numbers[len(pending):])
        step_terms = [[(name, next(read)) for name in step.terms] for step in pending]
        step_stats = [[(name, next(read) if isinstance(value, torch.Tensor) else float(value))
                       for name, value in step.stats.items()] for step in pending]
        for loss, named, stats in zip(numbers[:len(pending)], step_terms, step_stats, strict=True):
            step = pending[0]
            self.tracking.step(step.step, loss)
            self.checkpoints.log_step(step.step, step.epoch, loss)
            for name, value in named:
                state.add(name, value)
            for name, value in stats:
                state.stats.setdefault(name, []).append(value)
            state.add("loss", loss)
            pending.pop(0)  # logged and counted: a failure after this step does not take it again

    def _optimizer_step(self, backward: torch.Tensor, replay=None) -> None:
        """One optimizer step on ``backward``'s gradients (and ``replay()``'s, the chunks of --chunks): loss scaling,
        --grad-clip, then the schedule."""
        optimizer, scaler = self.parts.optimizer, self.parts.scaler
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(backward).backward()
        if replay is not None:
            replay()
        if self.cfg.grad_clip:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], self.cfg.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        self.parts.scheduler.step()

    def _skip_non_finite(self, state: EpochProgress) -> None:
        """A NaN/inf loss: skip the step, and stop the run after --max-bad-steps of them in a row."""
        state.skipped_steps += 1
        state.bad_in_row += 1
        self.parts.optimizer.zero_grad(set_to_none=True)
        if state.bad_in_row >= self.cfg.max_bad_steps:
            raise TrainingDiverged(
                f"loss was NaN/inf for {state.bad_in_row} steps in a row (epoch {state.epoch + 1}); lower --lr "
                f"(now {self.cfg.lr}) or check the loss hyperparameters; last good checkpoint: "
                f"{self.last_path}"
            )

    def _epoch_row(self, state: EpochProgress, elapsed: float) -> dict[str, float]:
        """The epoch's metrics row: mean loss (and loss statistics), step and image counts, speed, learning rate."""
        steps = state.steps
        row = {
            "loss": state.totals.get("loss", 0.0) / max(steps, 1),
            "steps": steps,
            "skipped_steps": state.skipped_steps,
            "skipped_images": state.skipped_images,
            "images_per_s": state.seen / max(elapsed, 1e-9),
            "epoch_time_s": elapsed,
            "data_wait_s": state.data_wait,
            "lr": self.parts.optimizer.param_groups[0]["lr"],
        }
        # the per-sample and penalty terms (aux_ce, distill, l2sp), each a mean over the epoch's steps
        row.update({key: total / max(steps, 1) for key, total in state.totals.items() if key != "loss"})
        row.update({f"loss_{k}": float(np.mean(v)) for k, v in state.stats.items()})
        if self.device.type == "cuda":
            row["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row
