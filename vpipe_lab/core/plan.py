"""Plans: a partition of the layers into stages, one memory policy per layer, a schedule and a micro-batch count;
and the cost model's estimate of a plan. Frozen and JSON round-trippable."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks, documents
from vpipe_lab.core.documents import sparse
from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.policy import Policy as Policy  # re-exported: a plan is read with its policies
from vpipe_lab.core.profile import SCHEMA_VERSION, check_kind, load_doc
from vpipe_lab.core.schedules import ScheduleKind, virtual_refusal
from vpipe_lab.core.schedules import get as _get_kind
from vpipe_lab.core.sharding import Sharding as Sharding  # re-exported: a plan is read with its stages' sharding

# A plan names its schedule; what the name means (placement, chunks, split backward, per-micro-batch updates, its
# order, checks and costs) is one object in the schedule registry (core/schedules/), which reads plans through a
# protocol of its own (``schedules.kind.PlanView``), so it never imports this module.
# The plans validate() passed in this process, each with the ScheduleKind object it was checked under (a schedule
# re-registered or removed since makes it unchecked). Another process checks again against its own registry.
_CHECKED: dict[tuple[Plan, int], ScheduleKind] = {}
_CHECKED_LOCK = threading.Lock()
# Every micro-batch's steps are laid out (the schedule IR, the CSV an export writes): a count past what any real job
# runs is a typo that would exhaust memory, so it is refused where a plan is read or made.
MAX_MICROBATCHES = 16384
AUTO = "auto"  # for the planner (``planner.search``, ``Session.replan``): choose the schedule too


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule called ``name`` (``core.schedules.get``); PlanError for an unknown one."""
    return _get_kind(name)


def _kind_or_none(name: str) -> ScheduleKind | None:
    try:
        return _get_kind(name)
    except PlanError:
        return None


def default_virtual_stages(schedule: str) -> int:
    """Chunks per stage when none is given: 2 under interleaved 1F1B (one would be plain 1F1B) and ZBV, else 1."""
    return schedule_kind(schedule).default_virtual


def placement(schedule: str, stages: int, chunks: int) -> tuple[int, ...]:
    """The stage of each chunk: a V under ZBV (down the stages and back up, ``schedules/orders/v_placement.py``), else
    looped (chunk ``c`` on stage ``c % stages``), which is one chunk per stage without virtual stages."""
    return tuple(schedule_kind(schedule).placement(stages, chunks))


@dataclass(frozen=True)
class Plan:
    """A partition of the layers into stages plus one memory policy per layer, for a schedule and micro-batch count.

    ``boundaries`` has ``stages + 1`` increasing entries from 0 to the number of layers; stage ``s`` owns layers
    ``boundaries[s]:boundaries[s+1]``. With ``virtual_stages`` V > 1 (the interleaved schedule) there are
    ``stages * V + 1`` boundaries, one chunk (virtual stage) between each two, and chunk ``c`` lives on stage
    ``placement[c]``: ``c % stages`` (looped) under interleaved 1F1B, a V under ZBV (V = 2: stage ``s`` holds chunks
    ``s`` and ``2 K - 1 - s``). A stage holds V chunks, ``layers_of`` their union.

    The devices: each stage runs on ``shards`` ranks that shard its parameters, gradients and optimizer state with
    FSDP2 (``sharding``: per stage, when they gather and reduce; ``core/sharding.py``), and the whole pipeline is
    copied ``replicas`` times; the batch is split over shards x replicas data-parallel ranks, so the job has
    ``stages x shards x replicas`` ranks (``devices``). One of each is a pipeline of whole devices.
    """

    boundaries: tuple[int, ...]
    policies: tuple[Policy, ...]
    microbatches: int
    schedule: str = "1f1b"
    virtual_stages: int = sparse(1)
    shards: int = 1
    replicas: int = 1
    sharding: tuple[Sharding, ...] = sparse(())  # one per stage when shards > 1 (empty: ``hold`` on every stage)

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "policies", tuple(Policy.parse(p) for p in self.policies))
        object.__setattr__(self, "sharding", tuple(Sharding.parse(m) for m in self.sharding))

    @property
    def devices(self) -> int:
        """The ranks the plan runs on: stages x shards x replicas."""
        return self.stages * self.shards * self.replicas

    @property
    def data_parallel(self) -> int:
        """The ranks the batch is split over: shards x replicas (each runs its share through its pipeline)."""
        return self.shards * self.replicas

    def sharding_of(self, stage: int) -> Sharding:
        """When ``stage`` gathers and reduces (``hold`` unless the plan says otherwise; meaningless at one shard)."""
        return self.sharding[stage] if self.sharding else Sharding.HOLD

    @property
    def stage_sharding(self) -> tuple[Sharding, ...]:
        """Every stage's ``sharding_of``, the default spelled out."""
        return tuple(self.sharding_of(s) for s in range(self.stages))

    def with_mesh(self, *, shards: int | None = None, replicas: int | None = None,
                  sharding: Sequence[Sharding | str] | None = None) -> Plan:
        """A copy on another mesh: ``shards`` per stage, ``replicas`` pipelines, each stage's ``sharding``."""
        shards = self.shards if shards is None else shards
        chosen = tuple(Sharding.parse(m) for m in sharding) if sharding is not None else self.sharding
        return dataclasses.replace(self, shards=shards, replicas=self.replicas if replicas is None else replicas,
                                   sharding=chosen if shards > 1 else ())

    @property
    def stages(self) -> int:
        """The pipeline's stages: its workers and devices (chunks / virtual_stages)."""
        return max(1, self.chunks // max(1, self.virtual_stages))

    @property
    def chunks(self) -> int:
        """Virtual stages in all: each a contiguous range of layers (``stages`` when there is one per stage)."""
        return len(self.boundaries) - 1

    def chunk_layers(self, chunk: int) -> range:
        return range(self.boundaries[chunk], self.boundaries[chunk + 1])

    @property
    def kind(self) -> ScheduleKind:
        """The plan's schedule as the registry has it (``core.schedules.ScheduleKind``)."""
        return schedule_kind(self.schedule)

    @property
    def placement(self) -> tuple[int, ...]:
        """The stage each chunk runs on (see the class docstring)."""
        return placement(self.schedule, self.stages, self.chunks)

    def chunk_stage(self, chunk: int) -> int:
        return self.placement[chunk]

    @property
    def loss_stage(self) -> int:
        """The stage that runs the last chunk and computes the loss (needs the targets): the last, or 0 under ZBV."""
        return self.placement[-1]

    def chunks_of(self, stage: int) -> tuple[int, ...]:
        """The chunks ``stage`` holds, in model order."""
        return tuple(c for c, s in enumerate(self.placement) if s == stage)

    def chunk_of(self, layer: int) -> int:
        for c in range(self.chunks):
            if self.boundaries[c] <= layer < self.boundaries[c + 1]:
                return c
        raise PlanError(f"layer {layer} is outside this plan's {self.num_layers} layers")

    @property
    def num_layers(self) -> int:
        return len(self.policies)

    @property
    def counts(self) -> tuple[int, ...]:
        """Layers per chunk (per stage when each stage holds one)."""
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    def layers_of(self, stage: int) -> Sequence[int]:
        """The layers ``stage`` holds: a range, or with virtual stages its chunks' layers in order."""
        if self.virtual_stages == 1:
            return self.chunk_layers(stage)
        return [i for c in self.chunks_of(stage) for i in self.chunk_layers(c)]

    def stage_of(self, layer: int) -> int:
        return self.placement[self.chunk_of(layer)]

    def validate(self, num_layers: int | None = None, stages: int | None = None) -> Plan:
        """Check the plan's shape; raise PlanError naming what is wrong and how to fix it. Returns self.

        A plan (any equal one) is checked once per number of layers and schedule as registered then: the preview,
        the cost model, the simulator and the live change path all ask, and only the first asking does the work."""
        n = self.num_layers if num_layers is None else num_layers
        key = (self, n)
        with _CHECKED_LOCK:
            done = _CHECKED.get(key)
        kind = _kind_or_none(self.schedule)
        if done is None or done is not kind:
            self._check(n)  # an unknown schedule (kind None) raises here
            assert kind is not None
            with _CHECKED_LOCK:
                _CHECKED[key] = kind
                while len(_CHECKED) > 512:  # the oldest checks go: a long session of drags makes many drafts
                    _CHECKED.pop(next(iter(_CHECKED)))
        if stages is not None and self.stages != stages:
            raise PlanError(f"the plan has {self.stages} stages but the pipeline has {stages}: give "
                            f"{stages * self.virtual_stages + 1} boundaries")
        return self

    def checked(self, num_layers: int | None = None) -> bool:
        """Whether ``validate`` passed this plan (or an equal one) for ``num_layers`` in this process, with the
        schedule registered as it is now."""
        key = (self, self.num_layers if num_layers is None else num_layers)
        with _CHECKED_LOCK:
            done = _CHECKED.get(key)
        return done is not None and done is _kind_or_none(self.schedule)

    def _check(self, n: int) -> None:
        b = self.boundaries
        if len(b) < 2:
            raise PlanError(f"boundaries {list(b)} must have stages + 1 >= 2 entries, e.g. [0, {self.num_layers}]")
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
        checks.count(self.virtual_stages, "virtual_stages", error=PlanError)
        v = self.virtual_stages
        if (len(b) - 1) % v:
            raise PlanError(f"boundaries {list(b)} give {len(b) - 1} chunks, which {v} virtual stages per stage do not "
                            f"divide: give stages x {v} + 1 boundaries")
        kind = schedule_kind(self.schedule)
        if problem := virtual_refusal(self.schedule, v):
            raise PlanError(f"{problem}: give a schedule and a virtual_stages that go together, and stages x "
                            "virtual_stages + 1 boundaries")
        checks.count(self.microbatches, "microbatches", error=PlanError, maximum=MAX_MICROBATCHES,
                     what="a schedule lays out every micro-batch's steps: more is a typo, not a batch")
        if problem := kind.check(self.stages, self.microbatches):
            raise PlanError(problem)
        self._check_mesh(kind)

    def _check_mesh(self, kind: ScheduleKind) -> None:
        checks.count(self.shards, "shards", error=PlanError, what="ranks sharding each stage (FSDP's degree)")
        checks.count(self.replicas, "replicas", error=PlanError, what="data-parallel copies of the pipeline")
        if self.sharding and self.shards == 1:
            raise PlanError(f"sharding {[m.value for m in self.sharding]} is for sharded stages, and this plan has "
                            "shards=1: give shards > 1, or no sharding")
        if self.sharding and len(self.sharding) != self.stages:
            raise PlanError(f"the plan has {len(self.sharding)} sharding entries for {self.stages} stages: give one "
                            "per stage ('hold', 'regather', 'scatter' or 'stream'), or none for 'hold' everywhere")
        if kind.asynchronous and self.shards > 1:
            raise PlanError(f"shards={self.shards} reduce each stage's gradients over its shards once per step; "
                            f"{self.schedule} steps after every micro-batch: use shards=1 or a synchronous schedule")

    def with_boundaries(self, boundaries: Sequence[int]) -> Plan:
        """A copy with other boundaries (the mesh kept; each stage's sharding too while the stage count is)."""
        same = len(boundaries) == len(self.boundaries)
        return dataclasses.replace(self, boundaries=tuple(boundaries), sharding=self.sharding if same else ())

    def with_policies(self, changes: Mapping[int, Policy | str] | Sequence[Policy | str]) -> Plan:
        """A copy with some policies changed: a mapping {layer: policy}, or a full sequence."""
        if isinstance(changes, Mapping):
            policies = list(self.policies)
            for layer, policy in changes.items():
                if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(policies):
                    raise PlanError(f"layer {layer!r} does not exist: layers are 0..{len(policies) - 1}")
                policies[layer] = Policy.parse(policy)
            return dataclasses.replace(self, policies=tuple(policies))
        return dataclasses.replace(self, policies=tuple(Policy.parse(p) for p in changes))

    def replace(self, *, microbatches: int | None = None, schedule: str | None = None) -> Plan:
        return dataclasses.replace(self, microbatches=self.microbatches if microbatches is None else microbatches,
                                   schedule=self.schedule if schedule is None else schedule)

    @classmethod
    def from_counts(
        cls, counts: Iterable[int], microbatches: int, schedule: str = "1f1b", policy: Policy | str = Policy.KEEP
    ) -> Plan:
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        return cls(tuple(bounds), (Policy.parse(policy),) * bounds[-1], microbatches, schedule)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "plan", "version": SCHEMA_VERSION, **documents.dump(self), "stages": self.stages}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> Plan:
        """A plan document read back: its fields checked (``core/documents.py``), then the plan's own rules, and the
        stage count it states against the one its boundaries give."""
        doc = check_kind(doc, "plan")
        plan = documents.load_fields(cls, doc, "plan", ProfileError, extra="ignore")
        try:
            plan.validate()
        except PlanError as exc:
            raise ProfileError(f"plan: {exc}") from None
        if "stages" in doc and doc["stages"] != plan.stages:
            raise ProfileError(f"plan: stages is {documents.short(doc['stages'])} but its boundaries give {plan.stages} "
                               "stages")
        return plan

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        return cls.from_dict(load_doc(text_or_path, "plan"))

    def describe(self) -> str:
        """One line: layers per stage and the non-keep policies."""
        parts = []
        for c in range(self.chunks):
            rng = self.chunk_layers(c)
            tags = "".join(p.value[0].upper() for p in self.policies[rng.start:rng.stop])
            parts.append(f"[{rng.start}:{rng.stop}]{tags}" + (f"@{self.placement[c]}" if self.virtual_stages > 1 else ""))
        virtual = f" V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        mesh = ""
        if self.shards > 1 or self.replicas > 1:
            mesh = f" {self.stages}x{self.shards}x{self.replicas}"
            if self.shards > 1:
                mesh += " " + "/".join(m.value for m in self.stage_sharding)
        return f"{self.schedule}{virtual}{mesh} M={self.microbatches} " + " ".join(parts)


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
        return documents.dump(self)  # type: ignore[no-any-return]
