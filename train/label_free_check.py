"""The check of a run without labels: can the run tell its trained model from its start?

A seeded share of the images (``CHECK_SHARE``) is held out of training. At the end they are grouped by the run's
own pseudo-labelling (``--pseudo-labels``) on the pretrained backbone's features, and each held-out image, a query
among the others, is scored against those groups (AP@R and Recall@1, as MAP@R and Recall@1 score classes) twice:
embedded by the model the run delivers (wise.pt where it made one, else best.pt) and by the start. The trained model
is delivered only where its mean AP@R on the groups is higher by ``MIN_PROXY_GAIN`` or more and the whole 95 %
interval of the gain (a paired bootstrap over the queries, the one index upgrades read) lies above 0, and its
Recall@1 is not worse beyond noise. Otherwise the delivered model becomes the start (the pretrained backbone's
neighbours) and the report says to keep the pretrained export.

Held-out images, not the trained ones: the model was trained to pull its own groups together, so on the images it
trained on it would agree with any grouping it learnt, right or wrong. On images it never saw, it agrees better
with the pretrained backbone's own groups than the start does only where what it learnt carries over to new
images of the same kinds (docs/RESULTS.md, "Fine-tuning without labels", measures how often it was right).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.compatibility import (
    BOOTSTRAP_SEED,
    CONFIDENCE,
    MIN_QUERIES,
    bootstrap_means,
    label_metrics_per_query,
    worse_on_labels,
)
from retrieval.utils.unit_rows import l2_normalize_rows

CHECK_SHARE = 0.2  # of the images, held out of training for the check
MIN_CHECK_IMAGES = 40  # fewer held out (a small set, min_images()): the check cannot tell, the start is delivered
MAX_CHECK_IMAGES = 1000  # the check's [n, n] similarities stay small
MIN_PROXY_GAIN = 0.01  # the least mean AP@R gain on the held-out groups worth delivering a trained model for
START_CHECKPOINT = "start.pt"  # the run's start (epoch 0), kept for the check to deliver instead of best.pt
CHECK_KEY = "label_free_check"  # the report's section


def min_images() -> int:
    """The fewest images of which the check holds ``MIN_CHECK_IMAGES`` out (``held_out_positions``' rounding)."""
    return next(n for n in range(int(MIN_CHECK_IMAGES / CHECK_SHARE) + 2) if round(CHECK_SHARE * n) >= MIN_CHECK_IMAGES)


def held_out_positions(images: int, seed: int) -> np.ndarray:
    """The train positions the check holds out of training (sorted): a seeded ``CHECK_SHARE`` of ``images``, at most
    ``MAX_CHECK_IMAGES``; none where that share would be under ``MIN_CHECK_IMAGES``."""
    count = min(round(CHECK_SHARE * images), MAX_CHECK_IMAGES)
    if count < MIN_CHECK_IMAGES:
        return np.zeros(0, dtype=np.int64)
    return np.sort(np.random.default_rng([seed, 1]).choice(images, count, replace=False)).astype(np.int64)


def group_labels(features: np.ndarray, group: Callable[[np.ndarray], np.ndarray]) -> list[int]:
    """The check's targets: ``group`` over ``features`` (the pretrained backbone's). An image alone in its group
    asks nothing (no other image shares its label) but stays in the others' galleries, as in the catalogue."""
    return [int(g) for g in np.asarray(group(features), dtype=np.int64)]


def compare_on_groups(trained: np.ndarray, start: np.ndarray, labels: list[int],
                      seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """The trained model against the start on the held-out images' groups (``labels``, one per image): per query
    AP@R and Recall@1 among the other held-out images, the mean AP@R gain with its paired bootstrap interval, and
    ``told``: the gain is at least ``MIN_PROXY_GAIN``, its interval lies above 0 and Recall@1 is not worse beyond
    noise (``worse_on_labels``), on ``MIN_QUERIES`` queries or more."""
    trained, start = (l2_normalize_rows(np.asarray(x, dtype=np.float32), zero_rows="keep") for x in (trained, start))
    model_scores = label_metrics_per_query(trained, trained, labels)
    start_scores = label_metrics_per_query(start, start, labels)
    if model_scores is None or start_scores is None or len(model_scores["map@r"]) < MIN_QUERIES:
        queries = 0 if model_scores is None else len(model_scores["map@r"])
        return {"told": False, "queries": queries, "reason": f"the held-out images formed groups for {queries} "
                f"queries, fewer than the {MIN_QUERIES} the check needs"}
    means = bootstrap_means(np.stack([model_scores["map@r"], start_scores["map@r"]], axis=1), seed=seed)
    tails = [(1 - CONFIDENCE) / 2, (1 + CONFIDENCE) / 2]
    low, high = (float(x) for x in np.quantile(means[:, 0] - means[:, 1], tails))
    gain = float(model_scores["map@r"].mean() - start_scores["map@r"].mean())
    worse = worse_on_labels(model_scores, start_scores)
    told = gain >= MIN_PROXY_GAIN and low > 0 and not worse["worse"]
    return {"told": bool(told), "queries": len(model_scores["map@r"]), "gain": gain, "interval": [low, high],
            "recall@1_change": worse["difference"]["recall@1"], "recall@1_interval": worse["interval"]["recall@1"],
            "trained_map@r": float(model_scores["map@r"].mean()), "start_map@r": float(start_scores["map@r"].mean())}


def check_sentence(result: dict[str, Any]) -> str:
    """The report's reason, one sentence for people."""
    if "gain" not in result:
        return f"keep the pretrained export: the label-free check cannot tell the trained model from its start " \
               f"({result['reason']})"
    low, high = result["interval"]
    measured = (f"on {result['queries']} held-out images' pseudo-label groups the trained model's MAP@R is "
                f"{result['trained_map@r']:.3f} against the start's {result['start_map@r']:.3f} (gain "
                f"{result['gain']:+.3f}, 95% interval {low:+.3f} to {high:+.3f}; Recall@1 "
                f"{result['recall@1_change']:+.3f})")
    if result["told"]:
        return f"the trained model is delivered: {measured}"
    if high < 0:
        return f"keep the pretrained export: the trained model is worse than its start ({measured})"
    return (f"keep the pretrained export: the label-free check cannot tell the trained model from its start "
            f"({measured}; it needs a gain of {MIN_PROXY_GAIN} or more with the whole interval above 0)")


def too_few_images_reason(images: int) -> str:
    """Why a set of ``images`` images cannot be checked, and the way out."""
    return (f"{images} images, fewer than the {min_images()} of which it holds {MIN_CHECK_IMAGES} out "
            f"({CHECK_SHARE:.0%}); --no-label-free-check trains on every image and delivers the --kept-floor guard's "
            "choice unchecked")


def measure(out: Path, features, check_images, eval_model, group: Callable[[np.ndarray], np.ndarray],
            guard_kept_start: bool, delivered: str, barrier: Callable[[], None]) -> dict[str, Any]:
    """The check of the run in ``out``: the held-out ``check_images`` (a ``Subset`` of the train images) embedded by
    the pretrained backbone, by the ``delivered`` checkpoint's model (wise.pt where the run made one, else best.pt)
    and by the start's (``START_CHECKPOINT``, through a copy of ``eval_model``), grouped by ``group`` and compared
    (``compare_on_groups``). Every rank embeds (it may be collective), after ``barrier`` (rank 0 wrote the
    checkpoints); ``guard_kept_start``: best.pt, delivered, is already the start, nothing to tell."""
    import copy

    from retrieval.models import BEST_CHECKPOINT, load_checkpoint

    barrier()
    checked = {"model": delivered}
    if guard_kept_start and delivered == BEST_CHECKPOINT:
        return {"told": False, "queries": 0, **checked,
                "reason": "no trained epoch kept the --kept-floor share of neighbours"}
    if check_images is None or not len(check_images):
        images = len(getattr(check_images, "dataset", None) or [])
        return {"told": False, "queries": 0, **checked, "reason": too_few_images_reason(images)}
    if not (out / START_CHECKPOINT).is_file():
        return {"told": False, "queries": 0, **checked,
                "reason": f"the start's weights ({START_CHECKPOINT}) are missing"}
    model = copy.deepcopy(eval_model).eval()
    embedded = {}
    for name, path in (("trained", out / delivered), ("start", out / START_CHECKPOINT)):
        model.load_state_dict(load_checkpoint(path, map_location="cpu").state_dict)
        embedded[name] = features.embed_train_subset(model, check_images)
    pretrained = features.embed_train_subset(model, check_images, head=False)
    rows = np.intersect1d(np.intersect1d(embedded["trained"].indices, embedded["start"].indices), pretrained.indices)

    def at(result) -> np.ndarray:  # the rows of images every model read, in one order
        order = np.argsort(result.indices, kind="stable")
        return result.embeddings[order[np.searchsorted(result.indices[order], rows)]]

    labels = group_labels(l2_normalize_rows(at(pretrained), zero_rows="keep"), group)
    return {**compare_on_groups(at(embedded["trained"]), at(embedded["start"]), labels), **checked,
            "images": len(rows)}


def keep_start(out: Path) -> None:
    """The start's checkpoint (best.pt as epoch 0 wrote it) kept as ``START_CHECKPOINT``."""
    shutil.copyfile(out / "best.pt", out / START_CHECKPOINT)


def deliver(out: Path, report: dict[str, Any], result: dict[str, Any], start_row: dict[str, Any] | None,
            pretrained: dict[str, Any]) -> dict[str, Any]:
    """The report with the check's verdict (``keep_pretrained`` and its reason, the check's section) and
    ``pretrained`` (the pretrained export's command, input size and resize). Where the check cannot tell, the start
    becomes the delivered model: best.pt (and wise.pt, which the report then no longer names) hold its weights, the
    report's ``best`` is its row (``{"epoch": 0}`` without one; the trained one kept in the check's section) and the
    section's ``start_delivered`` says so. Writes report.json again."""
    from retrieval.models import BEST_CHECKPOINT, WISE_CHECKPOINT
    from retrieval.reports import save_report
    from retrieval.utils.io import atomic_write

    keep = not result["told"]
    section = {**result, "start_delivered": False}
    if keep and (out / START_CHECKPOINT).is_file():
        weights = (out / START_CHECKPOINT).read_bytes()
        section.update(trained=report.get("best"), start_delivered=True)
        atomic_write(out / BEST_CHECKPOINT, weights)
        checkpoints = dict(report.get("checkpoints") or {})
        if checkpoints.pop("wise", None) is not None:  # wise.pt was the delivered model: the start replaces it too
            atomic_write(out / WISE_CHECKPOINT, weights)
        report = {**report, "best": start_row or {"epoch": 0}, "checkpoints": checkpoints}
    report = {**report, "keep_pretrained": keep, "keep_pretrained_reason": check_sentence(result),
              "pretrained_export": {**(report.get("pretrained_export") or {}), **pretrained}, CHECK_KEY: section}
    save_report(report, out / "report.json")
    return report
