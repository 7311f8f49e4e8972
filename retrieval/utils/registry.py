"""A tiny name -> factory registry shared by models, losses and datasets (timm style)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to factories; ``register`` is a decorator, ``get`` names the choices on a miss.

    ``paths`` lists factories as a table instead, name -> ``"module:attribute"``: each is imported the first time its
    name is built or asked for, so listing the names imports nothing and the table's module stays a leaf.
    """

    def __init__(self, kind: str, paths: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}
        self._paths = dict(paths or {})

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def decorator(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return decorator

    def get(self, name: str) -> Callable[..., T]:
        if name not in self._factories and name in self._paths:
            module, _, attribute = self._paths[name].partition(":")
            self._factories[name] = getattr(importlib.import_module(module), attribute)
        try:
            return self._factories[name]
        except KeyError:
            raise KeyError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None

    def build(self, name: str, **kwargs: Any) -> T:
        return self.get(name)(**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories.keys() | self._paths.keys())

    def __contains__(self, name: object) -> bool:
        return name in self._factories or name in self._paths
