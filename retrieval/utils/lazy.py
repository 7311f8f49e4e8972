"""Package names imported on first use (PEP 562), so that importing one light submodule stays light.

A package whose public names include torch-backed ones lists each name once, under the submodule that defines it:
a process that needs only a light submodule (the decoder in a Ray actor or in the server, ``TrainConfig`` in the
command line) then never pays for torch (~4 s in a fresh process).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(
    package: str, sources: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names live in its submodules.

    ``sources`` maps a submodule's name to the public names it defines; a name is imported from it on first
    access and then kept in the package's namespace (later lookups are plain attribute reads).
    """
    module_of = {name: module for module, names in sources.items() for name in names}
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = module_of.get(name)
        if module is None:  # also lets ``from package import submodule`` fall back to importing it
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of))

    return __getattr__, __dir__
