"""Measured or analytic costs: layer costs, model profiles and clusters, frozen and JSON round-trippable."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks
from vpipe_lab.core.errors import ProfileError

SCHEMA_VERSION = 1


def _number(doc: Mapping[str, Any], key: str, where: str, *, integer: bool = False, default: Any = None) -> Any:
    """Read a finite non-negative number from ``doc[key]``; errors name the field path and the fix."""
    if key not in doc:
        if default is not None:
            return default
        raise ProfileError(f"{where}.{key} is missing: add it as a non-negative number")
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}.{key} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ProfileError(f"{where}.{key} must be finite and >= 0, got {value!r}")
    if integer:
        if int(value) != value:
            raise ProfileError(f"{where}.{key} counts bytes and must be a whole number, got {value!r}")
        return int(value)
    return float(value)


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
    times: tuple[tuple[int, float, float], ...] = ()
    weight_grad_s: float | None = None
    transient_bytes: int = 0
    step_bytes: int = 0

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
        return {
            "name": self.name,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "activation_bytes": self.activation_bytes,
            "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes,
            "param_bytes": self.param_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            **({"times": [list(t) for t in self.times]} if self.times else {}),
            **({"weight_grad_s": self.weight_grad_s} if self.weight_grad_s is not None else {}),
            **({"transient_bytes": self.transient_bytes} if self.transient_bytes else {}),
            **({"step_bytes": self.step_bytes} if self.step_bytes else {}),
        }

    @classmethod
    def from_dict(cls, doc: Any, where: str = "layer") -> LayerCost:
        if not isinstance(doc, Mapping):
            raise ProfileError(f"{where} must be an object with forward_s, backward_s, ... fields, got {doc!r}")
        name = doc.get("name", where)
        if not isinstance(name, str):
            raise ProfileError(f"{where}.name must be a string, got {name!r}")
        return cls(
            name=name,
            forward_s=_number(doc, "forward_s", where),
            backward_s=_number(doc, "backward_s", where),
            activation_bytes=_number(doc, "activation_bytes", where, integer=True),
            input_bytes=_number(doc, "input_bytes", where, integer=True),
            output_bytes=_number(doc, "output_bytes", where, integer=True),
            param_bytes=_number(doc, "param_bytes", where, integer=True),
            optimizer_bytes=_number(doc, "optimizer_bytes", where, integer=True, default=0),
            times=_times(doc.get("times", ()), where),
            weight_grad_s=_number(doc, "weight_grad_s", where) if doc.get("weight_grad_s") is not None else None,
            transient_bytes=_number(doc, "transient_bytes", where, integer=True, default=0),
            step_bytes=_number(doc, "step_bytes", where, integer=True, default=0),
        )


def _times(value: Any, where: str) -> tuple[tuple[int, float, float], ...]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(t, (list, tuple)) and len(t) == 3 and all(isinstance(v, (int, float)) for v in t) for t in value):
        raise ProfileError(f"{where}.times must be a list of [micro-batch size, forward_s, backward_s], got {value!r}")
    return tuple((int(t[0]), float(t[1]), float(t[2])) for t in value)


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
        if not isinstance(doc, Mapping) or not isinstance(doc.get("name"), str):
            raise ProfileError(f"{where} must be an object with a string name, units, param_bytes, got {doc!r}")
        units = doc.get("units")
        if not isinstance(units, (list, tuple)) or not all(isinstance(u, int) and not isinstance(u, bool) for u in units):
            raise ProfileError(f"{where}.units must be a list of unit indices, got {units!r}")
        return cls(doc["name"], tuple(units), _number(doc, "param_bytes", where, integer=True),
                   _number(doc, "optimizer_bytes", where, integer=True, default=0))


@dataclass(frozen=True)
class ModelProfile:
    """The partition units of a model in order, with their measured or analytic costs per micro-batch of
    ``microbatch_size`` samples (0: not known, so the costs cannot be rescaled to another size); ``source`` says
    where the costs come from when they are not this run's measurement (a bundled workload's published curve);
    ``shared`` the parameters several units use (``SharedTensor``)."""

    layers: tuple[LayerCost, ...]
    name: str = ""
    microbatch_size: int = 0
    source: str = ""
    shared: tuple[SharedTensor, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "shared", tuple(self.shared))
        if not self.layers:
            raise ProfileError("a profile needs at least one layer: 'layers' is empty")
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
        return {
            "kind": "profile",
            "version": SCHEMA_VERSION,
            "name": self.name,
            **({"microbatch_size": self.microbatch_size} if self.microbatch_size else {}),
            **({"source": self.source} if self.source else {}),
            "layers": [layer.to_dict() for layer in self.layers],
            **({"shared": [asdict(t) for t in self.shared]} if self.shared else {}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> ModelProfile:
        doc = check_kind(doc, "profile")
        layers, shared = doc.get("layers"), doc.get("shared", [])
        if not isinstance(layers, list) or not layers or not isinstance(shared, (list, tuple)):
            raise ProfileError("profile.layers must be a non-empty list of layer objects (and profile.shared a list)")
        return cls(
            layers=tuple(LayerCost.from_dict(item, f"layers[{i}]") for i, item in enumerate(layers)),
            name=str(doc.get("name", "")),
            microbatch_size=_number(doc, "microbatch_size", "profile", integer=True, default=0),
            source=str(doc.get("source", "")),
            shared=tuple(SharedTensor.from_dict(item, f"shared[{i}]") for i, item in enumerate(shared)),
        )

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
    shard_bandwidth: float = 0.0  # bytes/s of a sharded stage's all-gathers and reduce-scatters (0: link_bandwidth)
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
        return {
            "kind": "cluster",
            "version": SCHEMA_VERSION,
            "name": self.name,
            "stages": self.stages,
            "memory_bytes": list(self.memory_bytes) if isinstance(self.memory_bytes, tuple) else self.memory_bytes,
            "swap_bandwidth": self.swap_bandwidth,
            "link_bandwidth": self.link_bandwidth,
            "link_latency_s": self.link_latency_s,
            "shared_link": self.shared_link,
            "step_overhead_s": self.step_overhead_s,
            "swap_overlaps": self.swap_overlaps,
            "update_s_per_byte": self.update_s_per_byte,
            "copy_s_per_byte": self.copy_s_per_byte,
            "iteration_overhead_s": self.iteration_overhead_s,
            **({"shard_bandwidth": self.shard_bandwidth} if self.shard_bandwidth else {}),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> Cluster:
        doc = check_kind(doc, "cluster")
        stages = doc.get("stages")
        if isinstance(stages, bool) or not isinstance(stages, int):
            raise ProfileError(f"cluster.stages must be a whole number, got {stages!r}")
        memory = doc.get("memory_bytes")
        if isinstance(memory, list):
            mem: int | tuple[int, ...] = tuple(
                _number({"memory_bytes": m}, "memory_bytes", f"cluster.memory_bytes[{i}]", integer=True)
                for i, m in enumerate(memory)
            )
        else:
            mem = _number(doc, "memory_bytes", "cluster", integer=True)
        return cls(
            stages=stages,
            memory_bytes=mem,
            swap_bandwidth=_number(doc, "swap_bandwidth", "cluster"),
            link_bandwidth=_number(doc, "link_bandwidth", "cluster"),
            link_latency_s=_number(doc, "link_latency_s", "cluster", default=0.0),
            shared_link=bool(doc.get("shared_link", False)),
            name=str(doc.get("name", "")),
            step_overhead_s=_number(doc, "step_overhead_s", "cluster", default=0.0),
            swap_overlaps=bool(doc.get("swap_overlaps", True)),
            update_s_per_byte=_number(doc, "update_s_per_byte", "cluster", default=0.0),
            copy_s_per_byte=_number(doc, "copy_s_per_byte", "cluster", default=0.0),
            iteration_overhead_s=_number(doc, "iteration_overhead_s", "cluster", default=0.0),
            shard_bandwidth=_number(doc, "shard_bandwidth", "cluster", default=0.0),
        )

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Cluster:
        return cls.from_dict(load_doc(text_or_path, "cluster"))
