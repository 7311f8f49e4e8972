"""The run behind ``retrieval train``: set-up (or resume), then epoch after epoch of training (``epochs.py``),
validation, evaluation and checkpoints, then WiSE-FT and the report. What trains is built by ``building.py``,
checkpoints and logs are ``checkpointing.py``'s, evaluation ``evaluating.py``'s, the data ``data.py``'s and the lines
for people ``console.py``'s."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from retrieval.data import BadImageLog
from retrieval.inference import default_workers
from retrieval.models import BEST_CHECKPOINT, LAST_CHECKPOINT, WISE_CHECKPOINT
from retrieval.records.run_config import RunFolderConfig
from retrieval.train.building import build_model, build_parts, compatible_old_model, seed_everything
from retrieval.train.checkpointing import LAST_SELECTION, VALIDATION, Checkpointer, resuming
from retrieval.train.config import TrainConfig
from retrieval.train.console import (
    RunEstimate,
    backbone_choice_line,
    epoch_line,
    estimate_line,
    faster_choice,
    hint_input_bound,
    split_line,
    warn_line,
)
from retrieval.train.data import load_train_data
from retrieval.train.distributed import ensure_run_folder, gpu_options, init_distributed
from retrieval.train.epochs import EpochLoop
from retrieval.train.evaluating import Evaluator, no_validation_sentence
from retrieval.train.features import Embedding, feature_source_class
from retrieval.train.head_start import (
    IDENTITY,
    check_head_start,
    identity_weights,
    principal_images,
    principal_weights,
    resolved_head_start,
    starts_at_baseline,
)
from retrieval.train.label_free_check import deliver, keep_start, measure
from retrieval.train.pretrained_export import pretrained_command, report_section
from retrieval.train.robust import RobustFineTuning
from retrieval.train.state import EpochProgress, RunRecord, TrainData, TrainParts
from retrieval.train.tracking import Tracking, mlflow_uri_from
from retrieval.utils.heap import kept_heap

BAD_IMAGE_FIX = "fix or remove the file, or pass --on-bad-image skip to train without it"


class Trainer(EpochLoop):
    """Holds the state of one run; ``run()`` trains (each epoch ``EpochLoop.train_epoch``), evaluates, checkpoints
    and writes the report."""

    # built by setup()
    data: TrainData
    parts: TrainParts
    record: RunRecord
    checkpoints: Checkpointer
    evaluation: Evaluator

    def __init__(self, cfg: TrainConfig, progress: bool = True) -> None:
        ensure_run_folder(cfg)
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.last_path = self.out / LAST_CHECKPOINT
        self.ctx = init_distributed(cfg.device, cfg.dist_timeout)  # one process: rank 0 of 1
        self.progress = progress and self.ctx.is_main
        # --freeze-backbone left unset: a head on cached features for --labels none on a CPU (said in setup)
        self.backbone_choice = backbone_choice_line(cfg, self.device.type) \
            if cfg.settle_freeze_backbone(self.device.type, _recorded_freeze_backbone(self.out)) else None
        self.estimate: RunEstimate | None = None  # a long CPU run that trains the backbone: timed, then said
        self.amp_dtype = gpu_options(cfg.amp, cfg.channels_last, cfg.compile, self.device)
        self.workers = default_workers() if cfg.workers is None else cfg.workers
        self.bad_images = BadImageLog(cfg.on_bad_image, fix=BAD_IMAGE_FIX, warn=warn_line)
        self.resume_progress: EpochProgress | None = None  # the epoch a mid-epoch checkpoint stopped in
        self.tracking = Tracking([])  # TensorBoard / MLflow, opened by setup() on rank 0

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        return self.ctx.device

    @property
    def main(self) -> bool:
        """Whether this is rank 0, which alone writes the run folder."""
        return self.ctx.is_main

    @property
    def amp(self) -> bool:
        """Whether the steps run under autocast (--amp)."""
        return self.amp_dtype is not None

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the model, data, optimizer and sampler (``data``, ``parts``, ``record``); resume if asked."""
        cfg = self.cfg
        resume = resuming(cfg, self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        if self.progress and self.backbone_choice:  # the run's first line: which default it took, and why
            tqdm.write(self.backbone_choice, file=sys.stderr)
        seed_everything(cfg.seed)

        model, native_size = build_model(cfg)
        check_head_start(cfg, int(model.config.value_of("feature_dim")))  # before any image is read
        source = feature_source_class(cfg)
        source.prepare_model(model)
        model.to(self.device)
        old_model = compatible_old_model(cfg, model, self.device, announce=self.main)
        robust = RobustFineTuning.build(cfg, model).to(self.device)
        preprocessing = model.preprocessing
        train_transform = source.train_transform(preprocessing, cfg.augmentation(), self.device)
        self.data = data = load_train_data(cfg, preprocessing, train_transform)
        embedding = Embedding(self.device, cfg.eval_batch_size, self.workers, self.amp, self.progress, self.bad_images)
        self.parts = build_parts(cfg, ctx=self.ctx, model=model, data=data, robust=robust, source=source,
                                 embedding=embedding, amp_dtype=self.amp_dtype, old_model=old_model)
        self.checkpoints = Checkpointer(cfg, self.out, self.main, self.parts, data, self.bad_images)
        self.evaluation = Evaluator(cfg, self.ctx, self.out, self.parts, data, embedding, self.progress, native_size)
        class_split = self.evaluation.class_split() if self.main else None
        if cfg.labels == "given" and data.eval_sets.labelled:  # before any weight trains or a resume loads them
            self.evaluation.pretrained.take(cfg, model, data.eval_sets, embedding)
        if self.progress:  # which classes train and which are held out, before any work on them
            tqdm.write(split_line(class_split, self.out / "config.json"), file=sys.stderr)

        if cfg.labels == "none" and self.progress and self.device.type == "cpu" and not cfg.freeze_backbone:
            self.estimate = RunEstimate(epochs=cfg.epochs, steps=self.parts.steps_per_epoch, evaluations=0,
                                        images=len(data.train_labels))
            self.on_first_step = self._say_estimate
        if not resume and starts_at_baseline(cfg):
            self._start_head(resolved_head_start(cfg, int(model.config.value_of("feature_dim"))))
        self.pseudo = None
        if cfg.labels == "none" and cfg.pseudo_labels != "instance":
            from retrieval.train.pseudo_labelling import PseudoLabelling

            self.pseudo = PseudoLabelling(cfg, self.ctx, self.parts, data, lambda: self.evaluation.eval_model,
                                          self.out)
        self.record = RunRecord()
        if data.extra_sets:  # before a resume loads fine-tuned weights: the reference is the pretrained backbone
            reference = self.evaluation.reference_metrics()
            if not resume:  # resuming: the checkpoint has it
                self.record.reference = reference
        if resume:
            self.record, self.resume_progress = self.checkpoints.resume(self.device)
        if self.main:
            self.tracking = Tracking.open(self.out, self.run_config(), cfg.tensorboard,
                                          mlflow_uri_from(cfg.mlflow_uri, cfg.mlflow, self.out),
                                          resume_step=self.parts.scheduler.last_epoch + 1 if resume else None)
            (self.out / "config.json").write_text(json.dumps({**self.run_config().to_json(),
                                                              "class_split": class_split}, indent=2))

    def _start_head(self, how: str) -> None:
        """The head starts at the baseline (``--head-start``): the identity (the pretrained export), or the principal
        axes of the backbone's features of the train images (without labels: of the sampled images), so the start
        (epoch 0, WiSE-FT's alpha 0, the guard's fallback) is the pretrained backbone's neighbours, not a random
        map's."""
        model, robust = self.parts.model, self.parts.robust
        if how == IDENTITY:
            weights = identity_weights(model)
        else:
            started = time.perf_counter()
            with torch.random.fork_rng(devices=[]):  # a loader draws seeds: the training's stream stays the same
                start = self.evaluation.start_embeddings() if self.cfg.labels == "none" else \
                    self.parts.features.embed_train_subset(
                        self.evaluation.eval_model, principal_images(self.data.train_set, model, self.cfg.seed),
                        head=False)  # every rank: embedding is collective
            if self.estimate is not None and len(start.embeddings):  # the backbone's forward pass, timed
                self.estimate.image_s = (time.perf_counter() - started) / len(start.embeddings)
            weights = self.ctx.from_main(principal_weights(model, start.embeddings, self.cfg.seed)
                                         if self.main else None)
        model.head.load_state_dict(weights)
        robust.restart_from(model)
        robust.head_trained_at_start = True  # WiSE-FT mixes toward this head too
        if robust.ema is not None:
            robust.ema.module.load_state_dict(model.state_dict())

    def run_config(self) -> RunFolderConfig:
        """config.json: the training options, the model, the data and where the run ran."""
        return RunFolderConfig.from_json({
            "train": self.cfg.to_dict(),
            "model": self.parts.model.config.to_json(),
            "label_noise": self.data.noise_info,
            "train_size": len(self.data.train_labels),
            "num_train_classes": self.data.num_classes,
            "steps_per_epoch": self.parts.steps_per_epoch,
            "device": str(self.device),
            "world_size": self.ctx.world_size,
            "amp": self.amp,
            "torch": torch.__version__,
            "tracking": self.tracking.where(),
        })

    def checkpoint(self, epoch: int, metrics: dict[str, Any], progress: EpochProgress | None = None) -> dict[str, Any]:
        """The on-disk checkpoint of the run as it stands: ``epoch`` epochs complete, ``progress`` the one under way."""
        return self.checkpoints.checkpoint(self.record, epoch, metrics, progress)

    def evaluate(self, final: bool = False) -> dict[str, Any]:
        """Metrics of the evaluation split (and the extra sets); the linear probe before and after training only."""
        return self.evaluation.evaluate(probe=final or not self.record.history)

    def validate(self) -> dict[str, Any]:
        """{"validation": metrics} of the validation split, which best.pt is chosen on; {} without one."""
        return {VALIDATION: self.evaluation.validate()} if self.data.val_set is not None else {}

    # --- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Set up, train every epoch (evaluating and checkpointing), then write the report; returns it."""
        try:
            return self._run()
        except BaseException as exc:
            self.tracking.fail("KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED")
            raise
        finally:
            parts = getattr(self, "parts", None)  # set up, or the run failed before
            if parts is not None:  # the data workers stop with the run, however it ends
                parts.features.close()

    def _track_epoch(self, row: dict[str, Any]) -> None:
        optimizer = self.parts.optimizer
        self.tracking.epoch(row, self.parts.scheduler.last_epoch,
                            {group.get("name", str(i)): group["lr"] for i, group in enumerate(optimizer.param_groups)})

    def _set_up(self) -> None:
        """``setup()``; a folder it made for a run that then fails before training is removed again (with what it
        had written: nothing a later run needs), so a mistyped option leaves no empty run behind."""
        made = not self.out.exists()
        try:
            self.setup()
        except BaseException:
            if made and self.main:
                shutil.rmtree(self.out, ignore_errors=True)
            raise

    def _run(self) -> dict[str, Any]:
        self._set_up()
        cfg, record = self.cfg, self.record
        # before any work: the run's "best" will be optimistic (without labels, the guard chooses it)
        if self.main and self.data.no_validation is not None and self.data.selected_on == LAST_SELECTION:
            warn_line(no_validation_sentence(self.data.no_validation))
        if record.baseline is None and cfg.eval_before:
            started = time.perf_counter()
            record.baseline = self.evaluate()
            if self.estimate is not None:
                self.estimate.eval_s = time.perf_counter() - started
            record.history.append({"epoch": 0, **record.baseline, **self.validate()})
            self._track_epoch(record.history[-1])
            self.checkpoints.rewrite_metrics_log(record.history)
        if cfg.labels == "none" and record.start_epoch == 0:  # the guard's fallback: no epoch may keep the floor
            self.checkpoints.save(BEST_CHECKPOINT, record, 0, record.history[-1] if record.history else {})
            if self.main and self.data.check_images is not None:  # what the label-free check may deliver instead
                keep_start(self.out)
        elif self.evaluation.start_may_be_best and record.start_epoch == 0 and record.history:
            self.checkpoints.save_start(record, record.history[-1])
        hinted = False  # the input-bound advice is given once a run
        if self.estimate is not None:  # what is left to run
            self.estimate.epochs = cfg.epochs - record.start_epoch
            self.estimate.evaluations = sum((e + 1) % cfg.eval_every == 0 or e + 1 == cfg.epochs
                                            for e in range(record.start_epoch, cfg.epochs))
        for epoch in range(record.start_epoch, cfg.epochs):
            progress, self.resume_progress = self.resume_progress, None  # a mid-epoch resume's epoch comes first
            # the labels this epoch trains on (those it started with, for a run resumed inside it)
            started = time.perf_counter()
            grouped = self.pseudo.refresh(epoch, mid_epoch=progress is not None) if self.pseudo is not None else {}
            if self.estimate is not None and self.estimate.regroup_s is None and grouped:
                self.estimate.regroup_s = time.perf_counter() - started
            row: dict[str, Any] = {"epoch": epoch + 1, **grouped, **self.train_epoch(epoch, progress)}
            if epoch + 1 == cfg.epochs:  # the train workers are done: the final evaluation starts its own
                self.parts.features.close()
            evaluated = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            if evaluated:
                row.update(self.validate())
            # the test split: every evaluation where best.pt is chosen on it, else once, after the last epoch
            if evaluated and (self.data.val_set is None or epoch + 1 == cfg.epochs):
                row.update(self.evaluate(final=epoch + 1 == cfg.epochs))
            record.history.append(row)
            self._track_epoch(row)
            self.checkpoints.append_metrics(row)
            self.checkpoints.save_epoch_end(record, epoch, row, evaluated)
            if self.progress:
                tqdm.write(epoch_line(row))
                hinted = hinted or hint_input_bound(row, self.cfg, self.workers, self.device)
        return self.finish()

    def _label_free_check(self, wise: dict[str, Any] | None) -> dict[str, Any] | None:
        """--labels none with --label-free-check: can the held-out images tell the delivered model (wise.pt where
        the run made one, else best.pt) from the start (train/label_free_check.py); None for other runs."""
        if self.cfg.labels != "none" or not self.cfg.label_free_check or self.pseudo is None:
            return None
        guard_kept_start = self.evaluation.best(self.record.history) is None
        return measure(self.out, self.parts.features, self.data.check_images, self.evaluation.eval_model,
                       self.pseudo.group, guard_kept_start, WISE_CHECKPOINT if wise is not None else BEST_CHECKPOINT,
                       self.ctx.barrier)

    def _say_estimate(self, step_s: float) -> None:
        """After the first timed step of a CPU run that trains the backbone: how long the run takes, and the faster
        choice, when it is long."""
        assert self.estimate is not None
        self.estimate.step_s = step_s
        line = estimate_line(self.estimate, faster_choice(self.cfg))
        if line is not None:
            tqdm.write(line, file=sys.stderr)

    def finish(self) -> dict[str, Any]:
        """After the last epoch: WiSE-FT if asked, then (rank 0) the report; returns it ({} on other ranks)."""
        evaluation, history = self.evaluation, self.record.history
        if evaluation.last_eval is None and self.data.eval_sets.labelled:  # e.g. resuming a finished run
            evaluation.last_eval = evaluation.embed_eval()
        wise = None
        if self.cfg.wise_alpha is not None:
            wise = evaluation.wise_ft(history[-1]["epoch"] if history else 0)
        best_test = evaluation.best_test_metrics(history)  # on every rank: embedding the test split is collective
        pretrained = report_section(evaluation, history, wise)  # every rank, as above
        checked = self._label_free_check(wise)  # every rank, as above
        if not self.main:
            return {}
        report = evaluation.write_report(self.run_config(), self.record, wise, self.bad_images.records(), best_test,
                                         pretrained)
        if checked is not None:  # the start is delivered where the check cannot tell them apart
            preprocessing = self.parts.model.preprocessing
            pretrained = {"command": pretrained_command(self.cfg.backbone, preprocessing.resize_mode,
                                                        preprocessing.input_size),
                          "input_size": int(preprocessing.input_size), "resize": preprocessing.resize_mode}
            report = deliver(self.out, report, checked, next((r for r in history if r.get("epoch") == 0), None),
                             pretrained)
        self.tracking.finish(self.out, report.get("plots", {}), self.parts.scheduler.last_epoch)
        return report


def _recorded_freeze_backbone(out: Path) -> bool | None:
    """Whether the run in ``out``, which this one resumes, froze its backbone (its config.json); None for a new run."""
    try:
        value = json.loads((out / "config.json").read_text())["train"]["freeze_backbone"] \
            if (out / LAST_CHECKPOINT).is_file() else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, bool) else None


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train one run as configured; returns the report (also written to RUN_DIR/report.json; {} on ranks > 0).

    Under torchrun (WORLD_SIZE > 1) it joins the process group, and leaves it at the end if it joined it."""
    joined = torch.distributed.is_initialized()
    try:
        with kept_heap():  # every step frees and allocates the same large tensors again
            return Trainer(cfg, progress=progress).run()
    finally:
        if not joined and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
