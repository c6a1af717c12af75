"""One pipeline stage: its layers (partition units) by global index, run as fused segments, and one optimizer.

Consecutive kept or swapped layers run as one *segment*: one autograd graph from the segment's input (a fresh leaf)
to its output, one backward call, as a plain model would run them; swap boundaries split segments (a swapped
segment's saved tensors but its input leave the device between its forward and backward). A recomputed layer is a
segment of its own: it runs without autograd, keeps its input, and is rebuilt in the backward right before its own
(vPipe's order), so one recomputed layer's activations are held at a time, as the cost model charges. Saved tensors
are attributed to the layer that saved them (the saved-tensor hooks know the layer), so a swap moves only its own.
In a *profiling* iteration every layer is a segment of its own, timed with the device synchronised, for the online
profiler; the executor decides which iterations profile (``executor.Executor``).

Before each layer's forward the RNG is seeded from (seed, iteration, micro-batch, layer), so dropout draws the same
masks whichever stage runs the layer and however the layers are grouped. Parameters and buffers are keyed by their
model-wide name: a weight two layers share (tied embedding and LM head) is one tensor, gradient and optimizer entry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from vpipe_lab.core.plan import Policy
from vpipe_lab.runtime.engine import probe, wgrad
from vpipe_lab.runtime.engine.optim import OptimizerFactory, SchedulerFactory, StageOptimizer
from vpipe_lab.runtime.engine.shards import Shards
from vpipe_lab.runtime.engine.stage_state import UnitState
from vpipe_lab.runtime.memory import recompute
from vpipe_lab.runtime.memory.ledger import Ledger, local_tensor, optimizer_bytes, tensor_bytes
from vpipe_lab.runtime.memory.stash import WeightStash
from vpipe_lab.runtime.memory.swap import SwapEngine
from vpipe_lab.runtime.model import experts
from vpipe_lab.runtime.model.capture import UnitTensors
from vpipe_lab.runtime.model.units import (
    Layer,
    LayerStats,
    Segment,
    get_tensor,
    layer_seed,
    seed_generators,
    segments_of,
    set_tensor,
    tensors_of,
    writes_input,
)

log = logging.getLogger(__name__)
Timer = Callable[[], float]


class Stage(UnitState):
    """The layers one worker owns, and the per-micro-batch autograd state between their forward and backward."""

    def __init__(self, device: torch.device, make_optimizer: OptimizerFactory | None, seed: int,
                 scheduler: SchedulerFactory | None = None,
                 autocast: Callable[[], AbstractContextManager[object]] = nullcontext,
                 fused_wgrad: int | None = wgrad.MIN_PARAMS) -> None:
        self.device = device
        self.fused_wgrad = fused_wgrad  # Linear weights this large accumulate inside the GEMM (runtime/engine/wgrad.py)
        self.split = False  # a zero-bubble schedule: B defers the linear weights' gradients to W (split_backward)
        self.deferred = wgrad.Deferred()  # the weight GEMMs each micro-batch's B left for its W
        self.seed = seed
        self.layers: dict[int, Layer] = {}
        self.tensors: dict[str, torch.Tensor] = {}  # canonical name -> the one parameter or buffer object
        self.optim = StageOptimizer(make_optimizer, device, scheduler)
        self.autocast = autocast  # the compute's precision (see runtime/training/precision.py); recompute replays it too
        self.ledger = Ledger()
        self.swap = SwapEngine(device, self.ledger)
        self.stash = WeightStash()  # PipeDream's weight versions, under the pipedream schedule (``stash.on``)
        self.iteration = 0
        self.mb_offset = 0  # replica r's micro-batch m is the global batch's micro-batch r * M + m (dropout seeds)
        self.at_units: tuple[int, int] | None = None  # the units the last forward or backward entered
        self.probing = True  # profiling iterations also time each layer at other micro-batch sizes (see probe)
        self._unprobed: set[int] = set()  # layers whose probe failed
        self._inplace: dict[int, bool] = {}  # layer -> whether it may write its input in place (_writes_input)
        self._ctx: dict[tuple[int, int], Any] = {}  # (micro-batch, segment's first layer) -> autograd state
        self._losses: dict[tuple[int, int], tuple[Callable[[Any, Any], torch.Tensor], Any]] = {}
        self._kept_bytes: dict[tuple[Any, ...], dict[int, int]] = {}  # (segment, input shapes) -> bytes saved per layer
        self._segments: dict[tuple[Any, ...], list[Segment]] = {}
        self.loss_scale = 1.0
        # A short last batch splits unevenly: micro-batch m's loss then counts by its share of the samples, n_m / N
        # (times the loss multiplier), as one process's full-batch mean does; None: every one by loss_scale.
        self.scales: list[float] | None = None
        self.shards: Shards | None = None  # a sharded stage's FSDP units (set before the first layer arrives)

    def shard(self, shards: Shards) -> None:
        """Hold this stage's units sharded, from before the first arrives: ``shards`` wraps each in FSDP2."""
        self.shards, self.swap.gathered = shards, shards.live

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optim.optimizer

    # --- ownership -------------------------------------------------------------------------------------------
    def add_layer(self, index: int, module: torch.nn.Module, tensors: UnitTensors | None = None,
                  groups: list[dict[str, Any]] | None = None, states: dict[str, dict[str, Any]] | None = None) -> None:
        """Adopt a layer; its parameters and buffers that this stage already holds (ties) are bound to those objects.
        Its parameters join the optimizer with ``groups``' options and ``states`` when it brings them (migration)."""
        if tensors is None:
            tensors = UnitTensors([(n, f"{index}.{n}") for n, _ in module.named_parameters(remove_duplicate=False)],
                                  [(n, f"{index}.{n}") for n, _ in module.named_buffers(remove_duplicate=False)])
        module.to(self.device)
        self._retarget(module)
        for local, name in tensors.params + tensors.buffers:  # a tie binds to the one tensor held here
            held = self.tensors.get(name)
            if held is not None and held is not get_tensor(module, local):
                set_tensor(module, local, held)
        if self.shards is not None:  # its parameters become this rank's shards (engine/shards.py)
            module = self.shards.wrap(index, module, tensors.params)
        self._fuse(module)
        for local, name in tensors.params + tensors.buffers:
            self.tensors.setdefault(name, get_tensor(module, local))
        self.layers = dict(sorted({**self.layers, index: Layer(index, module, tensors)}.items()))  # run in order
        self._changed()
        self.optim.add_unit(index, self._trainable(index), groups, states)

    def take_module(self, index: int, module: torch.nn.Module) -> None:
        """Run layer ``index`` with ``module``: the same unit captured for other input shapes, already computing with
        this stage's tensors (``recapture.bind``). Parameters, optimizer state and statistics stay."""
        self._retarget(module)
        self._fuse(module)
        self.layers[index].module = module
        self._changed()

    def _fuse(self, module: torch.nn.Module) -> None:
        """Linear weights through ``wgrad``: from the launch's threshold, lower while the backward is split."""
        if (threshold := wgrad.split_threshold(self.fused_wgrad) if self.split else self.fused_wgrad) is not None:
            wgrad.fuse(module, threshold)

    def split_backward(self, on: bool) -> None:
        """Split each backward into B (input gradients) and W (``weight_step``) for a zero-bubble schedule, or not."""
        if self.shards is not None:
            self.shards.set_split(on)
        if on != self.split:
            self.split = on
            for layer in self.layers.values():
                wgrad.unfuse(layer.module)
                self._fuse(layer.module)

    def _retarget(self, module: torch.nn.Module) -> None:
        retarget = getattr(module, "retarget", None)  # a captured unit: its graph's device arguments
        if retarget is not None:
            retarget(self.device)

    def remove_layer(self, index: int) -> Layer:
        """Drop a layer with its optimizer groups and state; tensors another layer here uses stay (ties)."""
        layer = self.layers.pop(index)
        if self.shards is not None:
            self.shards.release(index)
        stays: dict[str, int] = {}
        for other in sorted(self.layers):
            for name in self.layers[other].names:
                stays.setdefault(name, other)
        self.optim.remove_unit(index, stays)
        for name in layer.names:
            if name not in stays:
                self.tensors.pop(name, None)
        self._changed()
        return layer

    def _trainable(self, index: int) -> list[tuple[str, torch.nn.Parameter]]:
        out: dict[str, torch.nn.Parameter] = {}
        for _, name in self.layers[index].tensors.params:
            p = self.tensors[name]
            if isinstance(p, torch.nn.Parameter) and p.requires_grad:
                out.setdefault(name, p)
        return list(out.items())

    def _changed(self) -> None:
        self._storages()
        self._segments.clear()
        self._kept_bytes.clear()  # a layer index may now name another module

    def _storages(self) -> None:  # what the saved-tensor accounting takes for weights (stashed ones too)
        self.swap.param_storages = {local_tensor(t).untyped_storage().data_ptr()
                                    for t in self.tensors.values()} | self.stash.storages()

    def params(self) -> list[tuple[str, torch.nn.Parameter]]:
        """Trainable parameters held, each once, in layer order: what the optimizer steps."""
        seen: dict[str, torch.nn.Parameter] = {}
        for index in self.owned:
            for name, p in self._trainable(index):
                seen.setdefault(name, p)
        return list(seen.items())

    @property
    def owned(self) -> list[int]:
        return sorted(self.layers)

    def set_policies(self, policies: dict[int, Policy]) -> None:
        for index, policy in policies.items():
            if index in self.layers:
                self.layers[index].policy = policy
        self._segments.clear()

    def segments(self, profile: bool = False, cuts: tuple[int, ...] = ()) -> list[Segment]:
        """The owned layers as segments: maximal runs of one policy, one layer per recomputed layer (each keeps its
        own input, so its rebuild holds only its activations), or one layer each in a profiling iteration; a segment
        never runs across a layer in ``cuts`` (the chunks' first layers: two chunks may sit side by side)."""
        key = (profile, cuts, tuple((i, self.layers[i].policy) for i in self.owned))
        found = self._segments.get(key)
        if found is None:
            found = self._segments[key] = segments_of(key[2], profile, cuts)
        return found

    # --- per-segment work ----------------------------------------------------------------------------------------
    def _run(self, mb: int, segment: Segment, x: Any, record: bool) -> Any:
        """The segment's layers in order, each seeded for itself; ``record`` registers what each saves."""
        swapped = record and self.layers[segment[0]].policy is Policy.SWAP  # a segment is of one policy
        held = frozenset(t.untyped_storage().data_ptr() for t in tensors_of(x)) if swapped else frozenset()  # input
        if self._writes_input(segment[0]):  # see _writes_input: a copy, made once, that the layer may change
            x = recompute.copied(x)
        for index in segment:
            self.at_units = (index, index)  # a failure names the unit it happened in (runtime/process.py)
            seed_generators(self.device, layer_seed(self.seed, self.iteration, mb + self.mb_offset, index))
            layer = self.layers[index]
            with (self.swap.recording(mb, index, layer.policy is Policy.SWAP, held) if record else nullcontext(),
                  self.autocast()):
                x = self.stash.call(layer.module, layer.tensors.params, mb, x) if self.stash.on else layer.module(x)
        return x

    def update(self, mb: int) -> None:  # after mb's backward, under PipeDream: the optimizer steps (stash.py)
        if self.stash.update(mb, self.params(), lambda: self.optim.update(self.iteration)):
            self._storages()

    def forward(self, mb: int, segment: Segment, x: Any, input_grad: bool = True, timer: Timer | None = None) -> Any:
        """One segment's forward. ``input_grad=False`` for the pipeline's data input, whose gradient nobody needs;
        ``timer`` (profiling iterations: one layer per segment) puts the time on the layer's stats."""
        start = timer() if timer is not None else 0.0
        policy = self.layers[segment[0]].policy
        key = (mb, segment[0])
        inp, leaves = recompute.leafify(x, input_grad)
        if policy is Policy.RECOMPUTE:
            with experts.counting():  # the first forward counts its experts' tokens; the rebuild will not
                out, saved = recompute.forward_without_saving(lambda v: self._run(mb, segment, v, False), inp,
                                                              self.device, input_grad)
            self._ctx[key] = saved
            self.ledger.add(mb, segment[0], sum(tensor_bytes(t) for t in tensors_of(saved.inputs)))
        else:
            # A kept segment saves the same bytes for the same input shapes: measure them once through the
            # saved-tensor hooks, then run without hooks (they cost ~0.1 ms per layer) and charge what was measured.
            shape_key = (segment, tuple((tuple(t.shape), t.dtype) for t in tensors_of(inp)))
            known = self._kept_bytes.get(shape_key) if policy is Policy.KEEP else None
            if known is None:
                with experts.counting():
                    out = self._run(mb, segment, inp, True)
                if policy is Policy.KEEP:
                    self._kept_bytes[shape_key] = {i: self.ledger.device.get((mb, i), 0) for i in segment}
            else:
                with experts.counting():
                    out = self._run(mb, segment, inp, False)
                for index, nbytes in known.items():
                    self.ledger.add(mb, index, nbytes)
            self._ctx[key] = (leaves, out)
        if timer is not None:
            st = self.layers[segment[0]].stats
            if policy is not Policy.RECOMPUTE:
                st.note_saved(self.ledger.device.get(key, 0))
            st.input_bytes = max(st.input_bytes, sum(tensor_bytes(t) for t in (leaves if input_grad else tensors_of(inp))))
            st.output_bytes = max(st.output_bytes, sum(tensor_bytes(t) for t in tensors_of(out)))
            st.forwards += 1
        result = recompute.detach(out)
        if timer is not None:
            self.layers[segment[0]].stats.add_forward(timer() - start)
            # a sharded unit is probed only while it is gathered, and kept so: a probe then runs no collective,
            # which its shards would have to join
            if (self.probing and mb == 0 and segment[0] not in self._unprobed
                    and (self.shards is None or self.shards.is_gathered(segment[0]))):
                with self.shards.kept(segment[0]) if self.shards is not None else nullcontext():
                    probe.probe_or_note(self.layers[segment[0]], self.autocast, x, timer, input_grad, self._unprobed)
        return result

    def _writes_input(self, index: int) -> bool:
        """Whether layer ``index`` may write its input in place (``units.writes_input``), asked once per layer."""
        found = self._inplace.get(index)
        if found is None:
            found = self._inplace[index] = writes_input(self.layers[index].module)
        return found

    def rebuilds(self, mb: int, segment: Segment) -> bool:
        """Whether the segment's backward must first rebuild its graph (a recomputed segment not rebuilt yet)."""
        return isinstance(self._ctx.get((mb, segment[0])), recompute.Saved)

    def rematerialise(self, mb: int, segment: Segment, timer: Timer | None = None) -> None:
        """Rebuild the segment's graph from its saved input, right before its own backward."""
        key = (mb, segment[0])
        saved = self._ctx.get(key)
        if not isinstance(saved, recompute.Saved):
            return
        start = timer() if timer is not None else 0.0
        self.ledger.release(mb, segment[0])
        buffers = [b for i in segment for b in self.layers[i].module.buffers()]
        leaves, out = recompute.rematerialise(lambda v: self._run(mb, segment, v, True), saved, buffers)
        pending = self._losses.pop(key, None)
        if pending is not None:
            with self.autocast():
                out = pending[0](out, pending[1]) * self.scale_of(mb)
        self._ctx[key] = (leaves, out)
        if timer is not None:
            st = self.layers[segment[0]].stats
            st.recompute_s += timer() - start
            st.activation_bytes = max(st.activation_bytes, self.ledger.device.get(key, 0))

    def attach_loss(self, mb: int, segment: Segment, output: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                    target: Any, timer: Timer | None = None) -> torch.Tensor:
        """Make the last segment's backward start from its micro-batch's scaled loss; returns the loss (detached,
        still on the device: reading it would synchronise a GPU in the middle of the iteration). The loss counts as
        part of the last layer's forward: its time, and what it saves for the backward (a cross-entropy the logits'
        log-probabilities), held as long. A recomputed last segment's loss is rebuilt with the segment."""
        start = timer() if timer is not None else 0.0
        key = (mb, segment[0])
        ctx = self._ctx[key]
        if isinstance(ctx, recompute.Saved):
            self._losses[key] = (loss_fn, target)
            with torch.no_grad(), self.autocast():
                value = loss_fn(output, target).detach()
        else:
            leaves, out = ctx
            with self.swap.recording(mb, segment[0], swapped=False), self.autocast():
                loss = loss_fn(out, target)
            self._ctx[key] = (leaves, loss * self.scale_of(mb))
            value = loss.detach()
            if timer is not None:
                self.layers[segment[0]].stats.note_saved(self.ledger.device.get(key, 0))
        if timer is not None:
            self.layers[segment[-1]].stats.add_forward(timer() - start, extend=True)
        return value

    def scale_of(self, mb: int) -> float:  # what micro-batch ``mb``'s loss is multiplied by before its backward
        return self.scales[mb] if self.scales is not None else self.loss_scale

    def backward(self, mb: int, segment: Segment, grads: tuple[torch.Tensor, ...] | None,
                 timer: Timer | None = None, chunk: int = 0) -> tuple[torch.Tensor, ...]:
        """Backpropagate through one segment; returns the gradients of its floating inputs. A split backward defers
        its weight GEMMs to the W step of (``chunk``, ``mb``): a stage with two chunks runs a W for each."""
        key = (mb, segment[0])
        if self.rebuilds(mb, segment):  # the executor rebuilds it first to time it; a direct call still works
            self.rematerialise(mb, segment, timer)
        self.at_units = (segment[0], segment[-1])
        start = timer() if timer is not None else 0.0
        leaves, out = self._ctx.pop(key)
        if grads is None:  # the loss
            outs, grad_list = [t for t in tensors_of(out) if t.requires_grad], None
        else:  # gradients arrive for the floating outputs, in order; pair them before dropping constants
            pairs = [(t, g) for t, g in zip((t for t in tensors_of(out) if t.is_floating_point()), grads)
                     if t.requires_grad]
            outs, grad_list = [t for t, _ in pairs], [g for _, g in pairs]
        split = self.deferred.collecting((chunk, mb), segment[0] if timer else None) if self.split else nullcontext([])
        with split as added:  # a split backward leaves its weight GEMMs for the W step
            if outs:
                torch.autograd.backward(outs, grad_tensors=grad_list)
        for index in segment:  # the saved activations are gone by now; W's inputs may be some of them, kept
            self.swap.release(mb, index)
        self.ledger.add(mb, -1 - chunk, wgrad.held_bytes(added))  # what W needs held until it runs, under no layer
        grads_in = tuple(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves)
        if timer is not None:
            st = self.layers[segment[0]].stats
            st.add_backward(timer() - start)
        return grads_in

    def weight_step(self, mb: int, timer: Timer | None = None, chunk: int = 0) -> None:
        """W: the weight gradients micro-batch ``mb``'s B deferred in ``chunk``; timed per layer when profiling."""
        self.deferred.step((chunk, mb), timer, lambda i, seconds: self.layers[i].stats.add_weight(seconds)
                           if i in self.layers else None)
        self.ledger.release(mb, -1 - chunk)

    # --- iteration boundary ----------------------------------------------------------------------------------------
    def step(self) -> None:
        """A plain step (the worker's ``step.Stepper`` adds clipping and precision)."""
        self.optim.step(self.iteration)
        self.zero_grad()

    def zero_grad(self) -> None:
        for t in self.tensors.values():
            t.grad = None

    def discard(self) -> None:
        """Drop every in-flight micro-batch (a failed iteration) without touching parameters or optimizer state."""
        self._ctx.clear()
        self._losses.clear()
        self.deferred.clear()
        self.swap.clear()
        self.stash.reset()
        if self.shards is not None:
            self.shards.discard()
        self._storages()
        self.zero_grad()

    def static_bytes(self) -> dict[str, int]:
        """What this stage holds whatever runs, by part (a layer's share: ``memory.unit_static_bytes``)."""
        params = [p for _, p in self.params()]  # a sharded stage's: this rank's shards (``ledger.tensor_bytes``)
        return {"params": sum(tensor_bytes(p) for p in params), "optimizer": optimizer_bytes(self.optimizer),
                "grads": sum(tensor_bytes(p.grad) for p in params if p.grad is not None)}

    def reset_stats(self) -> None:
        for layer in self.layers.values():
            layer.stats = LayerStats()
