"""Synthetic label noise for robustness experiments.

symmetric:  each label is replaced, with probability ``rate`` (= 1 - delta), by a uniformly random
            *other* class.
asymmetric: class-dependent flips between similar classes; each label ``src`` in ``transitions``
            becomes ``transitions[src]`` with probability ``rate``; other labels stay clean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Fashion-MNIST indices: 0 t-shirt, 2 pullover, 4 coat, 5 sandal, 6 shirt, 7 sneaker.
FASHION_MNIST_ASYMMETRIC: dict[int, int] = {6: 0, 0: 6, 2: 4, 7: 5}

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
