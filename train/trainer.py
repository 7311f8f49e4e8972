"""The training loop behind ``retrieval train``."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retrieval import losses
from retrieval.data import (
    BadImageLog,
    ClassBalancedBatchSampler,
    WithSampleSeeds,
    asymmetric_transitions,
    build_transforms,
    inject_label_noise,
    load_dataset,
)
from retrieval.data.decode import DEFAULT_BACKGROUND, parse_background
from retrieval.evaluation import embed_eval_sets, evaluate_embeddings, load_eval_sets
from retrieval.inference import default_workers, embed_samples, make_loader, resolve_device
from retrieval.models import CHECKPOINT_FORMAT, Embedder, config_hash, create_embedder
from train.config import TrainConfig
from train.features import cached_features
from train.report import write_report

HARD_FRACTION_SAMPLES = 2000  # anchors used for the per-epoch hard-triplet fraction
BAD_IMAGE_FIX = "fix or remove the file, or pass --on-bad-image skip to train without it"


class TrainingDiverged(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite losses."""


@dataclass
class EpochProgress:
    """Where an epoch stands and its running sums: a mid-epoch checkpoint keeps it so the epoch ends the same."""

    epoch: int
    batch: int = 0  # batches taken from the sampler
    steps: int = 0  # optimizer steps
    skipped_steps: int = 0  # non-finite loss, or fewer than 2 images left after unreadable ones were dropped
    bad_in_row: int = 0
    seen: int = 0  # images in the optimizer steps
    skipped_images: int = 0  # images of the epoch's batches that could not be read
    elapsed: float = 0.0
    totals: dict[str, float] = field(default_factory=dict)
    stats: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + value


def warn_line(message: str) -> None:
    """One warning line on stderr, above any progress bar."""
    tqdm.write(f"warning: {message}", file=sys.stderr)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def atomic_save(obj: Any, path: Path) -> None:
    """Write to a temporary file in the same folder, then rename: a crash never leaves half a checkpoint."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def build_optimizer(cfg: TrainConfig, model: Embedder, extra: list[nn.Parameter]) -> torch.optim.Optimizer:
    backbone_params = [p for p in model.backbone.parameters() if p.requires_grad]
    head_params = list(model.head.parameters()) + extra
    groups = [{"params": head_params, "lr": cfg.lr, "name": "head"}]
    if backbone_params:
        groups.append({"params": backbone_params, "lr": cfg.backbone_lr or cfg.lr / 10, "name": "backbone"})
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, momentum=0.9, weight_decay=cfg.weight_decay, nesterov=True)
    cls = torch.optim.AdamW if cfg.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, weight_decay=cfg.weight_decay)


def build_scheduler(cfg: TrainConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int):
    total = cfg.epochs * steps_per_epoch
    warmup = cfg.warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "cosine":
            progress = (step - warmup) / max(1, total - warmup)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if cfg.schedule == "step":  # x0.1 at 2/3 of training
            return 0.1 if step >= warmup + (total - warmup) * 2 // 3 else 1.0
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _dataset_key(cfg: TrainConfig, model: Embedder, split: str) -> dict:
    return {
        "backbone": cfg.backbone, "pretrained": cfg.pretrained, "weights": cfg.weights,
        "input_size": model.config["input_size"], "dataset": cfg.dataset,
        "data": str(Path(cfg.data).resolve()) if cfg.data else None, "dataset_kwargs": cfg.dataset_kwargs,
        "split": split, "eval_limit": cfg.eval_limit if split != "train" else None,
        # features do not depend on the seed, only the seeded --eval-limit subset does: seeds share a cache
        "seed": cfg.seed if cfg.eval_limit and split != "train" else None,
        "amp": cfg.amp and torch.cuda.is_available() and cfg.device != "cpu",  # fp16 features differ
        # only transparent images depend on it; keys made before it was recorded stay valid for the default
        **({"background": model.config["background"]}
           if model.config["background"] != list(DEFAULT_BACKGROUND) else {}),
    }


class Trainer:
    """Holds the state of one run; ``run()`` trains, evaluates, checkpoints and writes the report."""

    def __init__(self, cfg: TrainConfig, progress: bool = True) -> None:
        self.cfg = cfg
        self.progress = progress
        self.out = Path(cfg.out)
        self.device = resolve_device(cfg.device)
        self.amp = cfg.amp and self.device.type == "cuda"
        self.workers = default_workers() if cfg.workers is None else cfg.workers

    # --- set-up -----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        if (self.out / "last.pt").exists() and not cfg.resume:
            raise FileExistsError(
                f"{self.out} already holds a run (last.pt); pass --resume to continue it or choose another --out"
            )
        self.out.mkdir(parents=True, exist_ok=True)
        seed_everything(cfg.seed)
        self.bad_images = BadImageLog(cfg.on_bad_image, fix=BAD_IMAGE_FIX, warn=warn_line)

        self.model = create_embedder(
            cfg.backbone, cfg.embedding_dim, pretrained=cfg.pretrained, normalize=cfg.use_normalize,
            freeze_bn=cfg.freeze_bn, weights=cfg.weights,
        )
        if cfg.image_size:
            self.model.config["input_size"] = int(cfg.image_size)
        self.model.config["background"] = list(parse_background(cfg.background))
        if cfg.freeze_backbone:
            for p in self.model.backbone.parameters():
                p.requires_grad_(False)
        self.model.to(self.device)

        eval_tf = build_transforms(self.model.config, train=False)
        train_tf = eval_tf if cfg.freeze_backbone else build_transforms(self.model.config, train=True)
        self.train_set = load_dataset(cfg.dataset, cfg.data, split="train", transform=train_tf, **cfg.dataset_kwargs)
        self.eval_sets = load_eval_sets(cfg.dataset, cfg.data, cfg.eval_split, eval_tf, cfg.eval_limit, cfg.seed,
                                        **cfg.dataset_kwargs)
        self.train_labels = np.asarray(self.train_set.labels, dtype=np.int64)
        self.clean_train_labels = self.train_labels.copy()  # the linear probe measures against true classes
        self.noise_info = None
        if cfg.label_noise:
            mode, _, rate = cfg.label_noise.partition(":")
            transitions, chosen = None, {}
            if mode == "asymmetric":  # per data set, by class name (retrieval.data.noise)
                transitions, chosen = asymmetric_transitions(cfg.dataset, self.train_set.class_names,
                                                             cfg.label_noise_transitions)
            self.train_labels, self.noise_info = inject_label_noise(
                self.train_labels, mode=mode, rate=float(rate), num_classes=len(self.train_set.class_names),
                transitions=transitions, seed=cfg.seed,
            )
            self.noise_info.update(chosen)
            self.train_set.labels = self.train_labels
        self.num_classes = int(self.train_labels.max()) + 1

        self.sampler = ClassBalancedBatchSampler(
            self.train_labels, classes_per_batch=cfg.classes_per_batch, samples_per_class=cfg.per_class,
            drop_small=cfg.drop_small, seed=cfg.seed, batches_per_epoch=cfg.batches_per_epoch,
        )
        self.steps_per_epoch = len(self.sampler)

        self.loss_fn = losses.build(cfg.loss, negatives=cfg.negatives, **cfg.loss_kwargs).to(self.device)
        extra = list(self.loss_fn.parameters())
        self.aux = None
        if cfg.aux_ce > 0:
            from retrieval.losses.auxiliary import AuxiliaryCrossEntropy

            self.aux = AuxiliaryCrossEntropy(cfg.embedding_dim, self.num_classes, weight=cfg.aux_ce).to(self.device)
            extra += list(self.aux.parameters())
        self.optimizer = build_optimizer(cfg, self.model, extra)
        self.scheduler = build_scheduler(cfg, self.optimizer, self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp)

        self.train_features = self.eval_features = None
        if cfg.freeze_backbone:
            self._cache_features()

        self.start_epoch, self.best_recall, self.history = 0, -1.0, []
        self.resume_progress: EpochProgress | None = None
        self.baseline: dict[str, float] | None = None
        self.last_eval_embeddings: tuple[np.ndarray, np.ndarray] | None = None
        if cfg.resume:
            self._load_resume_state()
        (self.out / "config.json").write_text(json.dumps(self.run_config(), indent=2))

    def _cache_features(self) -> None:
        cfg, backbone = self.cfg, self.model.backbone
        args = dict(cache_dir=cfg.feature_cache, device=self.device, batch_size=cfg.eval_batch_size,
                    workers=self.workers, amp=self.amp, bad_images=self.bad_images, progress=self.progress)
        train = cached_features(backbone, self.train_set, _dataset_key(cfg, self.model, "train"),
                                desc="features train", **args)
        self.train_features = torch.from_numpy(train.embeddings).to(self.device)
        self.train_feature_indices = train.indices  # the train images that loaded, one per feature row
        # feature row of each train image, -1 where it could not be read (batches then leave it out)
        self.train_feature_row = np.full(len(self.train_labels), -1, dtype=np.int64)
        self.train_feature_row[train.indices] = np.arange(len(train.indices))
        query = cached_features(backbone, self.eval_sets.query, _dataset_key(cfg, self.model, cfg.eval_split),
                                desc="features query", **args)
        gallery = None
        if self.eval_sets.gallery is not None:
            gallery = cached_features(backbone, self.eval_sets.gallery, _dataset_key(cfg, self.model, "gallery"),
                                      desc="features gallery", **args)
        self.eval_features = (query, gallery)

    def run_config(self) -> dict[str, Any]:
        return {
            "train": self.cfg.to_dict(),
            "model": self.model.config,
            "label_noise": self.noise_info,
            "train_size": len(self.train_labels),
            "num_train_classes": self.num_classes,
            "steps_per_epoch": self.steps_per_epoch,
            "device": str(self.device),
            "amp": self.amp,
            "torch": torch.__version__,
        }

    # --- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, epoch: int, metrics: dict[str, Any], progress: EpochProgress | None = None) -> dict[str, Any]:
        """Model and everything a resume needs; ``epoch`` epochs are complete, ``progress`` is the one under way."""
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.model.config,
            "state_dict": self.model.state_dict(),
            "train_config": self.cfg.to_dict(),
            "config_hash": config_hash(self.cfg.to_dict()),
            "epoch": epoch,
            "metrics": metrics,
            "class_names": list(self.train_set.class_names),
            # resume state
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "loss_state": self.loss_fn.state_dict(),
            "aux_state": self.aux.state_dict() if self.aux is not None else None,
            "best_recall": self.best_recall,
            "history": self.history,
            "baseline": self.baseline,
            "bad_images": self.bad_images.records(),
            "steps_per_epoch": self.steps_per_epoch,
            "in_epoch": asdict(progress) if progress is not None else None,
            "rng": rng,
        }

    def _load_resume_state(self) -> None:
        path = self.out / "last.pt"
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint to resume at {path}; start without --resume")
        ckpt = torch.load(path, map_location=self.device, weights_only=False)
        self.model.load_state_dict(ckpt["state_dict"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.loss_fn.load_state_dict(ckpt["loss_state"])
        if self.aux is not None and ckpt.get("aux_state"):
            self.aux.load_state_dict(ckpt["aux_state"])
        self.start_epoch = ckpt["epoch"]
        self.best_recall = ckpt["best_recall"]
        self.history = ckpt["history"]
        self.baseline = ckpt.get("baseline")
        self.bad_images.restore(ckpt.get("bad_images", []))
        if ckpt.get("in_epoch"):
            if ckpt["steps_per_epoch"] != self.steps_per_epoch:
                raise ValueError(
                    f"--resume: {path} stopped inside an epoch of {ckpt['steps_per_epoch']} batches but this "
                    f"configuration has {self.steps_per_epoch}; resume with the run's own options (config.json)"
                )
            self.resume_progress = EpochProgress(**ckpt["in_epoch"])
        torch.set_rng_state(ckpt["rng"]["torch"].cpu())
        np.random.set_state(ckpt["rng"]["numpy"])
        random.setstate(ckpt["rng"]["python"])
        if "cuda" in ckpt["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([state.cpu() for state in ckpt["rng"]["cuda"]])
        # metrics.jsonl keeps exactly the epochs the checkpoint has seen
        self._rewrite_metrics_log()

    def _rewrite_metrics_log(self) -> None:
        tmp = self.out / ".metrics.jsonl.tmp"
        tmp.write_text("".join(json.dumps(row) + "\n" for row in self.history))
        os.replace(tmp, self.out / "metrics.jsonl")

    # --- training ----------------------------------------------------------------------------------
    def _batches(self, epoch: int, start: int):
        """(inputs, labels, images that could not be read) for each batch of ``epoch`` from batch ``start`` on."""
        self.sampler.set_epoch(epoch, start)
        if self.cfg.freeze_backbone:
            labels = torch.from_numpy(self.train_labels)
            for indices in self.sampler:
                idx = np.asarray(indices, dtype=np.int64)
                rows = self.train_feature_row[idx]
                ok = rows >= 0
                yield (self.train_features[torch.from_numpy(rows[ok])], labels[torch.from_numpy(idx[ok])],
                       int(np.count_nonzero(~ok)))
        else:
            # per-sample seeds: augmentation does not depend on the workers or on where a run resumed; the own
            # generator keeps the DataLoader from drawing on the global RNG that the checkpoints save
            loader = make_loader(self.train_set, None, self.workers, self.device,
                                 batch_sampler=WithSampleSeeds(self.sampler),
                                 generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch))
            for batch in loader:
                self.bad_images.add(batch.bad)
                yield batch.inputs, batch.labels, len(batch.bad)

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.cfg.freeze_backbone:
            return self.model.head(inputs)
        return self.model(inputs)

    def train_epoch(self, epoch: int, progress: EpochProgress | None = None) -> dict[str, float]:
        """Train one epoch (from where ``progress`` stopped, if given); returns its metrics row."""
        self.model.train()
        if self.cfg.freeze_backbone:
            self.model.backbone.eval()
        state = progress or EpochProgress(epoch)
        every = self.cfg.checkpoint_every
        start = time.perf_counter() - state.elapsed
        bar = tqdm(self._batches(epoch, state.batch), total=self.steps_per_epoch, initial=state.batch,
                   desc=f"epoch {epoch + 1}/{self.cfg.epochs}", disable=not self.progress, leave=False)
        for inputs, labels, unreadable in bar:
            state.batch += 1
            state.skipped_images += unreadable
            if labels is None or len(labels) < 2:  # (almost) every image of the batch failed to load
                state.skipped_steps += 1
                continue
            inputs = inputs.to(self.device, non_blocking=True)
            labels = labels.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.float16, enabled=self.amp):
                embeddings = self._forward(inputs)
            embeddings = embeddings.float()  # losses always run in float32
            loss = self.loss_fn(embeddings, labels)
            if self.aux is not None:
                aux_loss = self.aux(embeddings, labels)
                state.add("aux_ce", float(aux_loss.detach()))
                loss = loss + aux_loss
            if not torch.isfinite(loss):
                state.skipped_steps += 1
                state.bad_in_row += 1
                self.optimizer.zero_grad(set_to_none=True)
                if state.bad_in_row >= self.cfg.max_bad_steps:
                    raise TrainingDiverged(
                        f"loss was NaN/inf for {state.bad_in_row} steps in a row (epoch {epoch + 1}); lower --lr "
                        f"(now {self.cfg.lr}) or check the loss hyperparameters; last good checkpoint: "
                        f"{self.out / 'last.pt'}"
                    )
                continue
            state.bad_in_row = 0
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            if self.cfg.grad_clip:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(
                    [p for g in self.optimizer.param_groups for p in g["params"]], self.cfg.grad_clip
                )
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.scheduler.step()
            state.steps += 1
            state.seen += len(labels)
            state.add("loss", float(loss.detach()))
            for key, value in (getattr(self.loss_fn, "last_stats", None) or {}).items():
                state.stats.setdefault(key, []).append(float(value))
            state.elapsed = time.perf_counter() - start
            bar.set_postfix(loss=f"{state.totals['loss'] / state.steps:.4f}",
                            img_s=f"{state.seen / max(state.elapsed, 1e-9):.0f}")
            if every and self.scheduler.last_epoch % every == 0:  # last_epoch counts the optimizer steps
                last = self.history[-1] if self.history else {}
                atomic_save(self.checkpoint(epoch, last, progress=state), self.out / "last.pt")
        if state.seen == 0 and state.skipped_images:
            raise ValueError(
                f"no training image of epoch {epoch + 1} could be read ({state.skipped_images} failed; the warnings "
                "above name them): check the data folder"
            )
        elapsed = time.perf_counter() - start
        steps = state.steps
        row = {
            "loss": state.totals.get("loss", 0.0) / max(steps, 1),
            "steps": steps,
            "skipped_steps": state.skipped_steps,
            "skipped_images": state.skipped_images,
            "images_per_s": state.seen / max(elapsed, 1e-9),
            "epoch_time_s": elapsed,
            "lr": self.optimizer.param_groups[0]["lr"],
        }
        if self.aux is not None:
            row["aux_ce"] = state.totals.get("aux_ce", 0.0) / max(steps, 1)
        row.update({f"loss_{k}": float(np.mean(v)) for k, v in state.stats.items()})
        if self.device.type == "cuda":
            row["cuda_max_memory_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        return row

    # --- evaluation --------------------------------------------------------------------------------
    @torch.no_grad()
    def embed_eval(self):
        """(query, query_labels, gallery, gallery_labels) embeddings of the evaluation split."""
        if self.cfg.freeze_backbone:
            self.model.head.eval()
            query, gallery = self.eval_features
            head = lambda f: self.model.head(torch.from_numpy(f).to(self.device)).float().cpu().numpy()  # noqa: E731
            if gallery is None:
                return head(query.embeddings), query.labels, None, None
            return head(query.embeddings), query.labels, head(gallery.embeddings), gallery.labels
        return embed_eval_sets(self.model, self.eval_sets, self.device, self.cfg.eval_batch_size, self.workers,
                               self.amp, self.progress, bad_images=self.bad_images)

    @torch.no_grad()
    def train_embeddings_sample(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Embeddings of a fixed train subset (for the hard-triplet fraction); None when too costly."""
        if not self.cfg.freeze_backbone:
            return None
        n = len(self.train_feature_indices)  # the train images that could be read
        idx = np.sort(np.random.default_rng(self.cfg.seed).permutation(n)[: min(n, HARD_FRACTION_SAMPLES)])
        self.model.head.eval()
        emb = self.model.head(self.train_features[torch.from_numpy(idx)]).float().cpu().numpy()
        return emb, self.train_labels[self.train_feature_indices[idx]]

    def evaluate(self, final: bool = False) -> dict[str, float]:
        q, ql, g, gl = self.embed_eval()
        self.last_eval_embeddings = (q, ql)  # the report's plots reuse them instead of embedding again
        metrics = evaluate_embeddings(q, ql, g, gl)
        # unreadable images lose both their embedding and their label: say how many were left
        evaluated = len(ql) + (len(gl) if gl is not None else 0)
        metrics["eval_images"] = evaluated
        metrics["eval_skipped_images"] = self.eval_sets.num_images - evaluated
        metrics.update(hard_fractions(q, ql, self.train_embeddings_sample()))
        if self.cfg.linear_probe and (final or not self.history):  # before and after training: it is slow
            metrics["linear_probe"] = self.linear_probe(q, ql)
        return metrics

    @torch.no_grad()
    def linear_probe(self, q: np.ndarray, ql: np.ndarray) -> float:
        """Logistic regression on train embeddings (clean labels), accuracy on the evaluation split."""
        from retrieval.metrics import linear_probe

        if self.cfg.freeze_backbone:
            self.model.head.eval()
            train_emb = self.model.head(self.train_features).float().cpu().numpy()
            loaded = self.train_feature_indices
        else:
            plain = load_dataset(self.cfg.dataset, self.cfg.data, split="train",
                                 transform=build_transforms(self.model.config, train=False), **self.cfg.dataset_kwargs)
            embedded = embed_samples(self.model, plain, self.cfg.eval_batch_size, self.device, self.workers,
                                     self.amp, desc="embed train", progress=self.progress, bad_images=self.bad_images)
            train_emb, loaded = embedded.embeddings, embedded.indices
        return linear_probe(train_emb, self.clean_train_labels[loaded], q, ql, seed=self.cfg.seed)

    # --- the run -----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self.setup()
        cfg = self.cfg
        log_path = self.out / "metrics.jsonl"
        if self.baseline is None and cfg.eval_before:
            self.baseline = self.evaluate()
            self.history.append({"epoch": 0, **self.baseline})
            self._rewrite_metrics_log()
        for epoch in range(self.start_epoch, cfg.epochs):
            progress, self.resume_progress = self.resume_progress, None  # a mid-epoch resume's epoch comes first
            row: dict[str, Any] = {"epoch": epoch + 1, **self.train_epoch(epoch, progress)}
            is_eval_epoch = (epoch + 1) % cfg.eval_every == 0 or epoch + 1 == cfg.epochs
            if is_eval_epoch:
                row.update(self.evaluate(final=epoch + 1 == cfg.epochs))
            self.history.append(row)
            with log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            if is_eval_epoch and row["recall@1"] > self.best_recall:
                self.best_recall = row["recall@1"]
                atomic_save(self.checkpoint(epoch + 1, row), self.out / "best.pt")
            atomic_save(self.checkpoint(epoch + 1, row), self.out / "last.pt")
            if self.progress:
                shown = {k: round(v, 4) for k, v in row.items() if k in ("loss", "recall@1", "map@r")}
                tqdm.write(f"epoch {epoch + 1}: {shown}")
        return self.finish()

    def finish(self) -> dict[str, Any]:
        final = [r for r in self.history if "recall@1" in r and r["epoch"] > 0]
        best = max(final, key=lambda r: r["recall@1"]) if final else None
        if self.last_eval_embeddings is None:  # e.g. resuming a run that had already finished
            q, ql, _, _ = self.embed_eval()
            self.last_eval_embeddings = (q, ql)
        train_sample = self.train_embeddings_sample()
        return write_report(self.out, self.run_config(), self.history, self.baseline, best,
                            final[-1] if final else None, self.last_eval_embeddings, train_sample,
                            bad_images=self.bad_images.records())


def hard_fractions(q: np.ndarray, ql: np.ndarray, train_sample) -> dict[str, float]:
    """Fraction of anchors whose hardest negative is closer than their positive (SCT paper, Figure 6)."""
    try:
        from retrieval.analysis import triplet_diagram
    except ImportError:
        return {}
    out = {"hard_fraction_test": float(triplet_diagram(q, ql).hard_fraction)}
    if train_sample is not None:
        out["hard_fraction_train"] = float(triplet_diagram(*train_sample).hard_fraction)
    return out


def train(cfg: TrainConfig, progress: bool = True) -> dict[str, Any]:
    """Train one run as configured; returns the report (also written to RUN_DIR/report.json)."""
    return Trainer(cfg, progress=progress).run()
