"""Layer-wise learning-rate decay (LLRD, as in ELECTRA and BEiT): lr_i = base_lr * decay^(L - 1 - i).

Layer 0 is nearest the input, layer L - 1 (nearest the output) trains at base_lr, so the general early features
move least. ``backbone_layers`` says what a layer is:

- a torchvision ResNet (``conv1``, ``layer1``..``layer4``): the stem (everything before layer1), each of layer1..4,
  then what follows layer4 if it has trainable parameters;
- any other module: the shallowest nn.ModuleList / nn.Sequential (breadth first) that has at least two children
  with trainable parameters and holds at least half of all trainable parameter tensors is the block list; each of
  its children is a layer, everything before it (including parameters held directly by its ancestors, such as a
  ViT's class token and position embedding) is the first layer and everything after it the last one.
  EfficientNet-Lite0 gives stem (_conv_stem, _bn0), each of _blocks, head (_conv_head, _bn1); torchvision's
  EfficientNet and ConvNeXt the children of ``features``; ViT each encoder block;
- with no such block list: the top-level children in registration order (e.g. GoogLeNet's convs and inceptions).

Children without trainable parameters are skipped, and every trainable parameter is in exactly one layer.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from torch import nn

__all__ = ["backbone_layers", "layerwise_param_groups"]

Layer = list[tuple[str, nn.Parameter]]


def _trainable(module: nn.Module, prefix: str, seen: set[int], recurse: bool = True) -> Layer:
    """The trainable parameters of ``module`` not yet in ``seen`` (tied weights count once), named from the root."""
    out: Layer = []
    for name, param in module.named_parameters(prefix=prefix, recurse=recurse):
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _count(module: nn.Module) -> int:
    return sum(1 for p in module.parameters() if p.requires_grad)


def _find_block_list(root: nn.Module) -> tuple[list[str], list[str]] | None:
    """(path to the block list, its children's names), the shallowest container that qualifies, or None."""
    total = _count(root)
    queue: deque[tuple[list[str], nn.Module]] = deque([([], root)])
    while queue:
        path, module = queue.popleft()
        if path and isinstance(module, (nn.ModuleList, nn.Sequential)):
            blocks = [name for name, child in module.named_children() if _count(child)]
            if len(blocks) >= 2 and 2 * _count(module) >= total:
                return path, list(dict(module.named_children()))
        queue.extend((path + [name], child) for name, child in module.named_children())
    return None


def _split(root: nn.Module, path: list[str], blocks: list[str]) -> list[Layer]:
    """Layers around the run of children ``blocks`` of the module at ``path``: [before] + one per block + [after]."""
    seen: set[int] = set()
    before: Layer = []
    afters: list[Layer] = []  # one per level, innermost last
    module, prefix = root, ""
    for depth in range(len(path) + 1):
        # Directly held parameters (class token, position embedding) feed the input side.
        before += _trainable(module, prefix, seen, recurse=False)
        stop = set(blocks) if depth == len(path) else {path[depth]}
        after: Layer = []
        passed = False
        for name, child in module.named_children():
            if name in stop:
                passed = True
                continue
            (after if passed else before).extend(_trainable(child, _join(prefix, name), seen))
        afters.append(after)
        if depth < len(path):
            module, prefix = getattr(module, path[depth]), _join(prefix, path[depth])
    block_layers = [_trainable(getattr(module, name), _join(prefix, name), seen) for name in blocks]
    # What follows the blocks inside their parent comes before what follows an outer ancestor.
    last = [item for after in reversed(afters) for item in after]
    return [layer for layer in [before, *block_layers, last] if layer]


def backbone_layers(backbone: nn.Module) -> list[Layer]:
    """The backbone's trainable (name, parameter) pairs grouped by depth, input first (see the module docstring)."""
    names = dict(backbone.named_children())
    if "conv1" in names and all(f"layer{i}" in names for i in range(1, 5)):
        return _split(backbone, [], [f"layer{i}" for i in range(1, 5)])
    found = _find_block_list(backbone)
    if found is not None:
        return _split(backbone, *found)
    seen: set[int] = set()
    layers = [_trainable(backbone, "", seen, recurse=False)]
    layers += [_trainable(child, name, seen) for name, child in backbone.named_children()]
    return [layer for layer in layers if layer]


def layerwise_param_groups(backbone: nn.Module, base_lr: float, decay: float, **group_options: Any) -> list[dict]:
    """Optimizer param groups, one per layer of ``backbone_layers``: lr = base_lr * decay^(L - 1 - i)."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"layer decay must be in (0, 1], got {decay}")
    if not base_lr >= 0.0:
        raise ValueError(f"base_lr must be >= 0, got {base_lr}")
    layers = backbone_layers(backbone)
    n = len(layers)
    return [
        {**group_options, "params": [p for _, p in layer], "lr": base_lr * decay ** (n - 1 - i),
         "name": f"backbone.layer{i}"}
        for i, layer in enumerate(layers)
    ]
