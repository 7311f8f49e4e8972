"""What `retrieval export` says to run next, read from the exported model's metadata: an index of the model; or, for
a model trained --compatible-with an old one, the upgrade of the old model's index, which keeps serving while it
re-embeds; or, where its training measured it not compatible (which `retrieval index upgrade` refuses:
``retrieval.index.writing.upgrade_checks``), an index built into a new folder."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

OLD_SHOWN = 3  # old model hashes a line names


def declared_old_models(metadata: Mapping[str, str]) -> list[str]:
    """The model hashes a model declares itself compatible with (its metadata's ``compatible_with``), sorted and
    each cut to 64 characters; [] if none or unreadable."""
    from retrieval.index.query_embedder import compatible_hashes

    return sorted(h[:64] for h in compatible_hashes(metadata))


def export_next_step(model: str | Path, metadata: Mapping[str, str]) -> str:
    """The command to run after exporting ``model`` (and why, for a model declared compatible with an old one)."""
    from retrieval.compatibility import COMPATIBILITY_METRICS, NOT_COMPATIBLE, TOO_FEW, recorded_compatibility

    path = shlex.quote(str(model))
    old = declared_old_models(metadata)
    if not old:
        return f"retrieval index build --model {path} --images YOUR_IMAGES --out INDEX"
    more = f" and {len(old) - OLD_SHOWN} more" if len(old) > OLD_SHOWN else ""
    names = f"model_hash {', '.join(old[:OLD_SHOWN])}{more}"
    record = recorded_compatibility(metadata)
    if record is not None and record["verdict"] == NOT_COMPATIBLE:
        metric = COMPATIBILITY_METRICS[0]
        measured = (f"new queries on the old gallery {metric} {record['cross_model'][metric]:.3f} vs the old model's "
                    f"{record['old'][metric]:.3f}")
        return (f"retrieval index build --model {path} --images YOUR_IMAGES --out NEW_INDEX   (a new folder: its "
                f"training measured it not compatible with the old model ({names}; {measured}), so `retrieval index "
                "upgrade` of the old index would refuse it: that upgrade serves new queries against the old vectors "
                "until every image is re-embedded)")
    said = ("" if record is None else
            "; its training could not tell whether it is compatible, so the upgrade checks it on the index's labels "
            "first" if record["verdict"] == TOO_FEW else "; its training measured it compatible")
    return (f"retrieval index upgrade INDEX --model {path}   (INDEX: the index the old model built, {names}: it "
            f"keeps serving while the upgrade re-embeds its images{said})")
