"""Measured or analytic costs: layer costs, model profiles and clusters, frozen and JSON round-trippable."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks, documents
from vpipe_lab.core.documents import sparse
from vpipe_lab.core.errors import ProfileError

SCHEMA_VERSION = 1


def _check_nonneg(owner: str, **values: float) -> None:
    for key, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ProfileError(f"{owner}.{key} must be finite and >= 0, got {value!r}")


@dataclass(frozen=True)
class LayerCost:
    """One partition unit (a layer or a block) and its costs per micro-batch.

    ``activation_bytes`` is what the layer saves for backward (held while kept), ``input_bytes`` what recompute holds
    instead, ``output_bytes`` what crosses a stage boundary after it. ``times`` are forward and backward seconds
    measured at other micro-batch sizes, ``(size, forward_s, backward_s)``: a layer runs closer to the hardware's
    peak on larger micro-batches, which a linear model cannot see (``core/cost/scaling.py`` interpolates them).
    ``weight_grad_s`` is the part of ``backward_s`` that computes the weights' gradients, which a zero-bubble schedule
    runs as a step of its own (``core/schedules/orders/zero_bubble.py``); None when not measured (see ``wgrad_s``).
    ``transient_bytes`` is what the layer allocates beyond what is held for it, at its most (its forward's scratch,
    its backward's working set: input gradients, a GEMM's temporaries), and ``step_bytes`` its share of the optimizer
    step's scratch, both measured off the allocator (``runtime/engine/allocator.py``; 0 when not measured).
    """

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: int
    input_bytes: int
    output_bytes: int
    param_bytes: int
    optimizer_bytes: int = 0
    times: tuple[tuple[int, float, float], ...] = sparse(())
    weight_grad_s: float | None = sparse(None)
    transient_bytes: int = sparse(0)
    step_bytes: int = sparse(0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "times", tuple(sorted((int(b), float(f), float(w)) for b, f, w in self.times)))
        for size, fwd, bwd in self.times:
            if size < 1 or not (fwd >= 0 and bwd >= 0 and math.isfinite(fwd) and math.isfinite(bwd)):
                raise ProfileError(f"layer {self.name!r}: times entries are (micro-batch size >= 1, forward_s >= 0, "
                                   f"backward_s >= 0), got {(size, fwd, bwd)!r}")
        _check_nonneg(
            f"layer {self.name!r}",
            forward_s=self.forward_s,
            backward_s=self.backward_s,
            activation_bytes=self.activation_bytes,
            input_bytes=self.input_bytes,
            output_bytes=self.output_bytes,
            param_bytes=self.param_bytes,
            optimizer_bytes=self.optimizer_bytes,
            transient_bytes=self.transient_bytes,
            step_bytes=self.step_bytes,
        )
        if self.weight_grad_s is not None and not 0 <= self.weight_grad_s <= self.backward_s:
            raise ProfileError(f"layer {self.name!r}: weight_grad_s is part of backward_s, so 0 <= weight_grad_s <= "
                               f"{self.backward_s}; got {self.weight_grad_s!r}")

    @property
    def wgrad_s(self) -> float:
        """The weights' gradients' share of the backward: as measured, else half the backward of a layer with
        parameters (a matrix product's input and weight gradients are products of the same size) and none without."""
        if self.weight_grad_s is not None:
            return self.weight_grad_s
        return self.backward_s / 2 if self.param_bytes > 0 else 0.0

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def static_bytes(self) -> int:
        """Parameters, their gradients and optimizer state: what the layer costs wherever it lives."""
        return 2 * self.param_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, doc: Any, where: str = "layer") -> LayerCost:
        return documents.load_fields(cls, doc, where, ProfileError, extra="ignore")


def load_doc(text_or_path: str | Path, what: str) -> Any:
    if isinstance(text_or_path, Path) or not str(text_or_path).lstrip().startswith("{"):
        path = Path(text_or_path)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ProfileError(f"cannot read {what} file {str(path)[:200]!r}: {exc.strerror}") from None
        except ValueError as exc:  # a NUL byte in the name, bytes that are not text
            raise ProfileError(f"cannot read {what} file {str(path)[:200]!r}: {exc}") from None
    else:
        text = str(text_or_path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{what} is not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except (RecursionError, ValueError) as exc:  # lists nested past the parser's depth, a number of 5,000 digits
        raise ProfileError(f"{what} is not a document this lab reads: {exc}") from None


def check_kind(doc: Any, kind: str) -> Mapping[str, Any]:
    if not isinstance(doc, Mapping):
        raise ProfileError(f"a {kind} document must be a JSON object, got {type(doc).__name__}")
    found = doc.get("kind", kind)
    if found != kind:
        raise ProfileError(f"expected a {kind} document but 'kind' is {found!r}")
    version = doc.get("version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ProfileError(f"{kind} schema version {version!r} is not supported: this vpipe_lab reads {SCHEMA_VERSION}")
    return doc


@dataclass(frozen=True)
class SharedTensor:
    """A parameter several units use (a tied embedding and LM head, ALBERT's shared layer): each unit's
    ``param_bytes`` and ``optimizer_bytes`` count it, as each would need it alone on a stage, but a stage holding
    several of ``units`` holds it once (``core/cost/shared_bytes.py`` takes the extra copies off)."""

    name: str
    units: tuple[int, ...]
    param_bytes: int
    optimizer_bytes: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(sorted({int(u) for u in self.units})))
        if len(self.units) < 2 or self.units[0] < 0:
            raise ProfileError(f"shared tensor {self.name!r} needs two or more unit indices >= 0, got {self.units!r}")
        _check_nonneg(f"shared tensor {self.name!r}", param_bytes=self.param_bytes,
                      optimizer_bytes=self.optimizer_bytes)

    @property
    def static_bytes(self) -> int:
        """The tensor, its gradient and its optimizer state: what a stage holds once however many units use it."""
        return 2 * self.param_bytes + self.optimizer_bytes

    @classmethod
    def from_dict(cls, doc: Any, where: str = "shared") -> SharedTensor:
        return documents.load_fields(cls, doc, where, ProfileError, extra="ignore")


@dataclass(frozen=True)
class ModelProfile:
    """The partition units of a model in order, with their measured or analytic costs per micro-batch of
    ``microbatch_size`` samples (0: not known, so the costs cannot be rescaled to another size); ``source`` says
    where the costs come from when they are not this run's measurement (a bundled workload's published curve);
    ``shared`` the parameters several units use (``SharedTensor``)."""

    layers: tuple[LayerCost, ...]
    name: str = ""
    microbatch_size: int = sparse(0)
    source: str = sparse("")
    shared: tuple[SharedTensor, ...] = sparse(())

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "shared", tuple(self.shared))
        if not self.layers:
            raise ProfileError("a profile needs at least one layer: 'layers' is empty")
        _check_nonneg("profile", microbatch_size=self.microbatch_size)
        for tensor in self.shared:
            if tensor.units[-1] >= len(self.layers):
                raise ProfileError(f"shared tensor {tensor.name!r} names unit {tensor.units[-1]} but the profile has "
                                   f"{len(self.layers)} layers (0..{len(self.layers) - 1})")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "profile", "version": SCHEMA_VERSION, **documents.dump(self)}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> ModelProfile:
        return documents.load_fields(cls, check_kind(doc, "profile"), "profile", ProfileError, extra="ignore")

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> ModelProfile:
        return cls.from_dict(load_doc(text_or_path, "profile"))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


@dataclass(frozen=True)
class Cluster:
    """The pipeline's devices: one per stage, each with a memory budget, and the links between them.

    ``swap_bandwidth`` is host<->device bytes/s per direction (PCIe); ``link_bandwidth`` is bytes/s between
    neighbouring stages. ``shared_link`` says inter-stage traffic crosses the same link as swaps (no NVLink), so it
    eats into the budget that hides swap transfers. ``step_overhead_s`` is the runtime's own time per compute step
    (forward, backward, weight step): dispatch and bookkeeping between the kernels, which a schedule with more steps
    per micro-batch pays more often (``Timeline.step_overhead_s`` measures it). ``swap_overlaps`` says swaps run
    beside the compute (a GPU's copy engine); False where the copies run on the compute thread itself (CPU ranks), so
    each swapped layer's copy out and back in adds to its stage's time instead of hiding under it.
    ``update_s_per_byte`` and ``copy_s_per_byte`` are the user's optimizer step and a copy of the weights per
    parameter byte, measured at start-up: what PipeDream's update after every micro-batch costs
    (``schedules/orders/stashing.py``).
    ``iteration_overhead_s`` is the measured time between one iteration's end and the next one's start (the optimizer
    step and the boundary), which an iteration's own span leaves out (``simulator.period_s`` adds it).
    """

    stages: int
    memory_bytes: int | tuple[int, ...]
    swap_bandwidth: float
    link_bandwidth: float
    link_latency_s: float = 0.0
    shared_link: bool = False
    name: str = ""
    step_overhead_s: float = 0.0
    swap_overlaps: bool = True
    update_s_per_byte: float = 0.0
    copy_s_per_byte: float = 0.0
    iteration_overhead_s: float = 0.0
    shard_bandwidth: float = sparse(0.0)  # bytes/s of a sharded stage's all-gathers and reduce-scatters (0: link_bandwidth)
    budgets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks.count(self.stages, "cluster.stages", error=ProfileError)
        memory = self.memory_bytes
        if isinstance(memory, (list, tuple)):
            memory = tuple(int(m) for m in memory)
            object.__setattr__(self, "memory_bytes", memory)
            if len(memory) != self.stages:
                raise ProfileError(
                    f"cluster.memory_bytes has {len(memory)} entries for {self.stages} stages: "
                    "give one number, or one per stage"
                )
            budgets = memory
        else:
            budgets = (int(memory),) * self.stages
        for i, budget in enumerate(budgets):
            if budget <= 0:
                raise ProfileError(f"cluster.memory_bytes for stage {i} must be > 0, got {budget}")
        object.__setattr__(self, "budgets", budgets)
        if not (self.swap_bandwidth > 0 and math.isfinite(self.swap_bandwidth)):
            raise ProfileError(f"cluster.swap_bandwidth must be a positive number of bytes/s, got {self.swap_bandwidth!r}")
        if not (self.link_bandwidth > 0 and math.isfinite(self.link_bandwidth)):
            raise ProfileError(f"cluster.link_bandwidth must be a positive number of bytes/s, got {self.link_bandwidth!r}")
        _check_nonneg("cluster", link_latency_s=self.link_latency_s, step_overhead_s=self.step_overhead_s,
                      update_s_per_byte=self.update_s_per_byte, copy_s_per_byte=self.copy_s_per_byte,
                      iteration_overhead_s=self.iteration_overhead_s, shard_bandwidth=self.shard_bandwidth)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "cluster", "version": SCHEMA_VERSION, **documents.dump(self)}

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> Cluster:
        return documents.load_fields(cls, check_kind(doc, "cluster"), "cluster", ProfileError, extra="ignore")

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Cluster:
        return cls.from_dict(load_doc(text_or_path, "cluster"))
