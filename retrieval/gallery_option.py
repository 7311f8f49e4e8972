"""``--gallery-root DIR``, declared once (``retrieval.options``): where an index's gallery is read from when it moved
somewhere the index folder does not say (``retrieval.index.portable``). A leaf, so that the command line declares
it without loading the index code; ``retrieval serve`` declares it in ``ServerConfig`` from the same function."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from retrieval.options import option

GALLERY_ROOT_HELP = (
    "the folder that holds the index's gallery now, where it moved away from the index folder (its images are read "
    "at the same paths under it; none outside it is ever opened). Not needed when the index, the model and the "
    "gallery were moved or renamed together: index.json finds them relative to the index folder.")


def gallery_root_option(section: str) -> Any:
    """The declaration of ``--gallery-root`` for a config whose options are listed under ``section``."""
    return option(None, section, GALLERY_ROOT_HELP, path="dir", metavar="DIR",
                  default_text="the recorded gallery root, else the one recorded relative to the index folder")


@dataclass(frozen=True)
class GalleryRoot:
    """The ``--gallery-root`` of ``retrieval search`` and the index writers (add, upgrade, repair)."""

    gallery_root: Path | None = gallery_root_option("gallery")
