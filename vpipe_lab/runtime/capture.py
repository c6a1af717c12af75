"""Any ``nn.Module`` as a chain of partition units: torch.export's graph, cut at module boundaries.

An ``nn.Sequential`` is already a chain: its children are the units and each takes the previous one's output. Any
other model is captured with ``torch.export`` (non-strict, as torch.distributed.pipelining does) on an example
micro-batch; every graph node carries the module it ran in (``nn_module_stack``), so the graph is cut where a split
module begins (default: each of the model's repeated blocks, e.g. every transformer layer of a ``ModuleList``, with
what runs before and after them as their own units). Each piece becomes a ``torch.fx.GraphModule`` over the original
parameter objects. Between units flows the *carry*: every graph value produced so far that a later
unit still needs (hidden states, the attention mask, ...), keyed by node name, so a stage boundary carries a fixed,
ordered tuple of tensors. The last unit rebuilds the model's own output object (``ModelOutput``, dict, tuple).
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

SplitSpec = Sequence[str] | Callable[[str, nn.Module], bool] | None
Carry = dict[str, Any]


class CaptureError(ValueError):
    """The model cannot be cut into pipeline units as asked."""


def args_kwargs(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How ``data`` inputs call the model: a tensor is one argument, a tuple several, a dict keyword arguments."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


@dataclass
class UnitTensors:
    """A unit's parameters and buffers: its own attribute path -> the model-wide canonical name (ties share one)."""

    params: list[tuple[str, str]]
    buffers: list[tuple[str, str]]


def canonical_names(model: nn.Module) -> dict[int, str]:
    """id(tensor) -> the first name it has in the model: a tied weight gets one name wherever it is used."""
    names: dict[int, str] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(t), name)
    for name, t in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(t), name)
    return names


def unit_tensors(module: nn.Module, canonical: dict[int, str], prefix: str = "") -> UnitTensors:
    params = [(n, canonical.get(id(p), prefix + n)) for n, p in module.named_parameters(remove_duplicate=False)]
    buffers = [(n, canonical.get(id(b), prefix + n)) for n, b in module.named_buffers(remove_duplicate=False)]
    return UnitTensors(params, buffers)


class GraphUnit(nn.Module):
    """One piece of the captured graph: takes the carry, runs its nodes, returns the carry for the next unit."""

    def __init__(self, graph: nn.Module, in_keys: list[str], out_keys: list[str], carry_keys: list[str]) -> None:
        super().__init__()
        self.graph = graph
        self.in_keys, self.out_keys, self.carry_keys = in_keys, out_keys, carry_keys

    def forward(self, carry: Carry) -> Carry:
        produced = dict(zip(self.out_keys, self.graph(*(carry[k] for k in self.in_keys))))
        return {k: produced[k] if k in produced else carry[k] for k in self.carry_keys}

    def inference(self) -> GraphUnit:
        """This unit as eval mode runs it, over the same parameter objects. torch.export baked training mode into
        the graph, so ``.eval()`` changes nothing: here dropout becomes the identity, batch norm uses its running
        statistics, and in-place writes to buffers (``num_batches_tracked += 1``) are dropped."""
        graph = torch.fx.Graph()
        graph.output(graph.graph_copy(self.graph.graph, {}))  # type: ignore[union-attr, arg-type]
        for node in list(graph.nodes):
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            name = node.target.name()
            schema = node.target._schema
            if "dropout" in name:
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
            elif name == "aten::batch_norm":
                node.args = (*node.args[:5], False, *node.args[6:])
            elif (schema.arguments and schema.arguments[0].alias_info is not None
                  and schema.arguments[0].alias_info.is_write and isinstance(node.args[0], torch.fx.Node)
                  and node.args[0].op == "get_attr"):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
        return GraphUnit(torch.fx.GraphModule(self.graph, graph), self.in_keys, self.out_keys, self.carry_keys)


def for_inference(unit: nn.Module) -> tuple[nn.Module, bool]:
    """What runs a unit in eval mode, and whether it must be put back into training mode afterwards."""
    if isinstance(unit, GraphUnit):
        return unit.inference(), False
    unit.eval()
    return unit, True


@dataclass
class Chain:
    """The model as partition units, with how values enter, cross stage boundaries and leave."""

    units: list[nn.Module]
    names: list[str]
    tensors: list[UnitTensors]
    graph: bool  # captured (carry dicts) rather than an nn.Sequential (values passed as they are)
    input_keys: list[str] | None = None
    in_spec: Any = None
    output_keys: list[str] | None = None
    out_spec: Any = None
    mutated: set[str] | None = None  # buffers the forward writes in place (None: not known, so any may be)
    shapes: list[Any] | None = None  # the captured micro-batch's input shapes: the graph is specialised to them

    def __len__(self) -> int:
        return len(self.units)

    def signature(self) -> list[Any]:
        """What every rank must agree on: unit names, tensor names and what crosses each boundary."""
        return [[name, [c for _, c in t.params + t.buffers], getattr(unit, "carry_keys", None)]
                for name, t, unit in zip(self.names, self.tensors, self.units)]

    def start(self, inputs: Any) -> Any:
        """What the first unit takes for one micro-batch of ``data`` inputs."""
        if not self.graph:
            return inputs
        assert self.input_keys is not None
        leaves, spec = pytree.tree_flatten(args_kwargs(inputs))
        if spec != self.in_spec:
            raise CaptureError(f"the inputs changed structure since the model was captured: now {spec}, captured "
                               f"with {self.in_spec}; give every batch the same keys and argument order")
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in leaves]
        if self.shapes is not None and shapes != self.shapes:
            raise CaptureError(f"a micro-batch's input shapes are {shapes}, but the model was captured for "
                               f"{self.shapes}: the graph is specialised to those shapes, so give batches of one size "
                               "(pad to a fixed length; drop_last=True in a DataLoader)")
        return dict(zip(self.input_keys, leaves))

    def finish(self, carry: Any) -> Any:
        """The model's own output object (what the loss receives) from the last unit's result."""
        if not self.graph:
            return carry
        assert self.output_keys is not None
        return pytree.tree_unflatten([carry[k] for k in self.output_keys], self.out_spec)

    def pack(self, value: Any) -> Any:
        """What crosses a stage boundary: a captured model's carry as its ordered tensors; an nn.Sequential child's
        output as it is (a tensor, a tuple, a dict with None in it: the transfer keeps its structure)."""
        return tuple(value.values()) if self.graph else value

    def unpack(self, after_unit: int, got: Any) -> Any:
        """The inverse of ``pack`` for the boundary after unit ``after_unit``."""
        if self.graph:
            unit = self.units[after_unit]
            return dict(zip(unit.carry_keys, got))  # type: ignore[union-attr]
        if isinstance(got, tuple) and len(got) == 1 and isinstance(got[0], torch.Tensor):
            return got[0]
        return got


def build_model(model: Any, seed: int) -> nn.Module:
    """The model in training mode: ``torch.manual_seed(seed); model()`` for a factory, as a plain process would."""
    torch.manual_seed(seed)
    built = model() if callable(model) and not isinstance(model, nn.Module) else model
    if not isinstance(built, nn.Module):
        raise TypeError(f"the model must be an nn.Module or a zero-argument function returning one, not "
                        f"{type(built).__name__}")
    return built.train()


def to_meta(unit: nn.Module, tensors: UnitTensors) -> None:
    """Free a unit this stage does not own: its parameters and buffers become meta tensors (shapes only), in this
    unit alone, so a tie to an owned unit keeps the real tensor there."""
    for local, _ in tensors.params + tensors.buffers:
        owner_path, _, name = local.rpartition(".")
        owner = unit.get_submodule(owner_path) if owner_path else unit
        if name in owner._parameters and owner._parameters[name] is not None:
            old = owner._parameters[name]
            owner._parameters[name] = nn.Parameter(torch.empty_like(old, device="meta"),  # type: ignore[union-attr]
                                                   requires_grad=old.requires_grad)  # type: ignore[union-attr]
        elif name in owner._buffers and owner._buffers[name] is not None:
            owner._buffers[name] = torch.empty_like(owner._buffers[name], device="meta")  # type: ignore[arg-type]


# --- where to cut -----------------------------------------------------------------------------------------------------
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


def _module_paths(node: torch.fx.Node) -> list[str]:
    return [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]


def _assign(gm: torch.fx.GraphModule, points: list[str]) -> tuple[dict[torch.fx.Node, int], list[str]]:
    """Node -> unit, and each unit's name. A unit begins where a split module's first node runs; everything else stays
    with the unit that is running (glue code between blocks goes with the block before it), and what follows the
    last split module forms a unit of its own."""
    index = {p: i for i, p in enumerate(points)}

    def point_of(node: torch.fx.Node) -> int | None:
        for path in _module_paths(node):
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
        for path in _module_paths(node):
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


def capture(model: nn.Module, example: Any, split: SplitSpec = None) -> Chain:
    """Cut ``model`` into units; ``example`` is one micro-batch of inputs (shapes matter, values do not)."""
    canonical = canonical_names(model)
    if isinstance(model, nn.Sequential) and split is None:
        names = [f"{name}:{type(child).__name__}" for name, child in model.named_children()]
        units = list(model.children())
        return Chain(units, names, [unit_tensors(u, canonical, f"{i}.") for i, u in enumerate(units)], graph=False)
    points = split_points(model, split)
    args, kwargs = args_kwargs(example)
    try:
        exported = torch.export.export(model, args, kwargs, strict=False)
    except Exception as exc:
        raise CaptureError(f"torch.export could not capture {type(model).__name__} for pipelining: "
                           f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}. "
                           "Models with data-dependent Python control flow cannot be cut into stages; rewrite that "
                           "branch with torch.cond/torch.where, or give an nn.Sequential of the parts") from exc
    gm = exported.module()
    part, names = _assign(gm, points)
    shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in pytree.tree_leaves((args, kwargs))]
    reached = {p for node in part for p in _module_paths(node)}
    missing = [p for p in points if p not in reached]
    if missing:
        raise CaptureError(f"split points {missing} never run in {type(model).__name__}.forward; split at modules "
                           "the forward pass calls")
    chain = _chain(gm, exported, part, names, canonical)
    chain.shapes = shapes
    return chain


def _chain(gm: torch.fx.GraphModule, exported: Any, part: dict[torch.fx.Node, int], names: list[str],
           canonical: dict[int, str]) -> Chain:
    """One GraphModule per unit over the same parameter objects; its inputs come from the carry, its outputs are
    what later units or the model's output read."""
    count = len(names)
    nodes = list(gm.graph.nodes)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    flat_out = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    output_keys = [a.name for a in flat_out]
    reads: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    attrs: list[list[torch.fx.Node]] = [[] for _ in range(count)]
    read_by: dict[str, set[int]] = {}
    for node in nodes:
        if node not in part:
            continue
        unit = part[node]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                if arg not in attrs[unit]:
                    attrs[unit].append(arg)
            elif part.get(arg) != unit and arg not in reads[unit]:
                reads[unit].append(arg)
                read_by.setdefault(arg.name, set()).add(unit)
    units: list[nn.Module] = []
    tensors: list[UnitTensors] = []
    available = list(placeholders)
    for unit in range(count):
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in reads[unit]:
            env[node] = graph.placeholder(node.name)
            env[node].meta = node.meta.copy()
        for node in attrs[unit]:
            env[node] = graph.get_attr(str(node.target))
        mine = [n for n in nodes if part.get(n) == unit]
        for node in mine:
            env[node] = graph.node_copy(node, lambda n, env=env: env[n])  # type: ignore[misc]
        outs = [n for n in mine if any(u > unit for u in read_by.get(n.name, ())) or n.name in output_keys]
        graph.output(tuple(env[n] for n in outs))
        available += [n.name for n in outs]
        later = {n.name for r in reads[unit + 1:] for n in r} | set(output_keys)
        carry = [k for k in available if k in later]
        for node in (n for n in nodes if n.name in carry):
            val = node.meta.get("val")
            if val is not None and not isinstance(val, torch.Tensor):
                raise CaptureError(f"value {node.name!r} ({type(val).__name__}) would cross from unit {names[unit]!r} "
                                   "to a later one; only tensors can cross, so split elsewhere")
        piece = torch.fx.GraphModule(gm, graph, class_name=f"Unit{unit}")
        units.append(GraphUnit(piece, [n.name for n in reads[unit]], [n.name for n in outs], carry))
        tensors.append(unit_tensors(units[-1], canonical))
    return Chain(units, names, tensors, graph=True, input_keys=placeholders, in_spec=exported.call_spec.in_spec,
                 output_keys=output_keys, out_spec=exported.call_spec.out_spec, mutated=_mutated(gm, canonical))


def _mutated(gm: torch.fx.GraphModule, canonical: dict[int, str]) -> set[str]:
    """Canonical names of the tensors the graph writes in place: arguments its ops' schemas mark as written
    (``add_`` on a counter), and the running statistics that training-mode normalisation updates (``batch_norm``
    declares them as plain inputs, yet writes them)."""
    found: set[str] = set()
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        norm = schema.name.endswith(("batch_norm", "instance_norm")) and any(a is True for a in node.args[5:6])
        for arg, spec in zip(node.args, schema.arguments):
            written = spec.alias_info is not None and spec.alias_info.is_write
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and (written or (
                    norm and spec.name in ("running_mean", "running_var"))):
                found.add(canonical.get(id(attribute(gm, str(arg.target))), str(arg.target)))
    return found


def attribute(module: nn.Module, path: str) -> Any:
    """The object at a dotted ``path`` below ``module`` (a graph's ``get_attr`` target)."""
    for atom in path.split("."):
        module = getattr(module, atom)
    return module
