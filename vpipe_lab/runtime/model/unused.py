"""Parameters and buffers the forward never touches, kept with the unit they belong to.

torch.export's graph lists only the tensors the forward reads, so a captured chain would drop DINOv2's
``embeddings.mask_token`` (used only with a mask), a head used in another mode, or any tensor left unused:
``Session.state_dict()``, checkpoints and export bundles would lack it and a strict load into the user's model would
fail. Each such tensor joins one unit, at its own dotted path inside that unit's graph module, so it lives on that
unit's stage, migrates, is checkpointed and comes back out like any other (it gets no gradient, as in plain
PyTorch, so no optimizer changes it). Its home is the unit that ran the module owning it; else the unit holding the
tensors whose names share the longest prefix with it (the last such unit on a tie: a head used in another mode goes
with the output end); else the first unit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["adopt", "home"]


def home(name: str, modules: Sequence[Sequence[str]], held: Sequence[Sequence[str]]) -> int:
    """The unit an unused tensor called ``name`` joins: ``modules[i]`` are the module paths unit ``i`` ran,
    ``held[i]`` the names of the tensors it holds."""
    owners = [i for i, mods in enumerate(modules) if any(name.startswith(m + ".") for m in mods if m)]
    if owners:
        return owners[0]
    best, score = 0, 0
    for i, names in enumerate(held):
        for other in names:
            common = _common_atoms(name, other)
            if common >= score and common > 0:
                best, score = i, common
    return best


def _common_atoms(a: str, b: str) -> int:
    count = 0
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1]):
        if x != y:
            break
        count += 1
    return count


def adopt(unit: nn.Module, path: str, tensor: torch.Tensor) -> None:
    """Register ``tensor`` on ``unit`` at the dotted ``path`` (``unit.graph.<path>`` for a captured unit, whose
    graph module mirrors the model's paths), making the plain modules on the way."""
    owner = getattr(unit, "graph", unit)
    *atoms, leaf = path.split(".")
    for atom in atoms:
        child = owner._modules.get(atom)
        if child is None:
            child = nn.Module()
            owner.add_module(atom, child)
        owner = child
    if isinstance(tensor, nn.Parameter):
        owner.register_parameter(leaf, tensor)
    else:
        owner.register_buffer(leaf, tensor)
