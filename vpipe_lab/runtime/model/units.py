"""A stage's layers (partition units) and the helpers that reach into a unit's tensors by name."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vpipe_lab.core.plan import Policy
from vpipe_lab.runtime.model.capture import UnitTensors


def layer_seed(seed: int, iteration: int, mb: int, layer: int) -> int:
    """The RNG seed of one layer's forward on one micro-batch: the same on whichever stage runs the layer."""
    return (((seed * 1_000_003 + iteration) * 10_007 + mb) * 1_009 + layer) % (2**62)


def seed_generators(device: torch.device, value: int) -> None:
    """Seed the generators a stage on ``device`` draws from: torch.manual_seed walks every device's generator
    (~170 us), these two cost ~2 us."""
    torch.default_generator.manual_seed(value)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index or 0].manual_seed(value)


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


Segment = tuple[int, ...]  # consecutive layers run as one autograd graph


def segments_of(policies: tuple[tuple[int, Policy], ...], profile: bool, cuts: tuple[int, ...]) -> list[Segment]:
    """A stage's (layer, policy) pairs as segments: maximal runs of one policy, one layer per recomputed layer (each
    keeps its own input, so its rebuild holds only its activations), or one layer each when ``profile``; a segment
    never runs across a layer in ``cuts``."""
    found: list[Segment] = []
    last: Policy | None = None
    for index, policy in policies:
        if (found and not profile and policy is not Policy.RECOMPUTE and index not in cuts and last is policy
                and found[-1][-1] == index - 1):
            found[-1] = (*found[-1], index)
        else:
            found.append((index,))
        last = policy
    return found


def writes_input(module: torch.nn.Module) -> bool:
    """Whether a unit (an ``nn.Sequential`` child) may write its input in place: it holds a module built
    ``inplace=True`` (a ReLU). A received input is a leaf of its stage's autograd graph, which an in-place op may not
    change, so the stage gives such a unit a copy (captured units know exactly which inputs they write:
    ``capture.GraphUnit``)."""
    from vpipe_lab.runtime.model.graph_unit import GraphUnit

    return not isinstance(module, GraphUnit) and any(getattr(m, "inplace", False) is True for m in module.modules())


def get_tensor(module: torch.nn.Module, path: str) -> torch.Tensor:
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    value = owner._parameters.get(name) if name in owner._parameters else owner._buffers.get(name)
    if value is None:
        raise KeyError(f"{type(module).__name__} has no parameter or buffer {path!r}")
    return value


SAMPLES = 512  # the most recent timings kept per layer and kind


@dataclass
class LayerStats:
    """Per-layer measurements from profiling iterations since the last reset, for the online profiler.

    Times are kept per micro-batch so the profiler can take their median: on a busy machine one slow sample (a
    page fault after the allocator gave memory back, a garbage collection) would otherwise move a mean a lot."""

    recompute_s: float = 0.0
    forwards: int = 0
    backwards: int = 0
    activation_bytes: int = 0
    input_bytes: int = 0
    output_bytes: int = 0
    transient_bytes: int = 0  # allocated beyond what is held for it, at its most (engine/allocator.py)
    step_bytes: int = 0  # its share of the optimizer step's scratch
    forward_times: list[float] = field(default_factory=list)
    backward_times: list[float] = field(default_factory=list)
    weight_times: list[float] = field(default_factory=list)  # a split backward's W step (zero-bubble schedules)
    # Micro-batch size -> (forward times, backward times) of probes at sizes other than the running one.
    sizes: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)

    def add_size(self, size: int, forward_s: float, backward_s: float) -> None:
        fwd, bwd = self.sizes.setdefault(size, ([], []))
        fwd.append(forward_s)
        bwd.append(backward_s)
        del fwd[:-SAMPLES], bwd[:-SAMPLES]

    def note_saved(self, nbytes: int) -> None:
        """What one micro-batch's forward saved for its backward (the loss's included, on the last layer): the most."""
        self.activation_bytes = max(self.activation_bytes, nbytes)

    def add_forward(self, seconds: float, extend: bool = False) -> None:
        """One forward's time; ``extend`` adds to the latest one (the loss belongs to the last layer's forward)."""
        if extend and self.forward_times:
            self.forward_times[-1] += seconds
        elif not extend:
            self.forward_times.append(seconds)
            del self.forward_times[:-SAMPLES]

    def add_backward(self, seconds: float) -> None:
        self.backwards += 1
        self.backward_times.append(seconds)
        del self.backward_times[:-SAMPLES]

    def add_weight(self, seconds: float) -> None:
        self.weight_times.append(seconds)
        del self.weight_times[:-SAMPLES]

    @staticmethod
    def typical(times: list[float]) -> float:
        """The median time, 0 when there is none."""
        return statistics.median(times) if times else 0.0


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
