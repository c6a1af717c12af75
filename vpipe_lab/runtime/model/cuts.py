"""Where a captured model is cut into partition units: at its repeated blocks (every transformer layer of a
``ModuleList``, every ResNet block) or at the modules the user names, with what runs before and after them as units of
their own. Each graph node carries the modules it ran in (``nn_module_stack``), which is what decides its unit."""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Sequence

import torch
from torch import nn

from vpipe_lab.runtime.model.capture_problems import CaptureError

SplitSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None


def repeated_blocks(model: nn.Module) -> list[str]:
    """The model's repeated blocks: children of ModuleLists/Sequentials, of the class that repeats most often."""
    by_class: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
            for child_name, child in module.named_children():
                by_class.setdefault(type(child), []).append(f"{name}.{child_name}" if name else child_name)
    if not by_class:
        return []
    # Prefer the model's own block classes (GPT2Block, BasicBlock) over torch's primitives; then the most repeated.
    best = max(by_class.items(), key=lambda kv: (not kv[0].__module__.startswith("torch.nn"), len(kv[1])))
    return best[1] if len(best[1]) >= 2 else []


def split_points(model: nn.Module, split: SplitSpec) -> list[str]:
    """The modules at which a new unit begins, in the model's module order, checked against the model."""
    modules = dict(model.named_modules())
    if split is None:
        return repeated_blocks(model)
    if callable(split):
        chosen: list[str] = []
        for name, module in modules.items():
            if name and split(name, module) and not any(name.startswith(c + ".") for c in chosen):
                chosen.append(name)
        if not chosen:
            raise CaptureError("the split function chose no module: it gets (name, module) for every submodule and "
                               "returns True where a new unit should begin")
        return chosen
    names = [split] if isinstance(split, str) else list(split)
    for name in names:
        if name not in modules or not name:
            close = difflib.get_close_matches(name, list(modules), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise CaptureError(f"split point {name!r} is not a submodule of {type(model).__name__}{hint} "
                               "(names are as in model.named_modules())")
    order = {n: i for i, n in enumerate(modules)}
    return sorted(dict.fromkeys(names), key=order.__getitem__)


def module_paths(node: torch.fx.Node) -> list[str]:
    """The modules a graph node ran in, outermost first (torch.export marks nodes outside any module, such as a
    symbolic size read off an input, with a made-up path: not a module)."""
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values() if not v[0].startswith("_empty_nn_module")]


def assign(gm: torch.fx.GraphModule, points: list[str]) -> tuple[dict[torch.fx.Node, int], list[str]]:
    """Node -> unit, and each unit's name. A unit begins where a split module's first node runs; everything else stays
    with the unit that is running (glue code between blocks goes with the block before it), and what follows the
    last split module forms a unit of its own."""
    index = {p: i for i, p in enumerate(points)}

    def point_of(node: torch.fx.Node) -> int | None:
        for path in module_paths(node):
            if path in index:
                return index[path]
        return None

    part: dict[torch.fx.Node, int] = {}
    units_of: dict[str, set[int]] = {}  # module path -> the units its nodes fell into
    seen: dict[int, dict[str, None]] = {}  # unit -> module paths in the order they ran
    current, last_point, in_point = 0, -1, False  # unit 0: what runs before the first split module
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and node.args[0] in part:
            part[node] = part[node.args[0]]  # tuples never cross units: their items do
            continue
        p = point_of(node)
        if p is not None and p > last_point:
            last_point, current = p, p + 1
        elif p is None and in_point and last_point == len(points) - 1:
            current = len(points) + 1  # the first node after the last split module: the tail unit begins
        in_point = p is not None
        part[node] = current
        for path in module_paths(node):
            units_of.setdefault(path, set()).add(current)
            seen.setdefault(current, {})[path] = None
    used = sorted(set(part.values()))
    renumber = {u: i for i, u in enumerate(used)}
    names = [_unit_name([p for p in seen.get(u, {}) if units_of[p] == {u}]) for u in used]
    return {n: renumber[u] for n, u in part.items()}, names


def _unit_name(owned: list[str]) -> str:
    """The outermost modules that run wholly inside a unit, in the order they ran: 'transformer.h.3',
    'transformer.ln_f+lm_head'."""
    real = [p for p in owned if p]
    top = [p for p in real if not any(p.startswith(q + ".") for q in real)]
    return "+".join(top[:3]) + ("+…" if len(top) > 3 else "") if top else "(glue)"
