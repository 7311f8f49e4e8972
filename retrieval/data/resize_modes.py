"""How an image of any shape becomes a model's square input: the modes, recorded in a model config as ``resize``
(standard library only: the command line declares ``--resize`` from them before it imports PIL or NumPy). The
pixels each mode gives are ``retrieval.data.eval_preprocess``'s."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CROP, PAD = "crop", "pad"
RESIZE_MODES = (CROP, PAD)  # crop: the short side resized, the centre kept; pad: the whole image, letterboxed


def resize_mode(model_config: Mapping[str, Any]) -> str:
    """The model config's resize mode, checked: ``crop`` (also for configs from before the mode) or ``pad``."""
    mode = model_config.get("resize") or CROP
    if mode not in RESIZE_MODES:
        raise ValueError(f"model_config['resize'] must be one of {', '.join(RESIZE_MODES)}, got {mode!r}")
    return mode
