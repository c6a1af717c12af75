"""Where a captured model is cut into partition units: at its repeated blocks (every transformer layer of a
``ModuleList``, every ResNet block) or at the modules the user names, with what runs before and after them as units of
their own. Each graph node carries the modules it ran in (``nn_module_stack``), which is what decides its unit."""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vpipe_lab.runtime.model.trace.problems import CaptureError

SplitSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # hold blocks; never blocks themselves


ENOUGH = 4  # blocks that give a pipeline room; an outer group with fewer gives way to a larger one inside it


def repeated_blocks(model: nn.Module) -> list[str]:
    """The model's outermost repeated blocks, where a cut falls between whole blocks.

    A candidate is a class that repeats among the children of one kind of parent (one class at one depth, of any
    module: ``transformer.h.*``, ResNet's ``layer1.0 ... layer4.1``, GoogLeNet's ``inception3a ... inception5b`` on
    the model itself). Plain containers (Sequential, ModuleList, ModuleDict) hold blocks and are never blocks, and
    torch's primitives (Linear, ReLU) count only where they sit in such a container or on the model itself (VGG's
    ``features``), not inside a block (the query/key/value of an attention). Cuts go between the outermost blocks,
    never inside a block whose residual add (or any in-place op) spans its own layers: torchvision's MobileNetV3
    repeats ``Conv2dNormActivation`` inside each ``InvertedResidual`` more often than the blocks themselves. An
    outer group of fewer than ``ENOUGH`` blocks gives way to a larger group held in containers inside it (T5's two
    ``T5Stack`` modules hold its ``T5Block`` modules in a ModuleList; a GPT-2 block's projections are not held so).
    Among groups of one level: the model's own classes before torch's primitives, classes with
    parameters before those without (VGG's Conv2d, not its ReLUs), then the most repeated."""
    modules = dict(model.named_modules())
    groups: dict[tuple[int, type], list[str]] = {}
    held: dict[tuple[int, type], bool] = {}  # every member sits in a container
    for name, module in modules.items():
        depth = name.count(".") + 1 if name else 0
        holder = isinstance(module, CONTAINERS) or not name
        for child_name, child in module.named_children():
            primitive = type(child).__module__.startswith("torch.nn")
            if type(child) not in CONTAINERS and (holder or not primitive):
                path = f"{name}.{child_name}" if name else child_name
                # a class repeating at this depth; and, whatever their classes, the layers of the ModuleLists at
                # this depth (BART's encoder and decoder layers are two classes in two stacks)
                for key in ((depth, type(child)), *(((depth, nn.ModuleList),) if type(module) is nn.ModuleList else ())):
                    groups.setdefault(key, []).append(path)
                    held[key] = held.get(key, True) and isinstance(module, CONTAINERS)
    found = {key: names for key, names in groups.items() if len(names) >= 2}

    def within(key: tuple[int, type], outer: list[str]) -> bool:
        return all(any(n.startswith(m + ".") for m in outer) for n in found[key])

    def outermost(keys: list[tuple[int, type]]) -> list[tuple[int, type]]:
        """The groups none of whose members lies inside another group's member."""
        return [k for k in keys if not within(k, [m for o in keys if o != k for m in found[o]])]

    def rank(key: tuple[int, type]) -> tuple[bool, bool, int]:
        own_class = not type(modules[found[key][0]]).__module__.startswith("torch.nn")
        has_params = any(True for _ in modules[found[key][0]].parameters())
        return own_class, has_params, len(found[key])

    level = outermost(list(found))
    if not level:
        return []
    best = max(level, key=rank)
    while len(found[best]) < ENOUGH:
        inner = outermost([k for k in found if k != best and held[k] and within(k, found[best])])
        if not inner or len(found[max(inner, key=rank)]) <= len(found[best]):
            break
        best = max(inner, key=rank)
    order = {n: i for i, n in enumerate(modules)}
    return sorted(found[best], key=order.__getitem__)


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
        base, at, call = name.partition("@")  # "module@k": the module's (k+1)-th call (a module called several times)
        if at and call.isdigit() and base in modules:
            continue
        if name not in modules or not name:
            close = difflib.get_close_matches(name, list(modules), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise CaptureError(f"split point {name!r} is not a submodule of {type(model).__name__}{hint} "
                               "(names are as in model.named_modules())")
    order = {n: i for i, n in enumerate(modules)}
    return sorted(dict.fromkeys(names), key=lambda n: (order[n.partition("@")[0]], int(n.partition("@")[2] or 0)))


def module_paths(node: torch.fx.Node) -> list[str]:
    """The modules a graph node ran in, outermost first (torch.export marks nodes outside any module, such as a
    symbolic size read off an input, with a made-up path: not a module)."""
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values() if not v[0].startswith("_empty_nn_module")]


CALL_PREFIX = "L__self__"  # how torch.export keys a node's module: "L__self__<path>", "@k" after the (k+1)-th call


def call_paths(node: torch.fx.Node) -> list[str]:
    """``module_paths``, each with the call it ran in when the model calls that module more than once: ALBERT's one
    shared layer group runs as ``albert.encoder.albert_layer_groups.0``, ``...0@1``, ``...0@2``, ... ."""
    out = []
    for key, value in (node.meta.get("nn_module_stack") or {}).items():
        if value[0].startswith("_empty_nn_module"):
            continue
        call = key.rpartition("@")[2] if "@" in key and key.startswith(CALL_PREFIX) else ""
        out.append(f"{value[0]}@{call}" if call.isdigit() else value[0])
    return out


def base_path(qualified: str) -> str:
    """A module's path without the call it ran in."""
    return qualified.partition("@")[0]


def repeated_calls(gm: torch.fx.GraphModule) -> list[str]:
    """Where a model with no repeated blocks repeats a module instead (ALBERT applies one layer group at every
    depth): the outermost module called more than once, one split point per call (``path``, ``path@1``, ...)."""
    calls: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        for qualified in call_paths(node):
            calls.setdefault(base_path(qualified), [])
            if qualified not in calls[base_path(qualified)]:
                calls[base_path(qualified)].append(qualified)
    repeated = [path for path, seen in calls.items() if len(seen) >= 2]
    if not repeated:
        return []
    outer = min(repeated, key=lambda p: (p.count("."), -len(calls[p])))
    return calls[outer]


@dataclass(frozen=True)
class Cut:
    """Where each graph node goes and what each unit is: its name, the outermost modules that run wholly inside it
    (their FQNs in the model, in the order they ran: what a torch.distributed.pipelining split point or a torchtitan
    ``module_fqns_per_model_part`` names) and its kind ("pre" before the first split module, "block" from a split
    module on, "post" after the last one)."""

    part: dict[torch.fx.Node, int]
    names: list[str]
    modules: list[list[str]]
    kinds: list[str]


def assign(gm: torch.fx.GraphModule, points: list[str]) -> Cut:
    """Node -> unit, and each unit's name and modules. A unit begins where a split module's first node runs;
    everything else stays with the unit that is running (glue code between blocks goes with the block before it),
    and what follows the last split module forms a unit of its own."""
    index = {p: i for i, p in enumerate(points)}

    def point_of(node: torch.fx.Node) -> int | None:
        for path in call_paths(node):
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
        for path in call_paths(node):
            units_of.setdefault(path, set()).add(current)
            seen.setdefault(current, {})[path] = None
    used = sorted(set(part.values()))
    renumber = {u: i for i, u in enumerate(used)}
    modules = [outermost([p for p in seen.get(u, {}) if units_of[p] == {u}]) for u in used]
    kinds = ["pre" if u == 0 else "post" if u > len(points) else "block" for u in used]
    return Cut({n: renumber[u] for n, u in part.items()}, [unit_name(m) for m in modules], modules, kinds)


def outermost(owned: list[str]) -> list[str]:
    """The outermost of the modules that run wholly inside a unit, in the order they ran (a call of a module called
    several times keeps its ``@k``)."""
    real = [p for p in owned if p]
    return [p for p in real if not any(base_path(p).startswith(base_path(q) + ".") for q in real)]


def unit_name(top: list[str]) -> str:
    """A unit's name from its outermost modules: 'transformer.h.3', 'transformer.ln_f+lm_head'."""
    return "+".join(top[:3]) + ("+…" if len(top) > 3 else "") if top else "(glue)"
