"""Parts of a model torch.export cannot trace, run eagerly inside their unit: a break at module granularity.

A module whose forward branches on a tensor's values (DBRX's experts skip those that received no tokens) has no single
graph. Capture finds it from the failed trace (the innermost module of the model in the traceback), and traces the
model again with every module of that class standing in as one opaque operator (``vpipe_lab::eager``), whose output
shapes come from running a CPU copy of the module on stand-in inputs of the traced shapes (each output dimension is
the input dimension of the same size where there is one). In the captured graph the operator is then replaced by a
call of the module itself, so training runs it eagerly under autograd as PyTorch would: the same arithmetic, its
memory counted by the allocator and its time measured with its unit's. A unit holding one says so
(``Chain.eager``). A module that is not inside one unit (the model's own forward, or a module spanning units) cannot
be run this way, and capture still refuses it, naming the line.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from vpipe_lab.runtime.model.trace.problems import CaptureError

log = logging.getLogger(__name__)
TENSOR = object()  # where an opaque module's argument is a tensor (an input of the operator)
_LEARNED: dict[type, set[type]] = {}  # by model class: those of its modules' classes this process found untraceable
_LIFTED = re.compile(r"model attribute: ([\w.]+)\.lifted_tensor_\d+")


@dataclass
class _Site:
    """One call of an opaque module while the model was traced: how to rebuild its arguments from the operator's
    tensors, and its outputs' structure."""

    module: nn.Module
    path: str
    in_spec: Any  # pytree spec of (args, kwargs)
    leaves: list[Any]  # their leaves, TENSOR where a tensor goes (the operator's inputs, in order)
    out_spec: Any = None


@dataclass
class _Tracing:
    sites: list[_Site] = field(default_factory=list)
    copies: dict[Any, nn.Module] = field(default_factory=dict)  # CPU copies for output shapes, one per kind of module

    def copy_of(self, module: nn.Module) -> nn.Module:
        """The CPU copy ``module``'s output shapes come from (``prepare`` made it before the trace)."""
        return self.copies[_kind(module)]

    def prepare(self, module: nn.Module) -> None:
        """A CPU copy of ``module`` with small random values (shapes are what matter), made before the trace swaps
        the parameters for fake ones, and shared by modules of its class and parameter shapes: a model laid out on
        meta is not materialised layer by layer."""
        kind = _kind(module)
        if kind not in self.copies:
            made = copy.deepcopy(module).to_empty(device="cpu")
            with torch.no_grad():
                for t in list(made.parameters()) + list(made.buffers()):
                    t.copy_(torch.randn_like(t) * 0.02 if t.dtype.is_floating_point else torch.zeros_like(t))
            self.copies[kind] = made


def _kind(module: nn.Module) -> Any:
    return type(module), tuple((n, tuple(t.shape), t.dtype) for n, t in module.state_dict().items())


_ACTIVE: list[_Tracing] = []


@torch.library.custom_op("vpipe_lab::eager", mutates_args=())
def eager_call(inputs: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    """The module of call ``site`` on ``inputs`` (only while tracing: the captured graph calls the module itself)."""
    found = _ACTIVE[-1].sites[site]
    args, kwargs = _arguments(found, inputs)
    out = pytree.tree_leaves(type(found.module).forward(found.module, *args, **kwargs))  # not the stand-in
    return [t.clone() for t in out if isinstance(t, torch.Tensor)]


@eager_call.register_fake
def _(inputs: list[torch.Tensor], site: int) -> list[torch.Tensor]:
    tracing = _ACTIVE[-1]
    found = tracing.sites[site]
    # Outside every mode the trace runs under (fake tensors, the proxy that records the graph): plain eager PyTorch.
    with torch.utils._python_dispatch._disable_current_modes(), torch.no_grad():
        real = [_stand_in(t) for t in inputs]
        args, kwargs = _arguments(found, real)
        out = tracing.copy_of(found.module)(*args, **kwargs)
    flat, found.out_spec = pytree.tree_flatten(out)
    if not all(isinstance(t, torch.Tensor) for t in flat):
        raise RuntimeError(f"{found.path} returns {[type(t).__name__ for t in flat]}: only tensors can be its outputs "
                           "when it runs eagerly")
    return [_like(t, inputs) for t in flat]


def _hint(size: Any) -> int:
    return int(size.node.hint) if isinstance(size, torch.SymInt) else int(size)


def _stand_in(fake: torch.Tensor) -> torch.Tensor:
    """A real CPU tensor of ``fake``'s shape and dtype: zeros for integers (a valid index), small values else."""
    shape = [_hint(s) for s in fake.shape]
    if fake.dtype.is_floating_point or fake.dtype.is_complex:
        return torch.randn(shape, dtype=fake.dtype) * 0.02
    return torch.zeros(shape, dtype=fake.dtype)


def _like(out: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
    """A fake output of ``out``'s shape whose every dimension is an input's dimension of that size where one has it
    (the batch, the sequence, the hidden size), so shapes stay free where the model lets them vary."""
    sizes: list[Any] = []
    for n in out.shape:
        match = next((s for t in inputs for s in t.shape if _hint(s) == n), None)
        if match is None and any(isinstance(s, torch.SymInt) for t in inputs for s in t.shape):
            raise RuntimeError(f"an eager module's output dimension {n} is none of its inputs': capture at fixed shapes")
        sizes.append(match if match is not None else n)
    return inputs[0].new_empty(sizes, dtype=out.dtype) if inputs else torch.empty(sizes, dtype=out.dtype)


def _arguments(site: _Site, tensors: list[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    it = iter(tensors)
    leaves = [next(it) if leaf is TENSOR else leaf for leaf in site.leaves]
    args, kwargs = pytree.tree_unflatten(leaves, site.in_spec)
    return args, kwargs


def _stand_in_forward(tracing: _Tracing, module: nn.Module, path: str) -> Any:
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        flat, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        if any(isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) for x in flat):
            raise RuntimeError(f"{path} takes a size that varies: capture at fixed shapes")
        site = _Site(module, path, spec, [TENSOR if isinstance(x, torch.Tensor) else x for x in flat])
        tracing.sites.append(site)
        out = eager_call(tensors, len(tracing.sites) - 1)
        return pytree.tree_unflatten(list(out), site.out_spec)
    return types.MethodType(forward, module)


@contextlib.contextmanager
def opaque(model: nn.Module, classes: set[type]) -> Iterator[_Tracing]:
    """While tracing ``model``, every module of ``classes`` is one ``vpipe_lab::eager`` operator."""
    tracing = _Tracing()
    patched = []
    for path, module in model.named_modules():
        if type(module) in classes:
            tracing.prepare(module)
            module.forward = _stand_in_forward(tracing, module, path)
            patched.append(module)
    _ACTIVE.append(tracing)
    try:
        yield tracing
    finally:
        _ACTIVE.remove(tracing)
        tracing.copies.clear()  # the CPU copies served the trace only
        for module in patched:
            del module.forward  # the class's own forward again


def flat_tensors(out: Any) -> list[torch.Tensor]:
    """An eagerly run module's outputs as the operator gave them: its tensors, flattened."""
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def call_modules(gm: torch.fx.GraphModule, tracing: _Tracing) -> dict[str, str]:
    """Replace every ``vpipe_lab::eager`` node of ``gm`` by a call of its module (put into ``gm`` at its path, over
    the model's own parameters); the module path of each such node's name."""
    placed: dict[str, str] = {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.vpipe_lab.eager.default:
            continue
        inputs, index = node.args
        site = tracing.sites[index]
        gm.add_submodule(site.path, site.module)
        args, kwargs = _arguments(site, list(inputs))
        with gm.graph.inserting_before(node):
            called = gm.graph.call_module(site.path, tuple(args), dict(kwargs))
            flat = gm.graph.call_function(flat_tensors, (called,))
        called.meta, flat.meta = dict(node.meta), dict(node.meta)
        node.replace_all_uses_with(flat)
        gm.graph.erase_node(node)
        placed[called.name] = site.path
    gm.graph.lint()
    gm.recompile()
    return placed


MAX_BREAKS = 8  # module classes run eagerly in one model before capture gives up


def export(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], exporter: Callable[..., tuple[Any, bool]],
           points: list[str]) -> tuple[Any, bool, _Tracing | None]:
    """``exporter(model, args, kwargs)``; where it fails inside a module of the model, again with every module of
    that class opaque (``opaque``), until it succeeds: the program, whether its shapes are free, and what stands in
    for the opaque modules (None: none). A failure in the model's own forward, or in a module holding a split point
    (it would span units), is raised as it was."""
    asked = set(filter(None, os.environ.get("VPIPE_LAB_EAGER", "").split(",")))  # benchmarks/eager.py: the cost
    # ... and the classes this process already found it cannot trace: a second capture of the model (rank 0 cuts it
    # alone first, then builds its stage; a notebook launches it again) does not fail its whole trace again
    learned = _LEARNED.setdefault(type(model), set())
    classes: set[type] = {type(m) for m in model.modules() if type(m).__name__ in asked or type(m) in learned}
    while True:
        with opaque(model, classes) if classes else contextlib.nullcontext() as tracing:
            try:
                exported, dynamic = exporter(model, args, kwargs)
                return exported, dynamic, tracing
            except CaptureError as exc:
                module = culprit(exc.__cause__ or exc, model)
                path = next((n for n, m in model.named_modules() if m is module), None)
                if module is None or path is None or type(module) in classes or len(classes) >= MAX_BREAKS:
                    raise
                spans = [p for p in points if p == path or p.startswith(path + ".")]
                if (spans and path != spans[0]) or len(spans) > 1:  # a block is a unit of its own: it may run eagerly
                    raise CaptureError(f"{exc} ({path} holds the split points {spans[:3]}: it cannot run eagerly "
                                       "inside one unit)") from exc.__cause__
                classes.add(type(module))
                learned.add(type(module))
                log.warning("torch.export cannot trace %s (%s): every %s runs eagerly inside its unit",
                            path, type(module).__name__, type(module).__name__)


def culprit(exc: BaseException, model: nn.Module) -> nn.Module | None:
    """The innermost module of ``model`` whose forward was running when the trace failed (None: the model's own
    forward, or no module of it)."""
    ours = {id(m) for m in model.modules()}
    found: nn.Module | None = None
    tb = exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in ours and tb.tb_frame.f_code.co_name == "forward":
            found = owner
        tb = tb.tb_next
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        deeper = culprit(cause, model)
        found = deeper if deeper is not None else found
    # A tensor the trace could not follow is found after tracing, where no module's forward runs: torch names the
    # attribute it would have become ("model.layers.0.lifted_tensor_0"), below the module that made it.
    named = _LIFTED.search(str(exc))
    if found is None and named is not None:
        with contextlib.suppress(AttributeError):
            found = model.get_submodule(named.group(1))
    return None if found is model else found
