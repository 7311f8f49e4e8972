"""Synthetic label noise for robustness experiments.

symmetric:  each label is replaced, with probability ``rate`` (= 1 - delta), by a uniformly random
            *other* class.
asymmetric: class-dependent flips between similar classes; each label ``src`` in ``transitions``
            becomes ``transitions[src]`` with probability ``rate``; other labels stay clean.

Which classes are "similar" depends on the data set (DCDL's protocol: "flip to a similar class"), so the
transitions are per data set, by class name (``asymmetric_transitions``): a known table for Fashion-MNIST and
the digits, or a table the user passes (``--label-noise-transitions FILE``); any other data set is refused
with that hint rather than flipping unrelated class indices.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from retrieval.errors import ParameterError

# Fashion-MNIST indices: 0 t-shirt, 2 pullover, 4 coat, 5 sandal, 6 shirt, 7 sneaker.
FASHION_MNIST_ASYMMETRIC: dict[int, int] = {6: 0, 0: 6, 2: 4, 7: 5}

# Known tables, by class name (source -> target), per data set key.
KNOWN_TRANSITIONS: dict[str, list[tuple[str, str]]] = {
    # DCDL's Fashion-MNIST protocol: shirt <-> t-shirt, pullover -> coat, sneaker -> sandal
    "fashion-mnist": [("shirt", "t-shirt"), ("t-shirt", "shirt"), ("pullover", "coat"), ("sneaker", "sandal")],
    # the MNIST table of Patrini et al. 2017 ("Making deep neural networks robust to label noise", sec. 6):
    # 2 -> 7, 3 -> 8, 5 <-> 6, 7 -> 1, used for the 8 x 8 scikit-learn digits as well
    "digits": [("2", "7"), ("3", "8"), ("5", "6"), ("6", "5"), ("7", "1")],
}
TRANSITIONS_HINT = (
    'a table of similar classes is a file: a JSON object {"from class": "to class", ...} or a CSV with two '
    "columns from,to, by class name"
)
MAX_TRANSITIONS_BYTES = 1 << 20  # a transitions file is a small table


def read_transitions(path: str | Path) -> list[tuple[str, str]]:
    """(source, target) class-name pairs from a JSON object / list of pairs or a two-column CSV (header optional)."""
    path = Path(path)
    if not path.is_file():
        raise ParameterError("path", f"{str(path)!r} names no file; {TRANSITIONS_HINT}")
    if path.stat().st_size > MAX_TRANSITIONS_BYTES:
        raise ParameterError("path", f"{path} is larger than {MAX_TRANSITIONS_BYTES} bytes")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ParameterError("path", f"{path} is not valid JSON ({exc}); {TRANSITIONS_HINT}") from None
        items = data.items() if isinstance(data, dict) else data
        try:
            pairs = [(str(a), str(b)) for a, b in items]
        except (TypeError, ValueError):
            raise ParameterError("path", f"{path} must hold an object or a list of [from, to] pairs; "
                                         f"{TRANSITIONS_HINT}") from None
    else:
        rows = [r for r in csv.reader(text.splitlines()) if r and any(c.strip() for c in r)]
        if any(len(r) != 2 for r in rows):
            raise ParameterError("path", f"{path}: every CSV row needs two columns from,to")
        pairs = [(a.strip(), b.strip()) for a, b in rows]
        if pairs and pairs[0] in (("from", "to"), ("source", "target")):
            pairs = pairs[1:]
    if not pairs:
        raise ParameterError("path", f"{path} holds no transition; {TRANSITIONS_HINT}")
    return pairs


def asymmetric_transitions(
    dataset: str, class_names: Sequence[str], table: str | Path | None = None
) -> tuple[dict[int, int], dict[str, Any]]:
    """({source index: target index}, what to record) for asymmetric noise on a split with ``class_names``.

    ``table`` (a file, see ``read_transitions``) wins; else the data set's known table, whose pairs with a
    class outside this split (e.g. a class-disjoint half) are left out; else a ValueError naming the fix.
    """
    if table is not None:
        try:
            pairs, source, strict = read_transitions(table), str(table), True
        except ParameterError as exc:
            raise exc.renamed("table") from None
    elif dataset in KNOWN_TRANSITIONS:
        pairs, source, strict = KNOWN_TRANSITIONS[dataset], f"known table for {dataset}", False
    else:
        raise ParameterError(
            "table", f"is needed: asymmetric label noise flips classes to similar ones, and no table of similar "
            f"classes is known for dataset {dataset!r} (known: {', '.join(sorted(KNOWN_TRANSITIONS))}); "
            f"{TRANSITIONS_HINT}"
        )
    index = {name: i for i, name in enumerate(class_names)}
    unknown = sorted({name for pair in pairs for name in pair if name not in index})
    if unknown and strict:
        raise ParameterError("table", f"names classes that are not in the training split: {unknown[:5]}; its "
                                      f"classes are e.g. {list(class_names)[:5]}")
    kept = [(a, b) for a, b in pairs if a in index and b in index and a != b]
    mapping = {index[a]: index[b] for a, b in kept}
    if len(mapping) < len(kept):
        raise ValueError(f"transitions from {source} give one class two targets; each class flips to one class")
    if not mapping:
        raise ValueError(f"none of the transitions of {source} has both classes in the training split; "
                         f"{TRANSITIONS_HINT}")
    return mapping, {"transitions_source": source, "transitions_by_name": [list(p) for p in kept]}

MODES = ("symmetric", "asymmetric")


def inject_label_noise(
    labels: Sequence[int] | np.ndarray,
    mode: str,
    rate: float,
    num_classes: int | None = None,
    transitions: Mapping[int, int] | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Return ``(noisy_labels, info)``; the input is not modified.

    ``info`` is JSON-able: mode, rate, seed, num_classes, flipped (count), actual_rate
    (flipped / all labels) and, for asymmetric noise, the transitions and the rate among the
    labels that could flip.
    """
    clean = np.asarray(labels, dtype=np.int64).reshape(-1)
    if mode not in MODES:
        raise ValueError(f"unknown noise mode {mode!r}; choose 'symmetric' or 'asymmetric'")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"noise rate must lie in [0, 1], got {rate}")
    if len(clean) and clean.min() < 0:
        raise ValueError("labels must be non-negative class indices")
    num_classes = int(num_classes if num_classes is not None else (clean.max() + 1 if len(clean) else 0))
    if len(clean) and clean.max() >= num_classes:
        raise ValueError(f"label {clean.max()} does not fit num_classes={num_classes}")
    rng = np.random.default_rng(seed)
    info: dict[str, Any] = {"mode": mode, "rate": float(rate), "seed": int(seed), "num_classes": num_classes}

    if mode == "symmetric":
        if num_classes < 2:
            raise ValueError("symmetric noise needs at least 2 classes")
        flip = rng.random(len(clean)) < rate
        # A shift of 1..C-1 modulo C is a uniform draw among the other classes.
        shift = rng.integers(1, num_classes, size=len(clean))
        noisy = np.where(flip, (clean + shift) % num_classes, clean)
    else:
        if not transitions:
            raise ValueError(
                "asymmetric noise needs transitions={source: target}, e.g. FASHION_MNIST_ASYMMETRIC"
            )
        mapping = {int(s): int(t) for s, t in transitions.items()}
        bad = [c for pair in mapping.items() for c in pair if not 0 <= c < num_classes]
        if bad:
            raise ValueError(f"transition classes {bad} are outside 0..{num_classes - 1}")
        target = np.array([mapping.get(c, c) for c in range(num_classes)], dtype=np.int64)
        eligible = np.isin(clean, list(mapping))
        flip = eligible & (rng.random(len(clean)) < rate)
        noisy = np.where(flip, target[clean], clean)
        info["transitions"] = [[s, t] for s, t in sorted(mapping.items())]
        changed = int((noisy != clean).sum())
        info["actual_rate_among_eligible"] = changed / int(eligible.sum()) if eligible.any() else 0.0

    flipped = int((noisy != clean).sum())
    info["flipped"] = flipped
    info["actual_rate"] = flipped / len(clean) if len(clean) else 0.0
    return noisy.astype(np.int64), info
