"""How two embedders relate, measured and said plainly: backward compatibility (BCT's three blocks) and, without
labels, how much one changes each image's neighbours. Torch-free on import: the app reads reports with it; the
metrics are computed by ``retrieval.metrics`` and the neighbours by faiss, imported when used."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from retrieval.errors import ParameterError

# the metrics BCT's empirical criterion compares: M(new queries, old gallery) >= M(old queries, old gallery)
COMPATIBILITY_METRICS = ("recall@1", "map@r")
# the criterion is read through an interval, not two means: a paired percentile bootstrap over the queries, seeded,
# so that every place that says the verdict (evaluate, the training report, the app, the upgrade) says the same
COMPATIBLE, NOT_COMPATIBLE, TOO_FEW = "compatible", "not compatible", "too few queries to tell"
VERDICTS = (COMPATIBLE, NOT_COMPATIBLE, TOO_FEW)
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
CONFIDENCE = 0.95
MIN_QUERIES = 20  # below this a bootstrap's interval is too narrow to trust: the verdict is TOO_FEW
MIN_DROP = 0.01  # a model measured worse by less than this is not called worse, however sure the interval
RESAMPLE_CHUNK = 2**22  # query indices drawn at once (32 MiB of int64), whatever the number of queries
# ONNX metadata: the compatibility measured when the model was trained (`retrieval export` writes it from the
# checkpoint, `retrieval index upgrade` says it)
COMPATIBILITY_KEY = "compatibility"
# label-free: the mean share of an image's top-KEPT_K neighbours that a model keeps from another's (a training
# run's --eval-extra sets: from the pretrained backbone's; WiSE-FT's curve: from the start's)
KEPT_K = 10
KEPT = f"neighbours_kept@{KEPT_K}"
# an int8 model against its fp32 parent (`retrieval export --int8`): the neighbours each image keeps; the record its
# metadata holds under onnx_runtime.INT8_KEY
INT8_NEIGHBOURS = 10
INT8_KEY = "int8"


def compatibility_metrics(new_query: np.ndarray, old_query: np.ndarray, query_labels: np.ndarray,
                          new_gallery: np.ndarray | None = None, old_gallery: np.ndarray | None = None,
                          gallery_labels: np.ndarray | None = None,
                          cross_query: np.ndarray | None = None) -> dict[str, Any]:
    """Backward compatibility of a new embedder with an old one (Shen et al., BCT, CVPR 2020, sec. 3): ``new``
    (new queries, new gallery), ``old`` (old, old), ``cross_model`` (new queries against the gallery the old model
    embedded), and ``verdict`` and ``interval`` (``compatibility_verdict``): BCT's criterion, cross_model >= old on
    each of ``COMPATIBILITY_METRICS``, read through a bootstrap over the queries.

    ``cross_query``: the new queries as they meet the old gallery, for a new model of another embedding size (its
    projection into the old space, ``retrieval.models.in_compatible_space``); default ``new_query``. ``new``
    stays on the new model's own embeddings.

    Without a separate gallery each image is a query against the others (leave-one-out); in ``cross_model`` the
    query's own old embedding is left out too (``same_items``)."""
    from retrieval.metrics import evaluate, mean_metrics, per_query_metrics

    ks = tuple(k for k in (1, 2, 4, 8) if k < len(query_labels)) or (1,)
    names = ["recall", "map@r", "r_precision"]
    if (new_gallery is None) != (old_gallery is None):
        raise ParameterError("old_gallery", "must be given with new_gallery (or neither, for leave-one-out)")
    cross_query = new_query if cross_query is None else cross_query
    if np.shape(cross_query)[-1] != np.shape(old_query)[-1]:
        raise ParameterError("cross_query", f"the new model's queries have {np.shape(cross_query)[-1]} dimensions, "
                                            f"the old model's {np.shape(old_query)[-1]}: embeddings of two sizes "
                                            "cannot be compared; a new size needs a model trained compatible with "
                                            "the old one, which learns a projection into its space")
    if new_gallery is None:
        new = evaluate(new_query, query_labels, ks=ks, metrics=names)
        old = per_query_metrics(old_query, query_labels, ks=ks, metrics=names)
        cross = per_query_metrics(cross_query, query_labels, old_query, query_labels, ks=ks, metrics=names,
                                  same_items=True)
    else:
        new = evaluate(new_query, query_labels, new_gallery, gallery_labels, ks=ks, metrics=names)
        old = per_query_metrics(old_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
        cross = per_query_metrics(cross_query, query_labels, old_gallery, gallery_labels, ks=ks, metrics=names)
    return {"new": new, "old": mean_metrics(old), "cross_model": mean_metrics(cross),
            **compatibility_verdict(cross, old)}


def bootstrap_means(values: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES,
                    seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """Means of each column of ``values`` [n queries, m series] over ``resamples`` draws of n queries with
    replacement, every series on the same draws (paired): [resamples, m]."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n < 1 or resamples < 1:
        raise ParameterError("values", f"needs at least one query and one resample, got {n} and {resamples}")
    rng = np.random.default_rng(seed)
    series = np.ascontiguousarray(values.T)  # a gather from a contiguous row is ~2x faster than from a column
    means = np.empty((resamples, len(series)))
    per_chunk = max(1, RESAMPLE_CHUNK // n)  # bounded memory; the draws are the same stream as one at a time
    for start in range(0, resamples, per_chunk):
        drawn = rng.integers(0, n, size=(min(per_chunk, resamples - start), n))
        for column, row in enumerate(series):
            means[start:start + len(drawn), column] = np.take(row, drawn).mean(axis=1)
    return means


def compatibility_verdict(cross: Mapping[str, np.ndarray], old: Mapping[str, np.ndarray],
                          resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                          confidence: float = CONFIDENCE) -> dict[str, Any]:
    """THE verdict on BCT's criterion from per-query metrics (``retrieval.metrics.per_query_metrics``: NaN where
    a query has no relevant item) of new queries against the old gallery (``cross``) and of old against old.

    Returns ``{"verdict": ..., "interval": ...}``: the interval holds ``queries``, ``resamples``, ``seed``,
    ``confidence`` and, per metric of ``COMPATIBILITY_METRICS``, the percentile intervals of the ``cross_model``
    mean, the ``old`` mean and their ``difference`` (cross - old), all from the same resampled queries. The
    verdict: ``compatible`` when every difference's interval lies at or above 0, ``not compatible`` when one lies
    below 0, else (and under ``MIN_QUERIES`` queries) ``too few queries to tell``."""
    if not 0 < confidence < 1:
        raise ParameterError("confidence", f"must be between 0 and 1, got {confidence}")
    measured = ~np.isnan(np.asarray(old[COMPATIBILITY_METRICS[0]], dtype=np.float64))
    columns = []
    for name in COMPATIBILITY_METRICS:
        pair = [np.asarray(series[name], dtype=np.float64) for series in (cross, old)]
        if any(values.shape != measured.shape or not np.array_equal(~np.isnan(values), measured) for values in pair):
            raise ParameterError("cross", f"must measure the same queries as old ({name}: one gallery's labels)")
        columns += [values[measured] for values in pair]
    means = bootstrap_means(np.stack(columns, axis=1), resamples, seed)
    tails = [(1 - confidence) / 2, (1 + confidence) / 2]

    def interval(draws: np.ndarray) -> list[float]:
        return [float(bound) for bound in np.quantile(draws, tails)]

    blocks: dict[str, dict[str, list[float]]] = {"cross_model": {}, "old": {}, "difference": {}}
    for i, name in enumerate(COMPATIBILITY_METRICS):
        cross_means, old_means = means[:, 2 * i], means[:, 2 * i + 1]
        blocks["cross_model"][name], blocks["old"][name] = interval(cross_means), interval(old_means)
        blocks["difference"][name] = interval(cross_means - old_means)
    queries = int(measured.sum())
    differences = blocks["difference"].values()
    if queries < MIN_QUERIES:
        verdict = TOO_FEW
    elif any(high < 0 for _, high in differences):
        verdict = NOT_COMPATIBLE
    elif all(low >= 0 for low, _ in differences):
        verdict = COMPATIBLE
    else:
        verdict = TOO_FEW
    return {"verdict": verdict, "interval": {"queries": queries, "resamples": int(resamples), "seed": int(seed),
                                             "confidence": float(confidence), **blocks}}


def compatibility_sentence(blocks: Mapping[str, Any]) -> str:
    """BCT's criterion said plainly: the verdict, the means it compares and the interval of their difference
    (``blocks``: ``compatibility_metrics``' answer, or a report's or a model's record of it)."""
    cross, old = blocks["cross_model"], blocks["old"]
    verdict, interval = blocks.get("verdict"), blocks.get("interval")
    if verdict not in VERDICTS or not isinstance(interval, Mapping):  # a report written before the interval
        compared = ", ".join(f"{name} {cross[name]:.3f} vs {old[name]:.3f}" for name in COMPATIBILITY_METRICS)
        return (f"no verdict: cross-model vs old/old {compared}, measured without an interval (a report from "
                "before verdicts had one); evaluate again with --gallery-model for one")
    share = f"{float(interval['confidence']):.0%}"
    compared = "; ".join(
        f"{name} {cross[name]:.3f} vs {old[name]:.3f}, difference {cross[name] - old[name]:+.3f}, {share} interval "
        f"{interval['difference'][name][0]:+.3f} to {interval['difference'][name][1]:+.3f}"
        for name in COMPATIBILITY_METRICS)
    on = f"on {int(interval['queries']):,} queries, cross-model vs old/old: {compared}"
    if verdict == COMPATIBLE:
        return (f"compatible: new queries find the old gallery's images at least as well as old queries do ({on}); "
                "the index need not be re-embedded before the new model serves it")
    if verdict == NOT_COMPATIBLE:
        return (f"not compatible: new queries find the old gallery's images worse than old queries do ({on}); "
                "re-embed the gallery with the new model before it serves")
    few = (f"; fewer than {MIN_QUERIES} queries are too few for any verdict"
           if int(interval["queries"]) < MIN_QUERIES else "")
    return (f"too few queries to tell: the difference could be on either side of zero ({on}{few}); measure on more "
            "queries before the new model serves the old gallery, or re-embed the gallery first")


def compatibility_record(blocks: Mapping[str, Any] | None) -> str | None:
    """What a model carries of its measured compatibility (ONNX metadata ``COMPATIBILITY_KEY``): the blocks the
    verdict reads, as JSON; None without a verdict (not measured, or measured before verdicts had an interval)."""
    if not isinstance(blocks, Mapping) or blocks.get("verdict") not in VERDICTS:
        return None
    return json.dumps({key: blocks[key] for key in ("old", "cross_model", "verdict", "interval")}, sort_keys=True)


def recorded_compatibility(metadata: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The compatibility a model's metadata records (``compatibility_record``), or None: none, or unreadable."""
    raw = (metadata or {}).get(COMPATIBILITY_KEY)
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("verdict") not in VERDICTS:
        return None
    try:
        compatibility_sentence(record)  # a record is anyone's file: one the sentence cannot read is no record
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    return record


def label_metrics_per_query(queries: np.ndarray, gallery: np.ndarray, labels: Sequence[str | None]
                            ) -> dict[str, np.ndarray] | None:
    """Recall@1 and AP@R of each query of ``queries`` against ``gallery`` (unit rows of the same images, each left
    out of its own gallery; images without a label left out), for the queries whose label another image has, in
    order: the same queries whatever the embeddings, so two models' series pair up. None where no class has two
    images. NumPy, no torch: [n, n] similarities, so the caller bounds n (a sample)."""
    known = np.asarray([label is not None for label in labels], dtype=bool)
    names = np.asarray([str(label) for label in labels], dtype=object)[known]
    queries, gallery = queries[known], gallery[known]
    same = names[:, None] == names[None, :]
    np.fill_diagonal(same, False)
    relevant = same.sum(axis=1)
    asked = relevant > 0
    if not asked.any():
        return None
    scores = queries @ gallery.T
    np.fill_diagonal(scores, -np.inf)  # its own row is no answer
    order = np.argsort(-scores, axis=1, kind="stable")
    hits = np.take_along_axis(same, order, axis=1)[asked]
    counts = relevant[asked]
    ranks = np.arange(1, hits.shape[1] + 1)
    precision = np.cumsum(hits, axis=1) / ranks
    within = ranks[None, :] <= counts[:, None]  # MAP@R: the first R answers, R = the query's relevant images
    return {"recall@1": hits[:, 0].astype(np.float64), "map@r": (precision * hits * within).sum(axis=1) / counts}


def label_metrics(queries: np.ndarray, gallery: np.ndarray, labels: Sequence[str | None]
                  ) -> dict[str, float] | None:
    """Recall@1 and MAP@R of ``queries`` against ``gallery``: the means of ``label_metrics_per_query``."""
    per_query = label_metrics_per_query(queries, gallery, labels)
    return None if per_query is None else {name: float(values.mean()) for name, values in per_query.items()}


def worse_on_labels(candidate: Mapping[str, np.ndarray], baseline: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Whether ``candidate`` (per-query ``label_metrics_per_query`` of the same queries) is worse than
    ``baseline`` beyond noise: on some metric of ``COMPATIBILITY_METRICS`` the mean drops by at least ``MIN_DROP``
    and the whole interval of the difference lies below 0 (``compatibility_verdict``'s paired bootstrap, so that
    it reads noise as the verdicts do). Returns ``worse``, each metric's ``difference`` (candidate - baseline) and
    its ``interval``, and ``queries``; under ``MIN_QUERIES`` queries it never says worse (``too_few``)."""
    read = compatibility_verdict(candidate, baseline)["interval"]
    difference = {name: float(np.mean(candidate[name]) - np.mean(baseline[name])) for name in COMPATIBILITY_METRICS}
    too_few = read["queries"] < MIN_QUERIES
    worse = not too_few and any(difference[name] <= -MIN_DROP and read["difference"][name][1] < 0
                                for name in COMPATIBILITY_METRICS)
    return {"worse": bool(worse), "too_few": bool(too_few), "queries": int(read["queries"]),
            "difference": difference, "interval": read["difference"]}


def top_k(vectors: np.ndarray, k: int, queries: np.ndarray | None = None) -> np.ndarray:
    """Exact top-``k`` neighbours [n, k] of each unit row among the others (itself left out), by inner product;
    ``queries``: row i's neighbours are those of ``queries[i]`` (the same image embedded another way) among the rows,
    its own row still left out."""
    import faiss

    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    asked = vectors if queries is None else queries
    _, found = index.search(np.ascontiguousarray(asked, dtype=np.float32), k + 1)
    rows = np.arange(len(vectors))[:, None]
    kept = np.where(found == rows, -1, found)  # itself, wherever ties put it
    return np.stack([row[row >= 0][:k] for row in kept])


def neighbour_overlap(first: np.ndarray, second: np.ndarray, k: int = 10) -> np.ndarray:
    """Per row i: the share of i's ``k`` nearest rows under ``first`` that are among its ``k`` nearest under
    ``second`` (rows: the same images, embedded two ways; unit vectors). float64 [n] in [0, 1]."""
    if len(first) != len(second):
        raise ParameterError("second", f"must embed the same {len(first)} images as first, got {len(second)} rows")
    if not 1 <= k < len(first):
        raise ParameterError("k", f"must be between 1 and {len(first) - 1} (the images less one), got {k}")
    return _shared_share(top_k(first, k), top_k(second, k), k)


def _shared_share(first: np.ndarray, second: np.ndarray, k: int) -> np.ndarray:
    """Per row: the share of its ``k`` neighbours in ``first`` [n, k] that are in ``second`` [n, k]."""
    return np.asarray([len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(first, second, strict=True)])


def cross_neighbour_overlap(reference: np.ndarray, queries: np.ndarray, k: int = 10) -> np.ndarray:
    """Per row i: the share of i's ``k`` nearest rows under ``reference`` (among the others) that are among the ``k``
    nearest ``reference`` rows to ``queries[i]`` (its own row left out): what another model's query finds in a gallery
    ``reference`` embedded (the same images, unit vectors). float64 [n] in [0, 1]."""
    if np.shape(queries) != np.shape(reference):
        raise ParameterError("queries", f"must embed the same images in the same space as reference "
                                        f"{np.shape(reference)}, got {np.shape(queries)}")
    if not 1 <= k < len(reference):
        raise ParameterError("k", f"must be between 1 and {len(reference) - 1} (the images less one), got {k}")
    return _shared_share(top_k(reference, k), top_k(reference, k, queries), k)


def int8_record(metadata: Mapping[str, str] | None) -> dict[str, Any] | None:
    """What an int8 model's metadata records of its quantization (``INT8_KEY``: its parent, recipe, calibration and
    verification), or None: not an int8 model, or a record this version cannot read."""
    try:
        record = json.loads((metadata or {}).get(INT8_KEY) or "null")
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("verification"), dict):
        return None
    try:
        int8_sentence(record)  # anyone's file: a record the sentence cannot read is no record
    except (KeyError, TypeError, ValueError):
        return None
    return record


def int8_sentence(record: Mapping[str, Any]) -> str:
    """An int8 model's record in words: what it was quantized from and how close to it it stayed."""
    check, calibration = record["verification"], record["calibration"]
    return (f"int8 of fp32 model {record['fp32_model_hash']}, calibrated on {int(calibration['images'])} images of "
            f"{calibration['source']}; on {int(check['images'])} {'held-out' if check['held_out'] else 'calibration'} "
            f"images its cosine to fp32 had median {float(check['cosine']['median']):.4f}, each image kept "
            f"{float(check['neighbours_kept']):.2f} of its {INT8_NEIGHBOURS} nearest neighbours, and its queries kept "
            f"{float(check['int8_queries_in_fp32']):.2f} of them in an fp32 gallery (fp32 queries in an int8 gallery "
            f"{float(check['fp32_queries_in_int8']):.2f})")
