"""One pipeline stage: its layers by global index, each with its own optimizer, run one layer at a time.

Every layer's input is a fresh autograd leaf, so each layer's forward and backward is a separate, timed step. That
lets a layer be kept, swapped or recomputed on its own, lets the profiler measure every layer, and lets a layer move
to another stage with its parameters and optimizer state (live migration). Before each layer's forward the RNG is
seeded from (seed, iteration, micro-batch, layer), so dropout draws the same masks whichever stage runs the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vpipe_lab.core.model import Policy
from vpipe_lab.runtime import recompute
from vpipe_lab.runtime.memory import Ledger, module_grad_bytes, module_param_bytes, optimizer_bytes, tensor_bytes
from vpipe_lab.runtime.swap import SwapEngine

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def layer_seed(seed: int, iteration: int, mb: int, layer: int) -> int:
    return (((seed * 1_000_003 + iteration) * 10_007 + mb) * 1_009 + layer) % (2**62)


def tensors_of(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (tuple, list)):
        return tuple(v for v in value if isinstance(v, torch.Tensor))
    return ()


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
    optimizer: torch.optim.Optimizer | None
    policy: Policy = Policy.KEEP
    stats: LayerStats = field(default_factory=LayerStats)


class Stage:
    """The layers one worker owns, and the per-micro-batch autograd state between their forward and backward."""

    def __init__(self, device: torch.device, make_optimizer: OptimizerFactory | None, seed: int) -> None:
        self.device = device
        self.make_optimizer = make_optimizer
        self.seed = seed
        self.layers: dict[int, Layer] = {}
        self.ledger = Ledger()
        self.swap = SwapEngine(device, self.ledger)
        self._ctx: dict[tuple[int, int], Any] = {}
        self._losses: dict[tuple[int, int], tuple[Callable[[Any, Any], torch.Tensor], Any]] = {}
        self._kept_bytes: dict[tuple[Any, ...], int] = {}  # (layer, input shapes) -> bytes a kept layer saves
        self.loss_scale = 1.0

    # --- ownership -------------------------------------------------------------------------------------------
    def add_layer(self, index: int, module: torch.nn.Module, optimizer_state: dict[str, Any] | None = None) -> None:
        module.to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        optimizer = self.make_optimizer(params) if (params and self.make_optimizer is not None) else None
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        self.layers[index] = Layer(index, module, optimizer)
        self._refresh_params()

    def remove_layer(self, index: int) -> Layer:
        layer = self.layers.pop(index)
        self._refresh_params()
        return layer

    def _refresh_params(self) -> None:
        storages: set[int] = set()
        for layer in self.layers.values():
            storages |= {p.untyped_storage().data_ptr() for p in layer.module.parameters()}
        self.swap.param_storages = storages

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
        for layer in self.layers.values():
            if layer.optimizer is not None:
                layer.optimizer.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for layer in self.layers.values():
            if layer.optimizer is not None:
                layer.optimizer.zero_grad(set_to_none=True)
            else:
                layer.module.zero_grad(set_to_none=True)

    def discard(self) -> None:
        """Drop every in-flight micro-batch (a failed iteration) without touching parameters or optimizer state."""
        self._ctx.clear()
        self._losses.clear()
        self.swap.clear()
        self.zero_grad()

    def static_bytes(self) -> dict[str, int]:
        return {
            "params": sum(module_param_bytes(x.module) for x in self.layers.values()),
            "grads": sum(module_grad_bytes(x.module) for x in self.layers.values()),
            "optimizer": sum(optimizer_bytes(x.optimizer) for x in self.layers.values()),
        }

    def reset_stats(self) -> None:
        for layer in self.layers.values():
            layer.stats = LayerStats()
