"""Linear layers whose backward adds the weight gradient into ``weight.grad`` with one GEMM (``addmm_``, beta = 1).

Why: a pipeline stage runs M micro-batches' backwards into the same gradients. Plain autograd computes each
micro-batch's weight gradient as a new parameter-sized tensor and then adds it to ``.grad`` (AccumulateGrad): one
extra read and write of every weight per micro-batch, which dominates when weights are large and micro-batches small
(the pipeline's regime). Accumulating inside the GEMM, as Megatron-LM's gradient-accumulation fusion does, drops
that pass and the temporary; the first micro-batch writes the gradient, the others add to it. The result is the same
sum in another rounding order (parity tests compare with plain gradient accumulation to float tolerance).

Applies to ``nn.Linear`` (and subclasses that keep its forward), HuggingFace's ``Conv1D`` (GPT-2's ``x @ W + b``),
and in a torch.export-ed model (``runtime/model/capture.py``) to every ``aten.linear`` and ``aten.addmm`` whose weight is a
parameter, when the weight has at least ``MIN_PARAMS`` elements (or the threshold given); at run time only when
autograd records, the weight is trainable and no autocast is active: everything else runs the module's own forward.
A weight's gradient then arrives by this side effect, not through autograd's graph, so hooks registered on such a
weight do not fire, and ``torch.autograd.grad`` with respect to it must run under ``suspended()`` (the
profiler's probes do).

The same backward is how a zero-bubble schedule splits a backward in two (``core/schedules/orders/zero_bubble.py``): inside
``deferred(into)`` it computes only the input's gradient and appends the weight-gradient GEMM's operands to
``into``; ``run(into)`` does those GEMMs later, in the schedule's W step. No hook runs per layer: the split is the
autograd function the layer already calls. Only the weights routed here are deferred (a zero-bubble stage routes every
linear weight of at least ``SPLIT_MIN_PARAMS`` elements: ``Stage.split_backward``); other parameters (smaller linears,
norms, embeddings) get their gradients in B.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Hashable, Iterator
from typing import Any, cast

import torch

from vpipe_lab.runtime.model.capture import attribute

_MARK = "_vpipe_fused_wgrad"  # a rewritten graph node's meta key: the op it called before
# Below this many weight elements (1 MiB in fp32) a weight and its gradient stay in cache, where autograd's add is
# cheap, and the Python autograd.Function's own cost (tens of microseconds per call) outweighs the pass it saves:
# gpt-tiny's 96-wide layers ran 5-10% slower fused, the MLP's 256x1024 to 2048x2048 layers 20-30% faster.
MIN_PARAMS = 1 << 18
SPLIT_MIN_PARAMS = 1 << 14
_suspended = 0
# A deferred weight gradient: (input rows, output-gradient rows, weight, bias, transposed, layer index or None).
Pending = tuple[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", bool, "int | None"]
_deferring: list[Pending] | None = None  # where the running backward puts its weight GEMMs (None: does them now)
_layer: int | None = None  # the layer whose backward runs, in a profiling iteration (to time its W on its own)


def split_threshold(fused: int | None) -> int:
    """The smallest weight a split backward defers to W: ``SPLIT_MIN_PARAMS``, or the launch's lower threshold."""
    return SPLIT_MIN_PARAMS if fused is None else min(fused, SPLIT_MIN_PARAMS)


def threshold(option: bool | int) -> int | None:
    """The smallest weight (elements) to fuse for ``launch(fused_wgrad=...)``: True the default, False none (off),
    a number itself (0: every linear layer)."""
    if option is True:
        return MIN_PARAMS
    if option is False:
        return None
    return int(option)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Modules built inside run their own forward (plain autograd), e.g. for ``torch.autograd.grad`` probes."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@contextlib.contextmanager
def deferred(into: list[Pending], layer: int | None = None) -> Iterator[None]:
    """Backwards run inside put their weight-gradient GEMMs into ``into`` instead of doing them (a B step)."""
    global _deferring, _layer
    before = _deferring, _layer
    _deferring, _layer = into, layer
    try:
        yield
    finally:
        _deferring, _layer = before


def run(pending: list[Pending]) -> None:
    """The weight-gradient GEMMs a B step deferred, in its order (a W step); empties ``pending``."""
    for x, grad, weight, bias, transposed, _ in pending:
        _accumulate(x, grad, weight, bias, transposed)
    pending.clear()


class Deferred:
    """The weight GEMMs each micro-batch's B steps deferred, until its W step (a stage's split backward)."""

    def __init__(self) -> None:
        self.pending: dict[Hashable, list[Pending]] = {}  # by (chunk, micro-batch) in a stage

    @contextlib.contextmanager
    def collecting(self, mb: Hashable, layer: int | None) -> Iterator[list[Pending]]:
        """Backwards inside defer into (chunk, micro-batch) ``mb``'s list; yields what this one deferred, once done."""
        pending = self.pending.setdefault(mb, [])
        before = len(pending)
        added: list[Pending] = []
        with deferred(pending, layer):
            yield added
        added.extend(pending[before:])

    def step(self, mb: Hashable, timer: Callable[[], float] | None = None,
             took: Callable[[int | None, float], None] | None = None) -> None:
        """W for ``mb``; with a ``timer``, layer by layer, each one's seconds to ``took(layer, seconds)``."""
        pending = self.pending.pop(mb, [])
        if timer is None or took is None:
            run(pending)
            return
        for layer in dict.fromkeys(p[-1] for p in pending):
            start = timer()
            run([p for p in pending if p[-1] == layer])
            took(layer, timer() - start)

    def clear(self) -> None:
        self.pending.clear()


def held_bytes(pending: list[Pending]) -> int:
    """What deferred GEMMs keep alive until W: their layers' inputs and output gradients (a shared one once)."""
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for x, g, *_ in pending for t in (x, g)}
    return sum(held.values())


def _accumulate(xs: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool) -> None:
    a, b = (xs.t(), g) if transposed else (g.t(), xs)  # the weight's gradient is a @ b
    held = weight.grad
    if _in_place(held, weight):
        held.addmm_(a, b)  # the accumulation inside the GEMM: no temporary, no second pass
    else:
        _add(weight, a.mm(b))
    if bias is not None and bias.requires_grad:
        _add(bias, g.sum(0))


def _in_place(held: torch.Tensor | None, like: torch.Tensor) -> bool:
    """Whether a held gradient can take ``like``'s values added in place (dense, same dtype and shape)."""
    return held is not None and not held.is_sparse and held.dtype == like.dtype and held.shape == like.shape


def _add(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad``: in place when the held gradient allows it, else as autograd would (a new tensor)."""
    held = param.grad
    if held is None:
        param.grad = grad
    elif _in_place(held, grad):
        held.add_(grad)
    else:
        param.grad = held + grad


class _AccumulatingLinear(torch.autograd.Function):
    """``y = x W^T + b`` (``transposed``: ``x W + b``) whose backward returns only the input's gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The parameters themselves, for their .grad: saved-tensor hooks (the stage's memory recording) may hand the
        # saved weight back as another tensor object over the same data.
        ctx.weight, ctx.bias, ctx.transposed = weight, bias, transposed
        if not transposed:
            return torch.nn.functional.linear(x, weight, bias)
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, flat, weight) if bias is not None else flat.mm(weight)
        return out.view(*x.shape[:-1], weight.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        x, saved_weight = ctx.saved_tensors
        weight, bias, transposed = ctx.weight, ctx.bias, ctx.transposed
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad.matmul(saved_weight.t() if transposed else saved_weight)
        g = grad.reshape(-1, grad.shape[-1])
        xs = x.reshape(-1, x.shape[-1])
        if _deferring is not None:
            _deferring.append((xs, g, weight, bias, transposed, _layer))
        else:
            _accumulate(xs, g, weight, bias, transposed)
        return grad_input, None, None, None


def _applies(x: Any, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether this call may take the accumulating backward: autograd records, the weight (and bias) are trainable
    leaves whose ``.grad`` can be written, and no autocast changes the compute's dtype."""
    return (not _suspended and torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.dim() > 0
            and weight.requires_grad and weight.is_leaf and x.dtype == weight.dtype
            and (bias is None or (bias.is_leaf and bias.dim() == 1))
            and not torch.is_autocast_enabled(x.device.type))


class _Forward:
    """A module's forward through ``_AccumulatingLinear`` where it applies. An object, not a closure, so a deepcopy
    of the module gets a forward over the copy (and pickling works)."""

    def __init__(self, module: torch.nn.Module, transposed: bool) -> None:
        self.module, self.transposed = module, transposed

    def __deepcopy__(self, memo: dict[int, Any]) -> _Forward:
        return _Forward(copy.deepcopy(self.module, memo), self.transposed)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        weight, bias = cast(torch.Tensor, module.weight), cast("torch.Tensor | None", module.bias)
        if not _applies(x, weight, bias):
            return cast(torch.Tensor, type(module).forward(module, x))
        return _accumulating(x, weight, bias, self.transposed)


def _accumulating(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    return cast(torch.Tensor, _AccumulatingLinear.apply(x, weight, bias, transposed))  # type: ignore[no-untyped-call]


def graph_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``aten.linear`` in a captured graph (an ``nn.Linear`` of a torch.export-ed model)."""
    if _applies(x, weight, bias):
        return _accumulating(x, weight, bias, False)
    return cast(torch.Tensor, torch.ops.aten.linear.default(x, weight, bias))


def graph_addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta: float = 1,
                alpha: float = 1) -> torch.Tensor:
    """``aten.addmm(bias, x, W)`` in a captured graph (HuggingFace's Conv1D, ``x W + b``, once exported)."""
    if beta == 1 and alpha == 1 and x.dim() == 2 and _applies(x, weight, bias):
        return _accumulating(x, weight, bias, True)
    return cast(torch.Tensor, torch.ops.aten.addmm.default(bias, x, weight, beta=beta, alpha=alpha))


_GRAPH_OPS = {torch.ops.aten.linear.default: (graph_linear, 1), torch.ops.aten.addmm.default: (graph_addmm, 2)}


def _fuse_graph(gm: torch.fx.GraphModule, min_params: int) -> int:
    """Route a captured graph's linear and addmm over a parameter of at least ``min_params`` elements to the
    accumulating versions; how many."""
    count, changed = 0, False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        original = node.meta.get(_MARK, node.target)
        if original not in _GRAPH_OPS:
            continue
        fused, at = _GRAPH_OPS[original]
        weight = node.args[at] if len(node.args) > at else None
        param = attribute(gm, str(weight.target)) if isinstance(weight, torch.fx.Node) and weight.op == "get_attr" else None
        if not isinstance(param, torch.nn.Parameter) or param.numel() < min_params:
            continue
        count += 1
        if node.target is not fused:
            node.meta[_MARK] = original
            node.target = fused
            changed = True
    if changed:
        gm.recompile()
    return count


def _unfuse_graph(gm: torch.fx.GraphModule) -> None:
    changed = False
    for node in gm.graph.nodes:
        if _MARK in node.meta:
            node.target = node.meta.pop(_MARK)
            changed = True
    if changed:
        gm.recompile()


def _kind(module: torch.nn.Module) -> bool | None:
    """False for a Linear (``x W^T``), True for a HuggingFace Conv1D (``x W``), None for anything else."""
    cls = type(module)
    if isinstance(module, torch.nn.Linear) and cls.forward is torch.nn.Linear.forward:
        return False
    if cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and hasattr(module, "nf"):
        return True
    return None


def fuse(module: torch.nn.Module, min_params: int = MIN_PARAMS) -> int:
    """Give every Linear-like submodule of ``module``, and every linear/addmm over a parameter in its captured graphs,
    whose weight has at least ``min_params`` elements the accumulating backward (idempotent); how many there are."""
    count = 0
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            count += _fuse_graph(sub, min_params)
            continue
        kind = _kind(sub)
        if kind is None or cast(torch.Tensor, sub.weight).numel() < min_params:
            continue
        count += 1
        if not isinstance(sub.__dict__.get("forward"), _Forward):
            sub.forward = _Forward(sub, kind)
    return count


def routed_elements(module: torch.nn.Module, min_params: int) -> tuple[int, int]:
    """(weight elements ``fuse(module, min_params)`` routes through the accumulating backward, all weight elements of
    its linear layers): the share of a layer's weight gradients a split backward would defer to W."""
    routed = total = 0
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in sub.graph.nodes:
                original = node.meta.get(_MARK, node.target)
                if node.op != "call_function" or original not in _GRAPH_OPS:
                    continue
                at = _GRAPH_OPS[original][1]
                weight = node.args[at] if len(node.args) > at else None
                param = attribute(sub, str(weight.target)) if isinstance(weight, torch.fx.Node) and \
                    weight.op == "get_attr" else None
                if isinstance(param, torch.nn.Parameter):
                    total += param.numel()
                    routed += param.numel() if param.numel() >= min_params else 0
        elif _kind(sub) is not None:
            n = cast(torch.Tensor, sub.weight).numel()
            total += n
            routed += n if n >= min_params else 0
    return routed, total


def unfuse(module: torch.nn.Module) -> None:
    """Give every submodule its class's own forward back."""
    for sub in module.modules():
        if isinstance(sub, torch.fx.GraphModule):
            _unfuse_graph(sub)
        if isinstance(sub.__dict__.get("forward"), _Forward):
            del sub.forward
