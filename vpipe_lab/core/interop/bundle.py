"""The export bundle's contract, ``pipeline.json``: a plan as torch.distributed.pipelining's stages over the user's
own module names, the schedule torch runs it with, and the lab's own plan for the way back.

A stage here is torch's (a chunk of the lab's plan): ``stage`` its index, ``rank`` the rank that runs it (looped or
V placement), ``modules`` the FQNs of the modules it holds in forward order (the outermost modules that run wholly
inside each of its partition units), ``split_at`` the module it begins with as a ``SplitPoint.BEGINNING`` (None for
the first), ``recompute`` and ``offload`` the modules whose activations are recomputed or kept in host memory, and
``tensors`` any parameter or buffer the stage's units use that no listed module owns (one held by a module that
spans several units, a ViT's class token say). ``schedule`` is the ``get_schedule_class`` name that runs exactly the
lab's order, or None; ``schedule_csv`` is that order, which always runs (``core/interop/torch_schedules.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks, documents
from vpipe_lab.core.documents import sparse
from vpipe_lab.core.errors import PlanError, ProfileError
from vpipe_lab.core.interop import torch_schedules
from vpipe_lab.core.plan import Plan, Policy

FORMAT = 1
KIND = "vpipe_lab-pipeline"
# The contract as a JSON Schema (draft 2020-12) shipped with the package: every field, its type, range and meaning.
# wire/bundle_files.py validates each pipeline.json it reads and writes against it; from_dict repeats the checks the lab
# itself relies on, so a reader without jsonschema is as safe.
SCHEMA_FILE = Path(__file__).with_name("pipeline.schema.json")


@dataclass(frozen=True)
class MoeInfo:
    """A mixture-of-experts layer inside a unit: its module's FQN, how many experts it has, how many each token
    goes to, and the tokens an expert takes at most (None: no capacity, nothing is dropped)."""

    module: str
    experts: int
    top_k: int = 1
    capacity: int | None = None

    def __post_init__(self) -> None:
        for key in ("experts", "top_k", "capacity"):
            value = getattr(self, key)
            if (value is not None or key == "experts") and (isinstance(value, bool) or not isinstance(value, int)
                                                            or value < 1):
                raise ProfileError(f"moe layer {self.module!r}: {key} must be a whole number >= 1, "
                                   f"got {documents.short(value)}")

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, doc: Any, where: str = "moe") -> MoeInfo:
        return documents.load_fields(cls, doc, where, ProfileError, extra="ignore")


@dataclass(frozen=True)
class UnitInfo:
    """One partition unit as the workers cut it: its name, the FQNs of its outermost modules in the user's model,
    its kind ("pre" before the repeated blocks, "block:<class>", "post" after them), the tensors it uses that
    none of its modules own, the mixture-of-experts layers it runs and the modules it runs eagerly (torch.export
    could not trace them: ``runtime/model/trace/eager.py``)."""

    name: str
    modules: tuple[str, ...] = ()
    kind: str = "block"
    tensors: tuple[str, ...] = ()
    moe: tuple[MoeInfo, ...] = sparse(())
    eager: tuple[str, ...] = sparse(())

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", tuple(self.modules))
        object.__setattr__(self, "tensors", tuple(self.tensors))
        object.__setattr__(self, "moe", tuple(self.moe))
        object.__setattr__(self, "eager", tuple(self.eager))

    @property
    def block_class(self) -> str | None:
        """The class of a repeated block ("GPT2Block"), None for what runs before or after the blocks."""
        return self.kind.partition(":")[2] or None if self.kind.startswith("block") else None

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, doc: Any, where: str = "unit") -> UnitInfo:
        return documents.load_fields(cls, doc, where, ProfileError, extra="ignore")


def _strings(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProfileError(f"{where} must be a list of strings, got {documents.short(value)}")
    return value


@dataclass(frozen=True)
class StageSpec:
    """One torch pipeline stage of the bundle (see the module docstring)."""

    stage: int
    rank: int
    split_at: str | None
    modules: tuple[str, ...]
    recompute: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    units: tuple[int, ...] = ()
    tensors: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return documents.dump(self)  # type: ignore[no-any-return]

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> StageSpec:
        return documents.load_fields(cls, doc, where, ProfileError, extra="ignore")


@dataclass(frozen=True)
class Bundle:
    """What ``pipeline.json`` says (see the module docstring); ``plan`` and ``units`` are the lab's own."""

    plan: Plan
    units: tuple[UnitInfo, ...]
    stages: tuple[StageSpec, ...]
    schedule: str | None
    microbatch_size: int | None = None
    schedule_csv: str = "schedule.csv"
    predicted_s: float | None = None
    measured_s: float | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    @property
    def ranks(self) -> int:
        return self.plan.stages

    @property
    def style(self) -> str:
        return torch_schedules.style(self.plan)

    def stages_of(self, rank: int) -> list[StageSpec]:
        """The stages ``rank`` runs, in stage order."""
        return [s for s in self.stages if s.rank == rank]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND, "format": FORMAT, "microbatches": self.microbatches, "microbatch_size": self.microbatch_size,
            "schedule": self.schedule, "schedule_csv": self.schedule_csv, "ranks": self.ranks,
            "placement": self.style, "stages": [s.to_dict() for s in self.stages],
            "vpipe_lab": {"schedule": self.plan.schedule, "plan": self.plan.to_dict(),
                          "units": [u.to_dict() for u in self.units], "predicted_s": self.predicted_s,
                          "measured_s": self.measured_s, "notes": list(self.notes)},
        }

    @classmethod
    def from_dict(cls, doc: Any) -> Bundle:
        """Read a ``pipeline.json`` document back, checked: the stages must be the lab plan's chunks."""
        if not isinstance(doc, Mapping) or doc.get("kind", KIND) != KIND:
            found = doc.get("kind") if isinstance(doc, Mapping) else type(doc).__name__
            raise ProfileError(f"not a vpipe_lab pipeline.json document (kind {documents.short(found)})")
        if doc.get("format") != FORMAT:
            raise ProfileError(f"pipeline.json format {documents.short(doc.get('format'))} is not supported: this "
                               f"vpipe_lab reads format {FORMAT}")
        lab = doc.get("vpipe_lab")
        if not isinstance(lab, Mapping):
            raise ProfileError("pipeline.json has no 'vpipe_lab' section: it was not written by vpipe_lab export")
        plan = Plan.from_dict(lab.get("plan"))
        units = tuple(UnitInfo.from_dict(u, f"vpipe_lab.units[{i}]")
                      for i, u in enumerate(_list(lab.get("units"), "vpipe_lab.units")))
        stages = tuple(StageSpec.from_dict(s, f"stages[{i}]") for i, s in enumerate(_list(doc.get("stages"), "stages")))
        size, schedule = doc.get("microbatch_size"), doc.get("schedule")
        checks.count(size, "microbatch_size", optional=True, error=ProfileError)
        if schedule is not None and not isinstance(schedule, str):
            raise ProfileError(f"schedule must be a torch schedule class name or null, got {documents.short(schedule)}")
        bundle = cls(plan, units, stages, schedule, size, csv_name(doc.get("schedule_csv", "schedule.csv")),
                     _float(lab.get("predicted_s")), _float(lab.get("measured_s")),
                     tuple(_strings(lab.get("notes", []), "vpipe_lab.notes")))
        expected = make(plan, units, microbatch_size=bundle.microbatch_size).stages
        if [(s.stage, s.rank, s.units) for s in stages] != [(s.stage, s.rank, s.units) for s in expected]:
            raise ProfileError("pipeline.json's stages do not match its plan: edit the plan, not the stages, or "
                               "export the bundle again")
        return bundle


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProfileError(f"{where} must be a list, got {documents.short(value)}")
    return value


def csv_name(value: Any) -> str:
    """``schedule_csv`` checked: a plain ``.csv`` file name, so it can only name a file inside the bundle."""
    if (not isinstance(value, str) or not value.endswith(".csv") or value.startswith(".") or "/" in value
            or "\\" in value or "\0" in value or len(value) > 132):
        raise ProfileError(f"schedule_csv must be a plain file name ending in .csv inside the bundle directory, "
                           f"got {documents.short(value)}")
    return value


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def check_units(units: Sequence[UnitInfo], plan: Plan) -> None:
    """Every unit must be named by modules of its own, and there must be one per layer of the plan."""
    if len(units) != plan.num_layers:
        raise PlanError(f"the plan has {plan.num_layers} layers but the model {len(units)} partition units")
    bare = [u.name for u in units if not u.modules]
    if bare:
        raise PlanError(f"units {bare[:3]} run no module of their own (glue code only), so no module name can say where "
                        "they go: capture the model with other split points (launch(split=[...]))")
    calls = [m for u in units for m in u.modules if "@" in m]
    if calls:
        raise PlanError(f"the model calls one module several times and the lab cut it between those calls ({calls[0]}: "
                        "a later call of a shared module): torch.distributed.pipelining, torchtitan and Megatron-LM "
                        "split at modules, not at calls, so this partition cannot be exported")


def make(plan: Plan, units: Sequence[UnitInfo], *, microbatch_size: int | None = None,
         predicted_s: float | None = None, measured_s: float | None = None) -> Bundle:
    """The bundle of ``plan`` over ``units``: one torch stage per chunk (PlanError if torch cannot run the schedule
    or a unit has no module to name it by)."""
    units = tuple(units)
    check_units(units, plan)
    name = torch_schedules.torch_name(plan)  # refuses PipeDream with the reason
    ranks = torch_schedules.rank_of_stage(plan)
    stages = []
    for c in range(plan.chunks):
        layers = list(plan.chunk_layers(c))
        modules = [m for i in layers for m in units[i].modules]
        stages.append(StageSpec(
            c, ranks[c], None if c == 0 else units[layers[0]].modules[0], tuple(modules),
            tuple(m for i in layers if plan.policies[i] is Policy.RECOMPUTE for m in units[i].modules),
            tuple(m for i in layers if plan.policies[i] is Policy.SWAP for m in units[i].modules),
            tuple(layers), tuple(t for i in layers for t in units[i].tensors)))
    return Bundle(plan, units, tuple(stages), name, microbatch_size, predicted_s=predicted_s, measured_s=measured_s,
                  notes=tuple(notes(plan, name)))


def notes(plan: Plan, name: str | None) -> list[str]:
    """What a reader of the bundle should know about running it elsewhere."""
    found = torch_schedules.torch_schedule(plan)
    out = []
    if name is None:
        out.append(f"No torch schedule class runs exactly this {plan.schedule} order ({found.note}): run the CSV "
                   f"with _PipelineScheduleRuntime; torch's closest class is {found.name}.")
    if any(p is Policy.SWAP for p in plan.policies):
        out.append("Offloaded modules keep their saved activations in host memory "
                   "(torch.autograd.graph.save_on_cpu) between their forward and backward.")
    return out


def plan_from_parts(parts: Sequence[Sequence[str]], units: Sequence[UnitInfo], *, microbatches: int,
                    schedule: str, virtual_stages: int = 1, policies: Sequence[Policy] | None = None,
                    where: str = "module_fqns_per_model_part") -> Plan:
    """A plan whose chunk ``i`` holds the units named by ``parts[i]`` (module FQNs, as torchtitan's
    ``module_fqns_per_model_part`` lists them): a unit goes to the part that names each of its modules or a module
    above them; PlanError names a unit split between parts, a part out of order and a name no unit runs."""
    if not parts or any(not part for part in parts):
        raise PlanError(f"{where} must be a non-empty list of non-empty lists of module names, got {parts!r}")

    def covers(name: str, module: str) -> bool:
        return module == name or module.startswith(name + ".")

    owner: list[int] = []
    for i, unit in enumerate(units):
        if not unit.modules:
            raise PlanError(f"unit {i} ({unit.name}) runs no module of its own, so {where} cannot place it")
        found = {p for p, part in enumerate(parts) for m in unit.modules if any(covers(n, m) for n in part)}
        homes = {p for p in found if all(any(covers(n, m) for n in parts[p]) for m in unit.modules)}
        if not found:
            raise PlanError(f"no part of {where} names unit {i} ({', '.join(unit.modules)}): every module of the "
                            "model must be in one part")
        if len(homes) != 1:
            raise PlanError(f"{where} splits unit {i} ({unit.name}: {', '.join(unit.modules)}) between parts "
                            f"{sorted(found)}: the lab cuts the model only between its units; capture it with "
                            "split points at those modules (launch(split=[...]))")
        owner.append(homes.pop())
    named = {n for part in parts for n in part}
    used = {n for part in parts for n in part for u in units for m in u.modules if covers(n, m) or covers(m, n)}
    if named - used:
        raise PlanError(f"{where} names {sorted(named - used)[:5]}, which no partition unit runs; the units are "
                        f"{', '.join(u.name for u in units)}")
    if owner != sorted(owner) or sorted(set(owner)) != list(range(len(parts))):
        raise PlanError(f"{where}'s parts must hold consecutive units in model order, each at least one; they hold "
                        f"units {[[i for i, p in enumerate(owner) if p == q] for q in range(len(parts))]}")
    bounds = [0] + [owner.index(p + 1) for p in range(len(parts) - 1)] + [len(units)]
    plan = Plan(tuple(bounds), tuple(policies) if policies is not None else (Policy.KEEP,) * len(units),
                microbatches, schedule, virtual_stages)
    return plan.validate(len(units))
