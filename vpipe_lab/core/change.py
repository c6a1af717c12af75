"""A live change: one typed edit of the running plan, whichever door it came in by (editor, magic, API, planner)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vpipe_lab.core import checks
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan, placement, schedule_kind
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.policy import Policy
from vpipe_lab.core.sharding import Sharding

# who asked: shown in the session's record (``session.history``); "auto" is the auto-replanner, "revert" a return to
# an earlier plan of the record
SOURCES = ("api", "editor", "magic", "planner", "cli", "auto", "revert")


@dataclass(frozen=True)
class Change:
    """What to change in the plan in force; fields left None keep what runs.

    ``boundaries`` replaces the partition (stages x virtual stages + 1 entries); ``policies`` sets some layers'
    policies (``{layer: policy}``; a full sequence from the editor is read as every layer's); ``microbatches``,
    ``schedule`` and ``virtual_stages`` replace theirs. ``Change.to(plan)`` replaces the whole plan. ``on(current)``
    is the plan the change asks for; ``resolve`` also checks it, once, against the running job's layers and stages.
    The same value comes from the editor's message, ``%vpipe partition``/``policy``/``apply`` and
    ``Session.apply``/``set_partition``/``set_policy``, and goes to ``Session.change``.

    ``sharding`` sets each stage's (a sharded job's: when its shards gather and reduce, ``core/sharding.py``).
    ``mesh`` (shards, replicas) is the mesh a whole plan was made for; the running job's mesh is its processes, so a
    plan for another one is refused (save, then launch on the new mesh with ``resume=``); a plan that says nothing
    of its mesh (one shard, one replica) runs on the job's.
    """

    boundaries: tuple[int, ...] | None = None
    policies: tuple[tuple[int, Policy], ...] = ()
    microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    source: str = field(default="api", compare=False)
    sharding: tuple[Sharding, ...] | None = None
    mesh: tuple[int, int] | None = None
    # what the door showed the user for the plan asked for (the editor's what-if), recorded as the change's
    # prediction so the record compares the run with the very number the user acted on; None: the session computes
    # it the same way (``Live.predicted_s``)
    predicted_s: float | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise PlanError(f"a change's source is one of {', '.join(SOURCES)}, not {self.source!r}")
        if self.boundaries is not None:
            bounds = tuple(self.boundaries)
            if not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds):
                raise PlanError(f"boundaries {list(bounds)} must be whole numbers, e.g. [0, 3, 8]")
            object.__setattr__(self, "boundaries", bounds)
        seen: dict[int, Policy] = {}
        for layer, policy in self.policies:
            if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
                raise PlanError(f"layer {layer!r} is not a layer index: give whole numbers from 0")
            seen[layer] = Policy.parse(policy)
        object.__setattr__(self, "policies", tuple(sorted(seen.items())))
        checks.count(self.microbatches, "microbatches", optional=True, error=PlanError)
        checks.count(self.virtual_stages, "virtual_stages", optional=True, error=PlanError)
        if self.predicted_s is not None and not (isinstance(self.predicted_s, (int, float))
                                                 and 0 < float(self.predicted_s) < float("inf")):
            raise PlanError(f"predicted_s must be a positive number of seconds, not {self.predicted_s!r}")
        if self.schedule is not None and not isinstance(self.schedule, str):
            raise PlanError(f"schedule must be a schedule's name, not {self.schedule!r}")
        if self.sharding is not None:
            if isinstance(self.sharding, (str, bytes)):
                raise PlanError(f"sharding {self.sharding!r} must be one entry per stage, not a string")
            object.__setattr__(self, "sharding", tuple(Sharding.parse(m) for m in self.sharding))

    @classmethod
    def of(cls, *, boundaries: Sequence[int] | None = None,
           policies: Mapping[int, Policy | str] | Sequence[Policy | str] | None = None,
           microbatches: int | None = None, schedule: str | None = None, virtual_stages: int | None = None,
           source: str = "api", sharding: Sequence[Sharding | str] | None = None) -> Change:
        """Build a change from what a caller has: ``policies`` as ``{layer: policy}`` or one per layer."""
        if policies is None:
            pairs: tuple[tuple[int, Any], ...] = ()
        elif isinstance(policies, Mapping):
            pairs = tuple(policies.items())
        elif isinstance(policies, (str, bytes)):
            raise PlanError(f"policies {policies!r} must be {{layer: policy}} or one policy per layer, not a string")
        else:
            pairs = tuple(enumerate(policies))
        return cls(None if boundaries is None else tuple(boundaries), pairs, microbatches, schedule, virtual_stages,
                   source, _sharding(sharding))

    @classmethod
    def to(cls, plan: Plan, source: str = "api") -> Change:
        """Run ``plan`` as it is: every field replaced (its mesh checked against the job's, when it names one)."""
        named = plan.shards != 1 or plan.replicas != 1
        return cls(plan.boundaries, tuple(enumerate(plan.policies)), plan.microbatches, plan.schedule,
                   plan.virtual_stages, source, plan.sharding if plan.sharding else None,
                   (plan.shards, plan.replicas) if named else None)

    @property
    def empty(self) -> bool:
        return (self.boundaries is None and not self.policies and self.microbatches is None and self.schedule is None
                and self.virtual_stages is None and self.sharding is None)

    def on(self, current: Plan) -> Plan:
        """The plan this change asks for, starting from ``current`` (not yet checked: see ``resolve``).

        A new schedule without ``virtual_stages`` keeps the chunks per stage it accepts (else takes its default);
        without ``boundaries`` it keeps the partition when the chunks and their placement stay as they are, and
        otherwise cuts the layers evenly into the new chunks (to be dragged from there)."""
        policies = list(current.policies)
        for layer, policy in self.policies:
            if layer >= len(policies):
                raise PlanError(f"layer {layer} does not exist: the model has layers 0..{len(policies) - 1}")
            policies[layer] = policy
        schedule = current.schedule if self.schedule is None else self.schedule
        virtual = self.virtual_stages
        if virtual is None:
            kind = schedule_kind(schedule)
            keeps = kind.chunked == current.kind.chunked and kind.check_virtual(current.virtual_stages) is None
            virtual = current.virtual_stages if keeps else kind.default_virtual
        boundaries = self.boundaries
        if boundaries is None:
            same = (virtual == current.virtual_stages and
                    placement(schedule, current.stages, current.stages * virtual) == current.placement)
            boundaries = current.boundaries if same else uniform(current.num_layers, current.stages * virtual)
        if self.mesh is not None and self.mesh != (current.shards, current.replicas):
            raise PlanError(f"the plan is for {self.mesh[0]} shard(s) x {self.mesh[1]} replica(s) of each stage, and "
                            f"the job runs {current.shards} x {current.replicas}: its processes are its mesh, so a new "
                            "one needs a restart: session.save(path), then launch(..., shards=N, replicas=R, "
                            "resume=path)")
        sharding = self.sharding if self.sharding is not None else current.sharding
        if current.shards == 1 and sharding:
            raise PlanError("sharding is for a job whose stages are sharded: this job runs shards=1 (launch with "
                            "shards=N to shard each stage over N ranks)")
        if self.sharding is None and len(boundaries) != len(current.boundaries):
            sharding = ()  # another stage count: each stage's sharding starts at the default again
        return Plan(boundaries, tuple(policies), current.microbatches if self.microbatches is None else
                    self.microbatches, schedule, virtual, current.shards, current.replicas, sharding)

    def resolve(self, current: Plan, layers: int, stages: int) -> Plan:
        """The plan this change asks for, checked against a job of ``layers`` units on ``stages`` workers."""
        return self.on(current).validate(layers, stages)

    def describe(self) -> str:
        """One line, e.g. ``boundaries [0, 3, 8]; layer 3 swap; M=8`` (``no change`` for an empty one)."""
        parts = []
        if self.boundaries is not None:
            parts.append(f"boundaries {list(self.boundaries)}")
        if self.policies:
            parts.append(", ".join(f"layer {i} {p.value}" for i, p in self.policies))
        if self.schedule is not None:
            parts.append(f"schedule {self.schedule}")
        if self.virtual_stages is not None:
            parts.append(f"V={self.virtual_stages}")
        if self.microbatches is not None:
            parts.append(f"M={self.microbatches}")
        if self.sharding is not None:
            parts.append("sharding " + "/".join(m.value for m in self.sharding))
        return "; ".join(parts) or "no change"


def _sharding(value: Any) -> tuple[Sharding, ...] | None:
    """Each stage's sharding as a change takes it (a string is passed on whole, for ``Change`` to refuse)."""
    if value is None or isinstance(value, (str, bytes)):
        return value  # type: ignore[return-value]
    return tuple(Sharding.parse(m) for m in value)


@dataclass(frozen=True)
class Applied:
    """What a live change did: the plan in force from ``iteration`` as plan version ``version``, the layers it
    moved between stages, the bytes they took, and how long training paused for it."""

    plan: Plan
    version: int
    iteration: int
    moves: int = 0
    moved_bytes: int = 0
    pause_s: float = 0.0
    source: str = "api"  # a Change's source; "launch"/"attach" for the plan a session began with, "restart" for a
    # re-plan onto the stages left after one could not come back
    predicted_s: float | None = None  # its simulated iteration time when applied (None: no profile measured yet)
    unchanged: bool = False  # the plan asked for is the one in force: nothing was sent, no version made

    def describe(self) -> str:
        if self.unchanged:
            return f"plan v{self.version} is already in force: nothing changed"
        moved = f" ({self.moves} layer(s) moved)" if self.moves else ""
        return f"plan v{self.version} applied at iteration {self.iteration}{moved}"
