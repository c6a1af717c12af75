"""Plans: a partition of the layers into stages, one memory policy per layer, a schedule and a micro-batch count;
and the cost model's estimate of a plan. Frozen and JSON round-trippable."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks
from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.profile import SCHEMA_VERSION, check_kind, load_doc

# The one list of schedule names: planners, launch(), the CLI and the magics read it. "eager-1f1b" is 1F1B with one
# more warm-up forward on every stage but the last, so each stage's next activation is already on its way while its
# neighbour computes: the transfers' latency leaves the critical path, for one more micro-batch of activations held
# on those stages (core/schedule.py, core/costmodel.py).
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")


class Policy(StrEnum):
    """Where a layer's saved activations live between its forward and its backward."""

    KEEP = "keep"
    SWAP = "swap"
    RECOMPUTE = "recompute"

    @classmethod
    def parse(cls, value: Any) -> Policy:
        """Accept a Policy, its value or a unique prefix ("k", "s", "r"), case-insensitive."""
        if isinstance(value, Policy):
            return value
        text = str(value).strip().lower()
        matches = [p for p in cls if p.value.startswith(text)] if text else []
        if len(matches) != 1:
            raise PlanError(f"unknown policy {value!r}: use one of 'keep', 'swap', 'recompute'")
        return matches[0]

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Plan:
    """A partition of the layers into stages plus one memory policy per layer, for a schedule and micro-batch count.

    ``boundaries`` has ``stages + 1`` increasing entries from 0 to the number of layers; stage ``s`` owns layers
    ``boundaries[s]:boundaries[s+1]``.
    """

    boundaries: tuple[int, ...]
    policies: tuple[Policy, ...]
    microbatches: int
    schedule: str = "1f1b"

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "policies", tuple(Policy.parse(p) for p in self.policies))

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return len(self.policies)

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per stage."""
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    def layers_of(self, stage: int) -> range:
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    def stage_of(self, layer: int) -> int:
        for s in range(self.stages):
            if self.boundaries[s] <= layer < self.boundaries[s + 1]:
                return s
        raise PlanError(f"layer {layer} is outside this plan's {self.num_layers} layers")

    def validate(self, num_layers: int | None = None, stages: int | None = None) -> Plan:
        """Check the plan's shape; raise PlanError naming what is wrong and how to fix it. Returns self."""
        b = self.boundaries
        if len(b) < 2:
            raise PlanError(f"boundaries {list(b)} must have stages + 1 >= 2 entries, e.g. [0, {self.num_layers}]")
        n = self.num_layers if num_layers is None else num_layers
        if len(self.policies) != n:
            raise PlanError(f"the plan has {len(self.policies)} policies for {n} layers: give one policy per layer")
        if b[0] != 0 or b[-1] != n:
            raise PlanError(f"boundaries {list(b)} must start at 0 and end at the number of layers ({n})")
        for s in range(len(b) - 1):
            if b[s + 1] <= b[s]:
                raise PlanError(
                    f"boundaries {list(b)} give stage {s} no layers ({b[s]}..{b[s + 1]}): "
                    "boundaries must be strictly increasing so every stage owns at least one layer"
                )
        if stages is not None and self.stages != stages:
            raise PlanError(f"the plan has {self.stages} stages but the pipeline has {stages}: give {stages + 1} boundaries")
        checks.count(self.microbatches, "microbatches", error=PlanError)
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}: use one of {', '.join(SCHEDULES)}")
        return self

    def with_boundaries(self, boundaries: Sequence[int]) -> Plan:
        return Plan(tuple(boundaries), self.policies, self.microbatches, self.schedule)

    def with_policies(self, changes: Mapping[int, Policy | str] | Sequence[Policy | str]) -> Plan:
        """A copy with some policies changed: a mapping {layer: policy}, or a full sequence."""
        if isinstance(changes, Mapping):
            policies = list(self.policies)
            for layer, policy in changes.items():
                if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(policies):
                    raise PlanError(f"layer {layer!r} does not exist: layers are 0..{len(policies) - 1}")
                policies[layer] = Policy.parse(policy)
            return Plan(self.boundaries, tuple(policies), self.microbatches, self.schedule)
        return Plan(self.boundaries, tuple(Policy.parse(p) for p in changes), self.microbatches, self.schedule)

    def replace(self, *, microbatches: int | None = None, schedule: str | None = None) -> Plan:
        return Plan(
            self.boundaries, self.policies,
            self.microbatches if microbatches is None else microbatches,
            self.schedule if schedule is None else schedule,
        )

    @classmethod
    def from_counts(
        cls, counts: Iterable[int], microbatches: int, schedule: str = "1f1b", policy: Policy | str = Policy.KEEP
    ) -> Plan:
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        return cls(tuple(bounds), (Policy.parse(policy),) * bounds[-1], microbatches, schedule)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "plan",
            "version": SCHEMA_VERSION,
            "boundaries": list(self.boundaries),
            "policies": [p.value for p in self.policies],
            "microbatches": self.microbatches,
            "schedule": self.schedule,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> Plan:
        doc = check_kind(doc, "plan")
        for key in ("boundaries", "policies", "microbatches"):
            if key not in doc:
                raise ProfileError(f"plan.{key} is missing")
        bounds, policies = doc["boundaries"], doc["policies"]
        if not isinstance(bounds, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
            raise ProfileError(f"plan.boundaries must be a list of whole numbers, got {bounds!r}")
        if not isinstance(policies, list):
            raise ProfileError(f"plan.policies must be a list of 'keep'/'swap'/'recompute', got {policies!r}")
        try:
            plan = cls(tuple(bounds), tuple(Policy.parse(p) for p in policies), doc["microbatches"],
                       str(doc.get("schedule", "1f1b")))
        except PlanError as exc:
            raise ProfileError(f"plan: {exc}") from None
        try:
            return plan.validate()
        except PlanError as exc:
            raise ProfileError(f"plan: {exc}") from None

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        return cls.from_dict(load_doc(text_or_path, "plan"))

    def describe(self) -> str:
        """One line: layers per stage and the non-keep policies."""
        parts = []
        for s in range(self.stages):
            rng = self.layers_of(s)
            tags = "".join(p.value[0].upper() for p in self.policies[rng.start:rng.stop])
            parts.append(f"[{rng.start}:{rng.stop}]{tags}")
        return f"{self.schedule} M={self.microbatches} " + " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """The cost model's verdict on a plan: iteration time, per-stage time per micro-batch and peak memory."""

    iteration_s: float
    stage_s: tuple[float, ...]
    peak_bytes: tuple[int, ...]
    budget_bytes: tuple[int, ...]
    bubble_fraction: float
    feasible: bool
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    recompute_s: tuple[float, ...] = ()
    swap_exposed_s: tuple[float, ...] = ()
    comm_s: tuple[float, ...] = ()
    static_bytes: tuple[int, ...] = ()
    activation_bytes: tuple[int, ...] = ()
    host_bytes: tuple[int, ...] = ()
    inflight: tuple[int, ...] = ()

    @property
    def bottleneck(self) -> int:
        return max(range(len(self.stage_s)), key=lambda s: self.stage_s[s])

    @property
    def over_budget(self) -> tuple[int, ...]:
        """Bytes over budget per stage (0 where it fits)."""
        return tuple(max(0, p - b) for p, b in zip(self.peak_bytes, self.budget_bytes))

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}
