"""The pretrained export a labelled run is measured against, and whether to keep it.

What a user serves before training (``retrieval export --pretrained BACKBONE``): the backbone's pooled features,
L2-normalised, no head, at the run's resize and input size. ``PretrainedExport`` embeds the run's test split so
(read from the feature cache the frozen-backbone features use, so a frozen run pays a file read) before any weight
trains, and measures it on the same queries and gallery as the run's own test metrics; ``keep_pretrained`` is THE
rule that says whether the delivered model (wise.pt if the run made one, else best.pt) beats it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from retrieval.compatibility import MIN_QUERIES, compatibility_verdict
from retrieval.metrics.ranking import mean_metrics, per_query_metrics
from retrieval.models.embedder import FeatureHead
from retrieval.train.feature_cache import cached_features, dataset_key
from retrieval.train.features import EvalEmbeddings

# the Recall@1 gain on the test queries worth re-indexing a catalogue for: a smaller one keeps the pretrained export
MIN_GAIN = 0.02
HEADLINE = "recall@1"  # the gain the rule reads; the paired bootstrap is compatibility_verdict's (seeded, 95 %)
PER_QUERY = ("recall", "map@r")  # per_query_metrics' names: recall@1 and MAP@R of each query


def pretrained_command(backbone: str, resize: str, input_size: int) -> str:
    """The command that exports the pretrained model a run was measured against."""
    return f"retrieval export --pretrained {backbone} --resize {resize} --image-size {input_size} --out model.onnx"


def query_metrics(rows: EvalEmbeddings, device=None) -> dict[str, np.ndarray]:
    """Recall@1 and MAP@R of each query of ``rows`` (query, query labels, gallery or None, gallery labels),
    leave-one-out without a gallery: NaN where a query has no relevant item."""
    q, ql, g, gl = rows
    per_query = per_query_metrics(q, ql, g, gl, ks=(1,), metrics=PER_QUERY, device=device)
    return {HEADLINE: per_query["recall@1"], "map@r": per_query["map@r"]}


def keep_pretrained(delivered: Mapping[str, np.ndarray], pretrained: Mapping[str, np.ndarray],
                    name: str = "best.pt") -> dict[str, Any]:
    """THE rule: ``delivered`` (per-query Recall@1 and MAP@R of the model a run delivers, ``name``) beats
    ``pretrained`` (the same queries under the pretrained export) when its Recall@1 gain is at least ``MIN_GAIN``
    and the paired bootstrap over the queries puts the whole 95 % interval of the gain above 0 (on at least
    ``MIN_QUERIES`` queries); otherwise the pretrained export is kept. Returns ``keep_pretrained``,
    ``keep_pretrained_reason`` (one sentence with both numbers) and ``pretrained_gain`` (the gain, its interval,
    the queries, ``MIN_GAIN``)."""
    read = compatibility_verdict(delivered, pretrained)["interval"]
    measured = ~np.isnan(np.asarray(pretrained[HEADLINE], dtype=np.float64))
    ours, theirs = (float(np.mean(np.asarray(series[HEADLINE], dtype=np.float64)[measured]))
                    for series in (delivered, pretrained))
    gain, (low, high), queries = ours - theirs, read["difference"][HEADLINE], int(read["queries"])
    beats = gain >= MIN_GAIN and low > 0 and queries >= MIN_QUERIES
    numbers = (f"{name} Recall@1 {ours:.3f} against the pretrained export's {theirs:.3f} on the same {queries} test "
               f"queries, a gain of {gain:+.3f} (95% interval {low:+.3f} to {high:+.3f})")
    if beats:
        reason = f"{name} beats the pretrained export: {numbers}"
    else:
        why = (f"fewer than {MIN_QUERIES} queries are too few to tell" if queries < MIN_QUERIES else
               f"less than the {MIN_GAIN} worth re-indexing for" if gain < MIN_GAIN else "not beyond noise")
        reason = f"keep the pretrained export: {numbers}: {why}"
    return {"keep_pretrained": not beats, "keep_pretrained_reason": reason,
            "pretrained_gain": {HEADLINE: gain, "interval": [low, high], "queries": queries, "min_gain": MIN_GAIN}}


class PretrainedExport:
    """The pretrained export on a labelled run's test split: its features taken once before training (every rank:
    extracting them is collective), its metrics and the keep-pretrained verdict computed on rank 0."""

    def __init__(self) -> None:
        self.rows: tuple[Any, Any] | None = None  # the query and gallery features (``Embedded``), unnormalised

    def take(self, cfg, model, eval_sets, embedding) -> None:
        """The backbone's features of the test split at the run's preprocessing, as the frozen-backbone features are
        keyed (a frozen run reads them back); ``model``'s backbone must still be the pretrained one."""
        args = dict(cache_dir=cfg.feature_cache, device=embedding.device, batch_size=embedding.batch_size,
                    workers=embedding.workers, amp=embedding.amp, bad_images=embedding.bad_images,
                    progress=embedding.progress)
        with torch.random.fork_rng(devices=[]):  # loaders draw seeds: a cache hit must not change the training
            query = cached_features(model.backbone, eval_sets.query, dataset_key(cfg, model, cfg.eval_split),
                                    desc="features query (pretrained export)", **args)
            gallery = None if eval_sets.gallery is None else cached_features(
                model.backbone, eval_sets.gallery, dataset_key(cfg, model, "gallery"),
                desc="features gallery (pretrained export)", **args)
        self.rows = (query, gallery)

    def embeddings(self) -> EvalEmbeddings:
        """The pretrained export's (query, labels, gallery, labels): the features L2-normalised (FeatureHead's
        embedding of each image)."""
        assert self.rows is not None, "take() first"
        parts: list[Any] = []
        with torch.no_grad():  # the export's own head, so that an identity head's start is these very numbers
            for rows in self.rows:
                parts += [None, None] if rows is None else [
                    FeatureHead()(torch.as_tensor(rows.embeddings).float()).numpy(), rows.labels]
        return tuple(parts)  # type: ignore[return-value]

    def section(self, cfg, input_size: int, resize: str, delivered: EvalEmbeddings | None, name: str,
                device=None) -> dict[str, Any]:
        """The report's ``pretrained_export`` (its Recall@1, MAP@R, input size, resize, images and the command that
        exports it) and, with the ``delivered`` model's embeddings of the test split, ``keep_pretrained``."""
        ours = self.embeddings()
        pretrained = query_metrics(ours, device)
        means = mean_metrics(pretrained)
        images = len(ours[1]) + (len(ours[3]) if ours[3] is not None else 0)
        section: dict[str, Any] = {"pretrained_export": {
            HEADLINE: means[HEADLINE], "map@r": means["map@r"], "input_size": int(input_size), "resize": resize,
            "images": images,
            # the stock pretrained weights only: a run on its own --weights (or none) measured those instead
            "command": pretrained_command(cfg.backbone, resize, input_size)
            if cfg.pretrained and cfg.weights is None else None}}
        if delivered is None:
            return section
        sizes = [len(part) if part is not None else 0 for part in (delivered[1], delivered[3])]
        if sizes != [len(ours[1]), len(ours[3]) if ours[3] is not None else 0]:  # an image read by one model only
            return {**section, "keep_pretrained": True, "keep_pretrained_reason": (
                f"keep the pretrained export: {name} embedded {sum(sizes)} test images and the pretrained export "
                f"{images} (an image read by one and not the other), so they were not compared")}
        return {**section, **keep_pretrained(query_metrics(delivered, device), pretrained, name)}


def report_section(evaluation, history: list[dict[str, Any]], wise: dict[str, Any] | None) -> dict[str, Any] | None:
    """The report's ``pretrained_export`` and keep-pretrained verdict for the model the run delivers (wise.pt if it
    made one, else best.pt), from ``evaluation`` (the run's ``Evaluator``). Every rank takes part (embedding best.pt
    may be needed: collective); None on the other ranks and for a run that did not take the pretrained export."""
    from retrieval.models import BEST_CHECKPOINT, WISE_CHECKPOINT

    if evaluation.pretrained.rows is None:
        return None
    if wise is not None:
        delivered, name = evaluation.wise_eval, WISE_CHECKPOINT
    else:
        delivered, name = evaluation.best_eval, BEST_CHECKPOINT
        best = evaluation.best(history)
        if best is None:
            delivered = None
        elif delivered is None and best["epoch"] == history[-1]["epoch"] and evaluation.last_eval is not None:
            delivered = evaluation.last_eval  # best.pt is the last evaluation's model
        elif delivered is None:
            delivered = evaluation.embed_checkpoint(BEST_CHECKPOINT)
    if not evaluation.main:
        return None
    preprocessing = evaluation.parts.model.preprocessing
    return evaluation.pretrained.section(evaluation.cfg, preprocessing.input_size, preprocessing.resize_mode,
                                         delivered, name, evaluation.metrics_device)
