"""Counting the values a piece of code copies from tensors to Python: on a GPU each such read waits for every kernel
queued before it, so the host cannot queue more work meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class ReadsBack(TorchDispatchMode):
    """Counts, while active, ``scalars`` (``item``, ``float``, ``int``, ``bool`` of a tensor), ``lists``
    (``tolist``, which copies a whole tensor at once and dispatches nothing on the CPU) and ``shapes`` (``nonzero``
    and indexing with a boolean mask, whose output size a GPU must report to the host before anything that uses it
    can be queued)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars = 0
        self.lists = 0
        self.shapes = 0
        self._tolist: Callable[..., Any] | None = None

    @property
    def count(self) -> int:
        """Every wait for the device counted."""
        return self.scalars + self.lists + self.shapes

    def __enter__(self) -> ReadsBack:
        original = self._tolist = torch.Tensor.tolist

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.lists += 1
            return original(tensor, *args, **kwargs)

        torch.Tensor.tolist = counted
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.scalars += func is torch.ops.aten._local_scalar_dense.default
        self.shapes += func.overloadpacket is torch.ops.aten.nonzero or _indexes_with_a_mask(func, args)
        return func(*args, **(kwargs or {}))


def _indexes_with_a_mask(func: Any, args: tuple) -> bool:
    """``x[mask]`` (``x[mask] = v``): a GPU runs ``nonzero`` inside it (the CPU's kernel hides it)."""
    if func.overloadpacket not in (torch.ops.aten.index, torch.ops.aten.index_put, torch.ops.aten.index_put_):
        return False
    return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
               for index in (args[1] if len(args) > 1 else ()))
