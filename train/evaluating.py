"""Evaluation during training: the evaluation split (and the linear probe), the --eval-extra sets and the
pretrained reference on them, WiSE-FT's choice of the mix, and the run's report.

Every rank embeds its part of a split; metrics are computed on rank 0 and shared with the others.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from retrieval.analysis.pictures import eval_set_pictures
from retrieval.compatibility import KEPT, KEPT_K, compatibility_metrics, neighbour_overlap
from retrieval.data import build_transforms
from retrieval.distributed import embed_sharded
from retrieval.metrics.evaluation import (
    evaluate_embeddings,
    leave_one_out_metrics,
    metrics_device,
    present_class_names,
)
from retrieval.models import (
    BEST_CHECKPOINT,
    WISE_CHECKPOINT,
    Checkpoint,
    Embedder,
    config_hash,
    in_compatible_space,
    load_checkpoint,
)
from retrieval.records.run_config import RunConfig, RunFolderConfig
from retrieval.train import checkpointing
from retrieval.train.checkpointing import BEST_METRIC, KEPT_SELECTION, LAST_SELECTION, best_row
from retrieval.train.config import TrainConfig
from retrieval.train.distributed import DistContext
from retrieval.train.feature_cache import cached_features
from retrieval.train.features import Embedding, EvalEmbeddings
from retrieval.train.head_start import starts_at_baseline
from retrieval.train.pretrained_export import PretrainedExport
from retrieval.train.report import write_report
from retrieval.train.robust import WISE_ALPHAS, choose_alpha, choose_kept_alpha, snapshot
from retrieval.train.state import RunRecord, TrainData, TrainParts
from retrieval.utils.unit_rows import l2_normalize_rows

MAX_LISTED_CLASSES = 1000  # the report lists the class names of a split up to this many


class Evaluator:
    """Measures the model being trained on the run's evaluation data; keeps the last evaluation's embeddings."""

    def __init__(self, cfg: TrainConfig, ctx: DistContext, out: Path, parts: TrainParts, data: TrainData,
                 embedding: Embedding, progress: bool, native_size: int | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.out = out
        self.parts = parts
        self.data = data
        self.embedding = embedding
        self.progress = progress
        self.last_eval: EvalEmbeddings | None = None  # the last evaluation's embeddings: the report's plots reuse them
        self._old_eval: EvalEmbeddings | None = None  # --compatible-with: the old model's, taken once
        self._start_sample = None  # --labels none: the start's embeddings of the sampled train images
        self.last_sample = None  # and the model's, at its last evaluation
        self._reference: dict[str, Any] = {}  # extra set -> the pretrained backbone's features of its test part
        # the backbone's own resolution, where the reference embeds
        self.native_size = int(native_size or parts.model.preprocessing.input_size)
        self.pretrained = PretrainedExport()  # a labelled run: what it is measured against (taken by the trainer)
        self.best_eval: EvalEmbeddings | None = None  # best.pt's embeddings of the test split, where embedded
        self.wise_eval: EvalEmbeddings | None = None  # wise.pt's

    @property
    def start_may_be_best(self) -> bool:
        """Whether the start (epoch 0) may be best.pt: a labelled run whose head starts at the baseline, unless it
        trains --compatible-with an old model (at the start its projection into the old space is untrained)."""
        return (self.cfg.labels != "none" and self.data.eval_sets.labelled and starts_at_baseline(self.cfg)
                and self.cfg.compatible_with is None)

    def best(self, history: list[dict[str, Any]]) -> dict[str, Any] | None:
        """best.pt's row of ``history`` (``best_row`` on the run's selection split)."""
        return best_row(history, self.data.selected_on, self.cfg.kept_floor, with_start=self.start_may_be_best)

    def checkpoint_model(self, name: str) -> tuple[nn.Module, Checkpoint]:
        """A copy of the evaluated model holding the run's checkpoint ``name``, and the checkpoint (every rank, once
        rank 0 has written it)."""
        self.ctx.barrier()
        model = copy.deepcopy(self.eval_model).eval()
        saved = load_checkpoint(self.out / name, map_location=self.embedding.device)
        model.load_state_dict(saved.state_dict)
        return model, saved

    def embed_checkpoint(self, name: str) -> EvalEmbeddings:
        """The test split embedded by the run's checkpoint ``name`` (every rank, once rank 0 has written it)."""
        return self.parts.features.embed_eval(self.checkpoint_model(name)[0])

    @property
    def main(self) -> bool:
        """Whether this is rank 0, which computes the metrics and writes the run folder."""
        return self.ctx.is_main

    @property
    def metrics_device(self) -> torch.device | None:
        """Where the kNN metrics run: the training GPU (the same numbers, far sooner on large splits), else the CPU."""
        return metrics_device(self.embedding.device)

    @property
    def eval_model(self) -> Embedder:
        """The weights evaluated and saved: the EMA of the weights when --ema is on, else the model itself."""
        return self.parts.robust.eval_model(self.parts.model)

    # --- the evaluation split ----------------------------------------------------------------------
    def embed_eval(self) -> EvalEmbeddings:
        """(query, query_labels, gallery, gallery_labels) embeddings of the evaluation split."""
        return self.parts.features.embed_eval(self.eval_model)

    def evaluate(self, probe: bool = False) -> dict[str, Any]:
        """Metrics of the evaluation split: embedded sharded over the ranks, computed once (rank 0), shared;
        ``probe``: with the linear probe too (--linear-probe), which is slow."""
        if not self.data.eval_sets.labelled:  # the evaluation is the label-free figures of the images
            return self.label_free(self.eval_model)
        q, ql, g, gl = self.embed_eval()
        self.last_eval = (q, ql, g, gl)  # the report's plots reuse them instead of embedding again
        metrics = self.ctx.from_main(self._metrics(q, ql, g, gl, probe) if self.main else None)
        if self.data.unlabelled_sample is not None:
            metrics.update(self.label_free(self.eval_model))
        if self.data.extra_sets:
            metrics["extra"] = self.extra_metrics(self.eval_model)
        if self.parts.old_model is not None:
            metrics["compatibility"] = self.compatibility(q, ql, g, gl)
        return metrics

    def validate(self) -> dict[str, float]:
        """Metrics of the validation split (held out of train: classes or images, each a query against the others),
        which best.pt is chosen on: embedded sharded over the ranks, computed once (rank 0), shared."""
        embeddings, labels = self.parts.features.embed_val(self.eval_model)
        return self.ctx.from_main(leave_one_out_metrics(embeddings, labels, device=self.metrics_device)
                                  if self.main else None)

    def best_test_metrics(self, history: list[dict[str, Any]]) -> dict[str, Any] | None:
        """best.pt's model on the test split (and the extra sets' test parts), evaluated once after training, where
        it was chosen on the validation split at an epoch that did not evaluate the test split; None otherwise (its
        row has them). Every rank takes part."""
        best = self.best(history)
        if best is None or BEST_METRIC in best or not self.data.eval_sets.labelled:
            return None
        model, saved = self.checkpoint_model(BEST_CHECKPOINT)
        q, ql, g, gl = self.best_eval = self.parts.features.embed_eval(model)
        metrics = self.ctx.from_main(evaluate_embeddings(q, ql, g, gl, device=self.metrics_device)
                                     if self.main else None)
        if self.data.extra_sets:
            metrics["extra"] = self.extra_metrics(model)
        if self.parts.old_model is not None:
            # best.pt's own measurement: `retrieval export` copies it into the model, `index upgrade` says it
            metrics["compatibility"] = self.compatibility(q, ql, g, gl, model)
            if self.main:
                saved.metrics = {**(saved.metrics or {}), "compatibility": metrics["compatibility"]}
                checkpointing.atomic_save(saved.to_dict(), self.out / BEST_CHECKPOINT)
            self.ctx.barrier()
        return metrics

    def compatibility(self, q: np.ndarray, ql: np.ndarray, g: np.ndarray | None,
                      gl: np.ndarray | None, model: nn.Module | None = None) -> dict[str, Any]:
        """--compatible-with: BCT's three blocks (new/new, old/old, new queries against the old gallery) on the
        evaluation split, for ``model``'s embeddings ``q``, ``g`` (default: the model trained); the old model's
        embeddings are taken once (it is frozen)."""
        if self._old_eval is None:
            self._old_eval = self.parts.features.embed_eval(self.parts.old_model.eval_model)
        old_q, _, old_g, _ = self._old_eval
        # an old model of another size: the projected queries
        cross_q = in_compatible_space(model if model is not None else self.eval_model, q)
        return self.ctx.from_main(compatibility_metrics(q, old_q, ql, g, old_g, gl, cross_q) if self.main else None)

    def split_metrics(self, model: nn.Module, q: np.ndarray, ql: np.ndarray, g: np.ndarray | None,
                      gl: np.ndarray | None) -> dict[str, float]:
        """``model``'s metrics on the evaluation split (``q``... its embeddings), and the label-free figures where
        the run trains without labels (alone where the evaluation split has no labels either)."""
        if not self.data.eval_sets.labelled:
            return self.label_free(model)
        metrics = self.ctx.from_main(evaluate_embeddings(q, ql, g, gl, device=self.metrics_device)
                                     if self.main else None)
        if self.data.unlabelled_sample is not None:
            metrics.update(self.label_free(model))
        return metrics

    def _metrics(self, q: np.ndarray, ql: np.ndarray, g: np.ndarray | None, gl: np.ndarray | None,
                 probe: bool) -> dict[str, float]:
        metrics = evaluate_embeddings(q, ql, g, gl, device=self.metrics_device)
        # unreadable images lose both their embedding and their label: say how many were left
        evaluated = len(ql) + (len(gl) if gl is not None else 0)
        metrics["eval_images"] = evaluated
        metrics["eval_skipped_images"] = self.data.eval_sets.num_images - evaluated
        metrics.update(hard_fractions(q, ql, self.train_embeddings_sample()))
        if self.cfg.linear_probe and probe:
            metrics["linear_probe"] = self.linear_probe(q, ql)
        return metrics

    def label_free(self, model: nn.Module) -> dict[str, float]:
        """--labels none: the share of each sampled train image's ``KEPT_K`` nearest neighbours that ``model`` keeps
        from the pretrained backbone's (``KEPT``): how far the adaptation moved the gallery's neighbourhoods.
        Embedded on every rank, computed on rank 0, shared; the sample's embeddings are kept for the report."""
        start = self.start_embeddings()
        self.last_sample = self.parts.features.embed_train_subset(model, self.data.unlabelled_sample)
        return self.ctx.from_main({"unlabelled_images": len(self.last_sample.indices),
                                   **kept_neighbours(start, self.last_sample)} if self.main else None)

    def start_embeddings(self):
        """The sampled train images as the pretrained backbone's pooled features have them, at the run's input
        size (taken once): what a user without a trained model searches with."""
        if self._start_sample is None:
            model = copy.deepcopy(self.eval_model).eval()
            model.load_state_dict(self.parts.robust.start)
            self._start_sample = self.parts.features.embed_train_subset(model, self.data.unlabelled_sample,
                                                                        head=False)
        return self._start_sample

    @torch.no_grad()
    def linear_probe(self, q: np.ndarray, ql: np.ndarray) -> float:
        """Logistic regression on train embeddings (clean labels), accuracy on the evaluation split."""
        from retrieval.metrics import linear_probe
        from retrieval.metrics.evaluation import probe_test_labels

        train_emb, loaded = self.parts.features.train_embeddings(self.eval_model)
        keep, labels = probe_test_labels(ql, self.data.eval_sets.query, self.data.train_set)
        return linear_probe(train_emb, self.data.clean_train_labels[loaded], q[keep], labels, seed=self.cfg.seed)

    def train_embeddings_sample(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Embeddings of a fixed train subset (for the hard-triplet fraction); None when too costly."""
        sample = self.parts.features.train_sample(self.eval_model, self.cfg.seed)
        if sample is None:
            return None
        emb, indices = sample
        return emb, self.data.train_labels[indices]

    # --- other data sets ---------------------------------------------------------------------------
    def _embed(self, model: nn.Module, dataset, desc: str):
        """``dataset`` embedded by ``model``, sharded over the ranks (every rank gets all rows)."""
        run = self.embedding
        return embed_sharded(model, dataset, run.batch_size, run.device, run.workers, run.amp, desc, run.progress,
                             run.bad_images)

    def _leave_one_out(self, model: nn.Module, dataset, desc: str) -> dict[str, float]:
        """Leave-one-out Recall@K and MAP@R of ``model`` on one data set (embedded sharded, computed on rank 0,
        shared)."""
        result = self._embed(model, dataset, desc)
        return self.ctx.from_main(leave_one_out_metrics(result.embeddings, result.labels, device=self.metrics_device)
                                  if self.main else None)

    def extra_metrics(self, model: nn.Module, part: str = "test") -> dict[str, dict[str, float]]:
        """Metrics of every --eval-extra set's ``part`` (test or val), by set name; on the test part with the share
        of each image's neighbours the pretrained backbone's neighbours keep (``KEPT``, label-free)."""
        if part != "test":
            return {extra.name: self._leave_one_out(model, getattr(extra, part), f"embed {extra.name} ({part})")
                    for extra in self.data.extra_sets}
        metrics = {}
        for extra in self.data.extra_sets:
            result = self._embed(model, extra.test, f"embed {extra.name} (test)")
            reference = self.reference_features(extra)
            metrics[extra.name] = self.ctx.from_main(
                {**leave_one_out_metrics(result.embeddings, result.labels, device=self.metrics_device),
                 **kept_neighbours(reference, result)} if self.main else None)
        return metrics

    def reference_metrics(self) -> dict[str, Any]:
        """What a user would otherwise take: the pretrained backbone's pooled features at its own resolution, on
        each extra set's test part (features cached: every run of the same backbone shares them)."""
        sets = {}
        for extra in self.data.extra_sets:
            features = self.reference_features(extra)  # on every rank: extracting them is collective
            sets[extra.name] = {"test": self.ctx.from_main(
                leave_one_out_metrics(features.embeddings, features.labels, device=self.metrics_device)
                if self.main else None)}
        return {"input_size": self.native_size, "sets": sets}

    def reference_features(self, extra):
        """The pretrained backbone's features of an extra set's test part (read from the feature cache, or
        extracted and cached): the reference of its metrics and of the neighbours a fine-tuned model keeps."""
        if extra.name not in self._reference:
            with torch.random.fork_rng(devices=[]):  # loaders draw seeds: a cache hit must not change the training
                self._reference[extra.name] = self._extract_reference(extra)
        return self._reference[extra.name]

    def _extract_reference(self, extra):
        cfg, run = self.cfg, self.embedding
        native = replace(self.parts.model.preprocessing, input_size=self.native_size)
        dataset = copy.copy(extra.test)
        dataset.transform = build_transforms(native, train=False)
        key = {"reference": extra.source, "part": "test", "limit": cfg.eval_extra_limit, "backbone": cfg.backbone,
               "pretrained": cfg.pretrained, "weights": cfg.weights, "input_size": self.native_size,
               "background": list(native.background), "amp": run.amp, "images": len(dataset)}
        return cached_features(self.parts.model.backbone, dataset, key, cfg.feature_cache, run.device,
                               run.batch_size, run.workers, run.amp, f"reference {extra.name}", run.bad_images,
                               run.progress)

    # --- WiSE-FT -------------------------------------------------------------------------------------
    def validation_point(self, model: nn.Module, start: dict[str, Any] | None = None
                         ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Recall@1 of ``model`` on the validation data: the validation split and each extra set's val part;
        with ``start`` (the extra sets' val parts as alpha 0 embedded them), the share of neighbours kept from it
        (``kept``, label-free). Returns the point and its embeddings of the extra sets' val parts, by set name."""
        point: dict[str, Any] = {"in_domain": None, "out_of_domain": None}
        rows: dict[str, Any] = {}
        if self.data.val_set is not None:
            point["in_domain"] = self._leave_one_out(model, self.data.val_set, "embed val")["recall@1"]
        if self.data.extra_sets:
            rows = {extra.name: self._embed(model, extra.val, f"embed {extra.name} (val)")
                    for extra in self.data.extra_sets}
            per_set = self.ctx.from_main({name: leave_one_out_metrics(r.embeddings, r.labels,
                                                                      device=self.metrics_device)["recall@1"]
                                          for name, r in rows.items()} if self.main else None)
            point["extra"] = per_set
            point["out_of_domain"] = float(np.mean(list(per_set.values())))
            if start is not None:
                kept = self.ctx.from_main({name: kept_neighbours(start[name], r).get(KEPT)
                                           for name, r in rows.items()} if self.main else None)
                point["extra_kept"] = kept
                present = [v for v in kept.values() if v is not None]
                point["kept"] = float(np.mean(present)) if present else None
        return point, rows

    def wise_ft(self, epoch: int) -> dict[str, Any]:
        """WiSE-FT: mix the start and the fine-tuned weights along WISE_ALPHAS on the validation data, take the
        given or chosen alpha, evaluate that model on the test data and save it as an ordinary checkpoint of
        ``epoch`` epochs."""
        cfg, robust = self.cfg, self.parts.robust
        finetuned = self.eval_model
        weights = snapshot(finetuned)
        mixed = copy.deepcopy(finetuned).eval()  # the mixes are loaded into this copy
        curve = []
        if self.data.unlabelled_sample is not None:  # without labels: the share of pretrained neighbours kept
            for alpha in sorted(WISE_ALPHAS):
                mixed.load_state_dict(robust.mix(weights, alpha))
                curve.append({"alpha": alpha, "kept": self.label_free(mixed).get(KEPT)})
        elif self.data.val_set is not None or self.data.extra_sets:
            start = None  # alpha 0's embeddings of the extra sets: the neighbours the others keep are counted from them
            for alpha in sorted(WISE_ALPHAS):
                mixed.load_state_dict(robust.mix(weights, alpha))
                point, rows = self.validation_point(mixed, start)
                if start is None and rows:  # alpha 0 keeps all of its own neighbours
                    start = rows
                    point["extra_kept"] = dict.fromkeys(rows, 1.0)
                    point["kept"] = 1.0
                curve.append({"alpha": alpha, **point})
        chosen = "validation"
        if cfg.wise_alpha != "auto":
            alpha = float(cfg.wise_alpha)
        elif self.data.unlabelled_sample is not None:
            alpha, chosen = choose_kept_alpha(curve, cfg.kept_floor), "kept-floor"
        else:
            alpha = choose_alpha(curve, cfg.wise_tolerance)
        mixed.load_state_dict(robust.mix(weights, alpha))
        q, ql, g, gl = self.parts.features.embed_eval(mixed) if self.data.eval_sets.labelled else (None,) * 4
        self.wise_eval = (q, ql, g, gl) if self.data.eval_sets.labelled else None
        metrics = self.split_metrics(mixed, q, ql, g, gl)
        if self.data.extra_sets:
            metrics["extra"] = self.extra_metrics(mixed)
        if self.main:
            train_config = RunConfig.from_json(cfg.to_dict())
            checkpoint = Checkpoint(
                model_config=mixed.config.with_fields({"wise_alpha": alpha}), state_dict=mixed.state_dict(),
                train_config=train_config, config_hash=config_hash(train_config.with_fields({"wise_alpha": alpha})),
                epoch=epoch, metrics=metrics, class_names=self.data.trained_class_names,
            )
            checkpointing.atomic_save(checkpoint.to_dict(), self.out / WISE_CHECKPOINT)
        if self.progress:
            tqdm.write(f"WiSE-FT: alpha {alpha:g} ({'chosen ' + chosen if cfg.wise_alpha == 'auto' else 'given'})"
                       f"{_headline(metrics)}; model in {self.out / WISE_CHECKPOINT}")
        return {"alpha": alpha, "chosen": chosen if cfg.wise_alpha == "auto" else "given",
                "tolerance": cfg.wise_tolerance, "curve": curve, "metrics": metrics, "checkpoint": WISE_CHECKPOINT}

    # --- the report ----------------------------------------------------------------------------------
    def write_report(self, run_config: RunFolderConfig, record: RunRecord, wise: dict[str, Any] | None,
                     bad_images: list[dict[str, Any]], best_test: dict[str, Any] | None = None,
                     pretrained: dict[str, Any] | None = None) -> dict[str, Any]:
        """report.json (and its plots) of the run as ``record`` has it: best by BEST_METRIC on the selection split
        (with ``best_test``, its test metrics where its row has none), last, baseline; ``pretrained``: the
        pretrained export's measurement and the keep-pretrained verdict (``pretrained_export.report_section``)."""
        history = record.history
        labelled = self.data.eval_sets.labelled
        headline = BEST_METRIC if labelled else KEPT
        final = [r for r in history if headline in r and r["epoch"] > 0]
        best = self.best(history)
        if best is None and self.cfg.labels == "none":  # no epoch kept the floor: best.pt is the start
            best = next((r for r in history if r.get("epoch") == 0), None)
        if best is not None and best_test is not None:
            best = {**best, **best_test}
        label_free = None
        if self.data.unlabelled_sample is not None:
            from retrieval.train.label_free_report import label_free_section

            label_free = label_free_section(self.out, history, self._start_sample, self.last_sample,
                                            self.data.unlabelled_sample, self.cfg.pseudo_labels, self.cfg.plots)
        return write_report(self.out, run_config, history, record.baseline, best,
                            final[-1] if final else None, self.last_eval[:2] if labelled else None,
                            self.train_embeddings_sample() if labelled else None,
                            bad_images=bad_images, with_plots=self.cfg.plots,
                            reference=record.reference, wise=wise,
                            pictures=self.evaluation_pictures if labelled else None, class_split=self.class_split(),
                            best_metric=headline, selection=self.selection(), label_free=label_free,
                            pretrained=pretrained)

    def selection(self) -> dict[str, Any]:
        """What best.pt (and --wise-alpha auto's in-domain point) was chosen on, what the validation split holds out
        of train, and why there is none where best.pt is the last epoch: the report's ``selected_on``,
        ``validation_by`` and ``selection_note``."""
        if self.data.selected_on == "validation":
            return {"selected_on": "validation", "validation_by": self.data.validation_by, "selection_note": None}
        if self.data.selected_on == KEPT_SELECTION:
            return {"selected_on": KEPT_SELECTION, "selection_note": None}
        return {"selected_on": LAST_SELECTION, "selection_note": no_validation_sentence(self.data.no_validation)}

    def class_split(self) -> dict[str, Any]:
        """Which classes (and how many images) each split holds, and how many class names train and test share
        (0: a class-disjoint protocol)."""
        data = self.data
        parts = {"train": data.train_set, "validation": data.val_set, "test": data.eval_sets.query,
                 "gallery": data.eval_sets.gallery}
        names = {part: present_class_names(dataset) for part, dataset in parts.items() if dataset is not None}
        split: dict[str, Any] = {
            part: {"classes": len(found), "images": len(parts[part]),
                   **({"class_names": found} if len(found) <= MAX_LISTED_CLASSES else {})}
            for part, found in names.items()}
        split["shared_train_test_classes"] = len(set(names["train"]) & set(names["test"]))
        protocol = getattr(data.eval_sets.query, "split_note", None) or getattr(data.train_set, "split_note", None)
        if protocol:  # how the data set split its images (a folder's protocol), for people
            split["protocol"] = protocol
        if data.val_set is not None:
            split["validation"]["held_out"] = data.validation_by
        if self.cfg.labels == "none":
            split.update(labels="none", pseudo_labels=self.cfg.pseudo_labels, test_labelled=data.eval_sets.labelled)
            split["train"].pop("class_names", None)  # each image its own class: the names say nothing
        return split

    def evaluation_pictures(self) -> dict[str, str]:
        """The last evaluation's query grid and embedding map, drawn into the run folder (report plot names)."""
        return eval_set_pictures(self.out, self.data.eval_sets, self.last_eval, *self.parts.features.eval_indices(),
                                 seed=self.cfg.seed)


def _headline(metrics: dict[str, Any]) -> str:
    """The figure a console line leads with: Recall@1, or the neighbours kept where there are no labels."""
    if "recall@1" in metrics:
        return f", recall@1 {metrics['recall@1']:.4f}"
    return f", {KEPT} {metrics[KEPT]:.4f}" if KEPT in metrics else ""


def no_validation_sentence(reason: str | None) -> str:
    """What a run without a validation split delivers, for people: the run's warning, the report and the summary."""
    fix = ("more images a class would give one" if reason and reason.startswith("too few images") else
           "--val-fraction F holds F of the train classes, or of each class's images, out to choose on")
    return (f"no validation split ({reason or 'none was carved'}): best.pt is the last epoch, chosen on nothing (the "
            f"test split its numbers come from never chooses); {fix}")


def kept_neighbours(reference, result, k: int = KEPT_K) -> dict[str, float]:
    """``KEPT``: the mean share of an image's ``k`` nearest neighbours under the model that are among its ``k`` nearest
    under the pretrained backbone (``reference``), on the images both embedded; label-free. Empty when too few."""
    common, at_ref, at_model = np.intersect1d(reference.indices, result.indices, return_indices=True)
    if len(common) <= k:
        return {}
    overlap = neighbour_overlap(l2_normalize_rows(reference.embeddings[at_ref], zero_rows="keep"),
                                l2_normalize_rows(result.embeddings[at_model], zero_rows="keep"), k)
    return {KEPT: float(overlap.mean())}


def hard_fractions(q: np.ndarray, ql: np.ndarray, train_sample) -> dict[str, float]:
    """Fraction of anchors whose hardest negative is closer than their positive (SCT paper, Figure 6)."""
    try:
        from retrieval.analysis.triplet_diagram import triplet_diagram
    except ImportError:
        return {}
    out = {"hard_fraction_test": float(triplet_diagram(q, ql).hard_fraction)}
    if train_sample is not None:
        out["hard_fraction_train"] = float(triplet_diagram(*train_sample).hard_fraction)
    return out
