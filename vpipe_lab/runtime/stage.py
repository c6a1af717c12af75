"""One pipeline stage: its layers (partition units) by global index, run one layer at a time, and one optimizer.

Every layer's input is a fresh autograd leaf, so each layer's forward and backward is a separate, timed step. That
lets a layer be kept, swapped or recomputed on its own, lets the profiler measure every layer, and lets a layer move
to another stage (live migration). Before each layer's forward the RNG is seeded from (seed, iteration, micro-batch,
layer), so dropout draws the same masks whichever stage runs the layer.

Parameters and buffers live in a registry keyed by their model-wide canonical name, so a weight that two layers share
(a tied embedding and LM head) is one tensor with one gradient and one optimizer entry on this stage, whichever
layers come and go. The stage's single optimizer is rebuilt when its layers change, carrying each parameter's state
by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vpipe_lab.core.model import Policy
from vpipe_lab.runtime import recompute
from vpipe_lab.runtime.capture import UnitTensors
from vpipe_lab.runtime.memory import Ledger, optimizer_bytes, tensor_bytes
from vpipe_lab.runtime.swap import SwapEngine

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def layer_seed(seed: int, iteration: int, mb: int, layer: int) -> int:
    return (((seed * 1_000_003 + iteration) * 10_007 + mb) * 1_009 + layer) % (2**62)


def tensors_of(value: Any) -> tuple[torch.Tensor, ...]:
    """The tensors in a value of any structure (tensor, tuple, dict, ModelOutput), in pytree order."""
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))


def set_tensor(module: torch.nn.Module, path: str, value: torch.Tensor) -> None:
    """Make ``module``'s parameter or buffer at ``path`` be ``value`` (the very object: ties stay ties)."""
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if name in owner._parameters:
        owner._parameters[name] = value  # type: ignore[assignment]
    elif name in owner._buffers:
        owner._buffers[name] = value
    else:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer {path!r}")


def get_tensor(module: torch.nn.Module, path: str) -> torch.Tensor:
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    value = owner._parameters.get(name) if name in owner._parameters else owner._buffers.get(name)
    if value is None:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer {path!r}")
    return value


@dataclass
class LayerStats:
    """Per-layer measurements since the last reset, for the online profiler."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    forwards: int = 0
    backwards: int = 0
    activation_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0


@dataclass
class Layer:
    index: int
    module: torch.nn.Module
    tensors: UnitTensors
    policy: Policy = Policy.KEEP
    stats: LayerStats = field(default_factory=LayerStats)

    @property
    def names(self) -> list[str]:
        """Canonical names of this layer's parameters and buffers."""
        return [c for _, c in self.tensors.params] + [c for _, c in self.tensors.buffers]


class Stage:
    """The layers one worker owns, and the per-micro-batch autograd state between their forward and backward."""

    def __init__(self, device: torch.device, make_optimizer: OptimizerFactory | None, seed: int) -> None:
        self.device = device
        self.make_optimizer = make_optimizer
        self.seed = seed
        self.layers: dict[int, Layer] = {}
        self.tensors: dict[str, torch.Tensor] = {}  # canonical name -> the one parameter or buffer object
        self.optimizer: torch.optim.Optimizer | None = None
        self.ledger = Ledger()
        self.swap = SwapEngine(device, self.ledger)
        self._ctx: dict[tuple[int, int], Any] = {}
        self._losses: dict[tuple[int, int], tuple[Callable[[Any, Any], torch.Tensor], Any]] = {}
        self._kept_bytes: dict[tuple[Any, ...], int] = {}  # (layer, input shapes) -> bytes a kept layer saves
        self.loss_scale = 1.0

    # --- ownership -------------------------------------------------------------------------------------------
    def add_layer(self, index: int, module: torch.nn.Module, tensors: UnitTensors | None = None) -> None:
        """Adopt a layer; its parameters and buffers that this stage already holds (ties) are bound to those objects,
        and the optimizer now steps its parameters too."""
        if tensors is None:
            tensors = UnitTensors([(n, f"{index}.{n}") for n, _ in module.named_parameters(remove_duplicate=False)],
                                  [(n, f"{index}.{n}") for n, _ in module.named_buffers(remove_duplicate=False)])
        module.to(self.device)
        for local, name in tensors.params + tensors.buffers:
            held = self.tensors.get(name)
            if held is None:
                self.tensors[name] = get_tensor(module, local)
            elif held is not get_tensor(module, local):
                set_tensor(module, local, held)
        self.layers[index] = Layer(index, module, tensors)
        self._refresh_params()
        self.rebuild_optimizer()

    def remove_layer(self, index: int) -> Layer:
        """Drop a layer; tensors no other layer here uses leave the registry."""
        layer = self.layers.pop(index)
        used = {name for other in self.layers.values() for name in other.names}
        for name in layer.names:
            if name not in used:
                self.tensors.pop(name, None)
        self._refresh_params()
        self.rebuild_optimizer()
        return layer

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable parameters held, each once, in layer order: what the optimizer steps."""
        seen: dict[str, torch.nn.Parameter] = {}
        for index in self.owned:
            for _, name in self.layers[index].tensors.params:
                p = self.tensors[name]
                if name not in seen and isinstance(p, torch.nn.Parameter) and p.requires_grad:
                    seen[name] = p
        return list(seen.items())

    def optimizer_state(self, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Each parameter's optimizer state by canonical name (all held ones unless ``names``)."""
        if self.optimizer is None:
            return {}
        wanted = None if names is None else set(names)
        return {name: dict(self.optimizer.state[p]) for name, p in self.params()
                if p in self.optimizer.state and (wanted is None or name in wanted)}

    def rebuild_optimizer(self, states: dict[str, dict[str, Any]] | None = None) -> None:
        """One optimizer over the parameters held now, keeping every parameter's state (``states``, by name, fills in
        parameters that have none here yet: ones that just arrived)."""
        carried = {**(states or {}), **self.optimizer_state()}
        params = self.params()
        self.optimizer = self.make_optimizer([p for _, p in params]) if (params and self.make_optimizer) else None
        if self.optimizer is not None:
            for name, p in params:
                if name in carried:
                    self.optimizer.state[p] = {k: v.to(self.device) if isinstance(v, torch.Tensor) and v.dim() else v
                                               for k, v in carried[name].items()}

    def _refresh_params(self) -> None:
        self.swap.param_storages = {t.untyped_storage().data_ptr() for t in self.tensors.values()}

    @property
    def owned(self) -> list[int]:
        return sorted(self.layers)

    def set_policies(self, policies: dict[int, Policy]) -> None:
        for index, policy in policies.items():
            if index in self.layers:
                self.layers[index].policy = policy

    # --- per-layer work ----------------------------------------------------------------------------------------
    def _seed(self, value: int) -> None:
        # torch.manual_seed walks every device's generator (~170 us); the generators this stage uses cost ~2 us.
        torch.default_generator.manual_seed(value)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(value)

    def forward(self, iteration: int, mb: int, index: int, x: Any, timer: Callable[[], float],
                input_grad: bool = True) -> Any:
        """One layer's forward; its time includes the per-layer bookkeeping, which is real per-layer cost.
        ``input_grad=False`` for the pipeline's data input, whose gradient nobody needs."""
        start = timer()
        layer = self.layers[index]
        self._seed(layer_seed(self.seed, iteration, mb, index))
        inp, leaves = recompute.leafify(x, input_grad)
        if layer.policy is Policy.RECOMPUTE:
            out, saved = recompute.forward_without_saving(layer.module, inp, self.device, input_grad)
            self._ctx[(mb, index)] = saved
            self.ledger.add(mb, index, sum(tensor_bytes(t) for t in tensors_of(saved.inputs)))
        else:
            # A kept layer saves the same bytes for the same input shapes: measure them once through the saved-tensor
            # hooks, then run without hooks (they cost ~0.1 ms per layer) and charge the ledger what was measured.
            shape_key = (index, tuple((tuple(t.shape), t.dtype) for t in tensors_of(inp)))
            known = self._kept_bytes.get(shape_key) if layer.policy is Policy.KEEP else None
            if known is None:
                with self.swap.recording(mb, index):
                    out = layer.module(inp)
                if layer.policy is Policy.KEEP:
                    self._kept_bytes[shape_key] = self.ledger.device.get((mb, index), 0)
            else:
                out = layer.module(inp)
                self.ledger.add(mb, index, known)
            self._ctx[(mb, index)] = (leaves, out)
        st = layer.stats
        if layer.policy is not Policy.RECOMPUTE:
            st.activation_bytes = max(st.activation_bytes, self.ledger.device.get((mb, index), 0))
        st.input_bytes = max(st.input_bytes, sum(t.numel() * t.element_size() for t in leaves))
        st.output_bytes = max(st.output_bytes, sum(t.numel() * t.element_size() for t in tensors_of(out)))
        st.forwards += 1
        result = recompute.detach(out)
        st.forward_s += timer() - start
        return result

    def rematerialise(self, mb: int, index: int, timer: Callable[[], float]) -> None:
        """RECOMPUTE: rebuild the layer's graph from its saved input, right before its backward."""
        layer = self.layers[index]
        saved = self._ctx.get((mb, index))
        if not isinstance(saved, recompute.Saved):
            return
        start = timer()
        self.ledger.release(mb, index)
        with self.swap.recording(mb, index):
            leaves, out = recompute.rematerialise(layer.module, saved)
        pending = self._losses.pop((mb, index), None)
        if pending is not None:
            out = pending[0](out, pending[1]) * self.loss_scale
        self._ctx[(mb, index)] = (leaves, out)
        layer.stats.recompute_s += timer() - start
        layer.stats.activation_bytes = max(layer.stats.activation_bytes, self.ledger.device.get((mb, index), 0))

    def attach_loss(self, mb: int, index: int, output: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    target: Any, timer: Callable[[], float]) -> float:
        """Make the last layer's backward start from its micro-batch's scaled loss; returns the loss value.

        The loss counts as part of the last layer's forward. A recomputed last layer ran without autograd, so its
        loss is rebuilt when the layer is rematerialised.
        """
        start = timer()
        ctx = self._ctx[(mb, index)]
        if isinstance(ctx, recompute.Saved):
            self._losses[(mb, index)] = (loss_fn, target)
            with torch.no_grad():
                value = float(loss_fn(output, target))
        else:
            leaves, out = ctx
            loss = loss_fn(out, target)
            self._ctx[(mb, index)] = (leaves, loss * self.loss_scale)
            value = float(loss.detach())
        self.layers[index].stats.forward_s += timer() - start
        return value

    def backward(self, mb: int, index: int, grads: tuple[torch.Tensor, ...] | None,
                 timer: Callable[[], float]) -> tuple[torch.Tensor, ...]:
        """Backpropagate through one layer; returns the gradients of its floating inputs."""
        if isinstance(self._ctx.get((mb, index)), recompute.Saved):
            self.rematerialise(mb, index, timer)
        start = timer()
        leaves, out = self._ctx.pop((mb, index))
        if grads is None:  # the loss
            outs, grad_list = [t for t in tensors_of(out) if t.requires_grad], None
        else:  # gradients arrive for the floating outputs, in order; pair them before dropping constants
            pairs = [(t, g) for t, g in zip((t for t in tensors_of(out) if t.is_floating_point()), grads)
                     if t.requires_grad]
            outs, grad_list = [t for t, _ in pairs], [g for _, g in pairs]
        if outs:
            torch.autograd.backward(outs, grad_tensors=grad_list)
        layer = self.layers[index]
        self.swap.release(mb, index)
        grads_in = tuple(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves)
        layer.stats.backward_s += timer() - start
        layer.stats.backwards += 1
        return grads_in

    # --- iteration boundary ----------------------------------------------------------------------------------------
    def step(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for t in self.tensors.values():
            t.grad = None

    def discard(self) -> None:
        """Drop every in-flight micro-batch (a failed iteration) without touching parameters or optimizer state."""
        self._ctx.clear()
        self._losses.clear()
        self.swap.clear()
        self.zero_grad()

    def static_bytes(self) -> dict[str, int]:
        params = [p for _, p in self.params()]
        return {
            "params": sum(tensor_bytes(p) for p in params),
            "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            "optimizer": optimizer_bytes(self.optimizer),
        }

    def reset_stats(self) -> None:
        for layer in self.layers.values():
            layer.stats = LayerStats()
