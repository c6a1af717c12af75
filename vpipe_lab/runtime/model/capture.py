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

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from vpipe_lab.core.interop.bundle import MoeInfo, UnitInfo
from vpipe_lab.runtime.model import experts as moe
from vpipe_lab.runtime.model.cuts import (
    SplitSpec,
    assign,
    base_path,
    call_paths,
    repeated_calls,
    split_points,
)
from vpipe_lab.runtime.model.graph_unit import Carry, GraphUnit, for_inference, written_inputs
from vpipe_lab.runtime.model.input_shapes import InputRule, describe_leaves, dynamic_spec
from vpipe_lab.runtime.model.sizes import is_size, size_recipes
from vpipe_lab.runtime.model.trace import eager
from vpipe_lab.runtime.model.trace.problems import CaptureError, generation_cache_off, shape_independent, why
from vpipe_lab.runtime.model.trace.run_device import holds_meta, inputs_on, restore, seen_on
from vpipe_lab.runtime.model.unused import adopt, home

__all__ = ["CaptureError", "Carry", "Chain", "GraphUnit", "SplitSpec", "UnitTensors", "capture", "for_inference",
           "written_inputs"]
log = logging.getLogger(__name__)


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


def state_names(model: nn.Module, canonical: dict[int, str]) -> tuple[dict[str, list[str]], set[str]]:
    """Every name ``model.state_dict()`` lists each tensor under (a tied weight under each of its names, in the
    model's own order), by canonical name; and the canonical names it leaves out (non-persistent buffers, such as a
    rotary embedding's ``inv_freq``). ``Session.state_dict()`` gives back exactly those keys."""
    aliases: dict[str, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        aliases.setdefault(canonical.get(id(t), name), []).append(name)
    held = set(canonical.values())
    return aliases, held - set(aliases)


def unit_tensors(module: nn.Module, canonical: dict[int, str], prefix: str = "") -> UnitTensors:
    params = [(n, canonical.get(id(p), prefix + n)) for n, p in module.named_parameters(remove_duplicate=False)]
    buffers = [(n, canonical.get(id(b), prefix + n)) for n, b in module.named_buffers(remove_duplicate=False)]
    return UnitTensors(params, buffers)


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
    rule: InputRule | None = None  # the input shapes the graph takes (input_shapes.py); None: any (not a graph)
    aliases: dict[str, list[str]] = field(default_factory=dict)  # canonical name -> its names in model.state_dict()
    non_persistent: set[str] = field(default_factory=set)  # canonical names model.state_dict() leaves out
    state_keys: list[str] = field(default_factory=list)  # model.state_dict()'s keys, in its order
    modules: list[list[str]] = field(default_factory=list)  # per unit: its outermost modules' FQNs (cuts.Cut)
    kinds: list[str] = field(default_factory=list)  # per unit: "pre", "block:<class>" or "post" (cuts.Cut)
    experts: list[moe.MoeLayer] = field(default_factory=list)  # its mixture-of-experts layers, counted (experts.py)
    eager: dict[int, list[str]] = field(default_factory=dict)  # per unit: modules torch.export could not trace

    def __len__(self) -> int:
        return len(self.units)

    def infos(self) -> list[dict[str, Any]]:
        """Each unit as ``core.interop.bundle.UnitInfo`` has it: name, modules, kind and the tensors it uses that none
        of its modules own (under any of their names in ``model.state_dict()``)."""
        out = []
        for i, name in enumerate(self.names):
            modules = self.modules[i] if i < len(self.modules) else []
            outside = []
            for _, canonical in self.tensors[i].params + self.tensors[i].buffers:
                names = self.aliases.get(canonical, [canonical])
                if not any(n == m or n.startswith(m + ".") for n in names for m in modules):
                    outside.append(canonical)
            moe = tuple(MoeInfo(e.module, e.experts, e.top_k, e.capacity) for e in self.experts if e.unit == i)
            out.append(UnitInfo(name, tuple(modules), self.kinds[i] if i < len(self.kinds) else "block",
                                tuple(dict.fromkeys(outside)), moe, tuple(self.eager.get(i, ()))).to_dict())
        return out

    def shared_params(self) -> set[str]:
        """Canonical names of the parameters more than one unit uses (a tied embedding and head)."""
        users: dict[str, int] = {}
        for t in self.tensors:
            for name in dict.fromkeys(c for _, c in t.params):
                users[name] = users.get(name, 0) + 1
        return {name for name, n in users.items() if n > 1}

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
        problem = self.rule.problem(describe_leaves(leaves)) if self.rule is not None else None
        if problem is not None:  # the workers agree on shapes before an iteration (runtime/recapture.py)
            raise CaptureError(f"a micro-batch does not fit the captured graph: {problem}")
        return dict(zip(self.input_keys, leaves))

    def problem(self, desc_leaves: list[tuple[str, Any, Any]]) -> str | None:
        """Why inputs described by ``describe_leaves`` do not fit this chain's graph (None if they do)."""
        return self.rule.problem(desc_leaves) if self.rule is not None else None

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


def capture(model: nn.Module, example: Any, split: SplitSpec = None, device: torch.device | None = None) -> Chain:
    """Cut ``model`` into units; ``example`` is one micro-batch of inputs (shapes matter, values do not). The graph
    takes other shapes wherever the model lets them vary (``input_shapes.py``). A model laid out on the meta device is
    traced as if it sat on ``device`` (default: the CPU), the device its stage runs on, so code that branches on the
    device takes that device's branch (``trace/run_device.py``); its units keep the meta tensors."""
    canonical = canonical_names(model)
    aliases, non_persistent = state_names(model, canonical)
    if isinstance(model, nn.Sequential) and split is None:
        children = list(model.named_children())
        names = [f"{name}:{type(child).__name__}" for name, child in children]
        units = [child for _, child in children]
        return Chain(units, names, [unit_tensors(u, canonical, f"{i}.") for i, u in enumerate(units)], graph=False,
                     aliases=aliases, non_persistent=non_persistent, state_keys=list(model.state_dict(keep_vars=True)),
                     modules=[[name] for name, _ in children],
                     kinds=[f"block:{type(child).__name__}" for _, child in children])
    points = split_points(model, split)
    generation_cache_off(model)
    laid_out = holds_meta(model)
    run_on = device if device is not None else torch.device("cpu")
    args, kwargs = args_kwargs(inputs_on(example, run_on) if laid_out else example)
    leaves = pytree.tree_leaves((args, kwargs))
    with seen_on(model, run_on) as originals:
        exported, dynamic, tracing = eager.export(model, args, kwargs, _export, points)
        gm = exported.module()
    restore(gm, originals)
    placed = eager.call_modules(gm, tracing) if tracing is not None else {}
    if split is None and len(points) < 2:  # no repeated blocks: maybe one module called again and again (ALBERT)
        points = repeated_calls(gm) or points
    first: dict[str, int] = {}  # where each module first runs: units follow the forward, not the module order
    for i, node in enumerate(gm.graph.nodes):
        for p in call_paths(node):
            first.setdefault(p, i)
    if split is None:  # default cut points the forward never calls (a head used in another mode) cut nothing
        points = [p for p in points if p in first]
    points = sorted(points, key=lambda p: first.get(p, len(first)))  # Gemma-3n projects before its layers
    cut = assign(gm, points)
    part, names = cut.part, cut.names
    reached = {p for node in part for p in call_paths(node)}
    missing = [p for p in points if p not in reached]
    if missing:
        raise CaptureError(f"split points {missing} never run in {type(model).__name__}.forward; split at modules "
                           "the forward pass calls")
    chain = _chain(gm, exported, part, names, canonical)
    for node in gm.graph.nodes:  # what runs eagerly, by unit (trace/eager.py)
        if node.name in placed:
            chain.eager.setdefault(part[node], []).append(placed[node.name])
    chain.rule = InputRule.of_graph(gm, leaves, exported.range_constraints) if dynamic else InputRule.exactly(leaves)
    chain.aliases, chain.non_persistent = aliases, non_persistent
    chain.state_keys = list(model.state_dict(keep_vars=True))
    classes = {name: type(module).__name__ for name, module in model.named_modules()}
    chain.modules = cut.modules
    chain.kinds = [f"block:{classes.get(base_path(m[0]), '?') if m else '?'}" if kind == "block" else kind
                   for kind, m in zip(cut.kinds, cut.modules)]
    _adopt_unused(chain, model, canonical)
    if os.environ.get("VPIPE_LAB_EXPERTS") != "off":  # benchmarks/expert_load.py: what the counting costs
        chain.experts = moe.instrument(chain.units, moe.find(model))
    return chain


def _adopt_unused(chain: Chain, model: nn.Module, canonical: dict[int, str]) -> None:
    """Every parameter and buffer the graph never reads joins a unit (``unused.py``), so nothing of the model is
    lost from its state."""
    held = [[c for _, c in t.params + t.buffers] for t in chain.tensors]
    taken = {c for names in held for c in names}
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        name = canonical.get(id(tensor), name)
        if name in taken:
            continue
        taken.add(name)
        unit = home(name, chain.modules, [[n for c in names for n in chain.aliases.get(c, [c])] for names in held])
        adopt(chain.units[unit], name, tensor)
        chain.tensors[unit] = unit_tensors(chain.units[unit], canonical)
        held[unit].append(name)
        log.debug("%s is not used by the forward; it stays with unit %r", name, chain.names[unit])


def _export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """torch.export's program of ``model`` with every input dimension free where the model lets it vary, else at
    these shapes; and whether the shapes are free."""
    try:
        if os.environ.get("VPIPE_LAB_CAPTURE") == "static":  # benchmarks/shapes.py: what free dimensions cost
            raise RuntimeError("captured for fixed shapes (VPIPE_LAB_CAPTURE=static)")
        return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_spec(model, args, kwargs),
                                   strict=False), True
    except Exception as exc:  # some models trace only at fixed shapes: new shapes then get captures of their own
        if shape_independent(exc):  # ... but not this failure: no second whole trace that fails the same way
            raise CaptureError(f"torch.export could not capture {type(model).__name__} for pipelining: "
                               f"{why(exc)}") from exc
        log.info("%s does not export with free input shapes (%s); capturing it for these shapes", type(model).__name__,
                 str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
        try:
            return torch.export.export(model, args, kwargs, strict=False), False
        except Exception as exc:
            raise CaptureError(f"torch.export could not capture {type(model).__name__} for pipelining: "
                               f"{why(exc)}") from exc


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
    sizes: list[list[torch.fx.Node]] = [[] for _ in range(count)]  # sizes from other units, recomputed here
    read_by: dict[str, set[int]] = {}
    for node in nodes:
        if node not in part:
            continue
        unit = part[node]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                if arg not in attrs[unit]:
                    attrs[unit].append(arg)
            elif part.get(arg) != unit and is_size(arg):
                if arg not in sizes[unit]:
                    sizes[unit].append(arg)
            elif part.get(arg) != unit and arg not in reads[unit]:
                reads[unit].append(arg)
    recipes = [size_recipes(unit, sizes[unit], reads[unit]) for unit in range(count)]
    for unit in range(count):
        for node in reads[unit]:
            read_by.setdefault(node.name, set()).add(unit)
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
        for node, source, dim in recipes[unit]:  # in graph order: a derived size after what it is made of
            env[node] = (graph.call_function(torch.ops.aten.sym_size.int, (env[source], dim)) if source is not None
                         else graph.node_copy(node, lambda n, env=env: env[n]))  # type: ignore[misc]
            env[node].meta = node.meta.copy()
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
