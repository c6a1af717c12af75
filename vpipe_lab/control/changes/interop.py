"""A running session's plan taken out of the lab (an export bundle) and a production config brought in (a plan over
the session's units): what ``Session.export_plan`` and ``Session.import_plan`` do, and what the command line does
with a checkpoint or a saved plan instead of a session."""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import megatron, torchtitan
from vpipe_lab.core.interop.bundle import Bundle, UnitInfo, make, plan_from_parts
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.layer_moves import LayerMove
from vpipe_lab.core.planning.mesh import search_sharded
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.report import human_time
from vpipe_lab.wire import bundle_files as files
from vpipe_lab.wire import small_file
from vpipe_lab.wire.checkpoint_format import Manifest

log = logging.getLogger(__name__)


def measured_s(records: list[dict[str, Any]], plan_version: int, last: int = 20) -> float | None:
    """The median time of the newest iterations that ran under ``plan_version`` (None before any did)."""
    times = [r["time_s"] for r in records if r.get("plan_version") == plan_version and r.get("time_s")][-last:]
    return statistics.median(times) if times else None


def bundle_of(plan: Plan, units: list[UnitInfo], *, microbatch_size: int | None = None,
              profile: ModelProfile | None = None, cluster: Cluster | None = None,
              measured: float | None = None) -> Bundle:
    """The export bundle of ``plan`` over ``units`` with what the lab measured and predicts for it."""
    predicted = None
    if profile is not None and cluster is not None:
        try:
            predicted = estimate(plan, profile, cluster).iteration_s
        except Exception as exc:  # a profile of another shape (a changed model): the bundle is still right
            log.info("no prediction for the exported plan: %s", exc)
    return make(plan, units, microbatch_size=microbatch_size or None, predicted_s=predicted, measured_s=measured)


def microbatch_size_of(path: str | Path) -> int | None:
    """The samples per micro-batch the job that wrote the checkpoint at ``path`` ran with (None: not recorded)."""
    size = Manifest.read(path).extra.get("microbatch_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def from_checkpoint(path: str | Path) -> tuple[Plan, list[UnitInfo]]:
    """The plan and units a checkpoint the lab wrote holds (its manifest)."""
    manifest = Manifest.read(path)
    plan = Plan.from_dict(manifest.plan)
    if not manifest.units:
        raise PlanError(f"checkpoint {path} was written before checkpoints recorded the model's module names: export "
                        "from a running session (launch(..., resume=path) and session.export_plan(...))")
    return plan, [UnitInfo.from_dict(u, f"unit {i}") for i, u in enumerate(manifest.units)]


def write(path: str | Path, bundle: Bundle) -> Path:
    return files.write(path, bundle)


@dataclass(frozen=True)
class Comparison:
    """An imported plan against what the lab would run instead: both predicted iteration times and the moves."""

    imported: Plan
    imported_s: float
    lab: Plan
    lab_s: float
    moves: tuple[LayerMove, ...]

    @property
    def gain(self) -> float:
        """The share of the imported plan's iteration time the lab's plan saves."""
        return 1.0 - self.lab_s / self.imported_s if self.imported_s > 0 else 0.0

    def describe(self) -> str:
        if self.lab == self.imported:
            return f"the lab would keep this plan ({human_time(self.imported_s)} per iteration predicted)"
        return (f"predicted {human_time(self.imported_s)} per iteration; the lab's plan {self.lab.describe()} "
                f"{human_time(self.lab_s)} ({self.gain:+.1%} faster), {len(self.moves)} layer move(s)")


def compare(imported: Plan, profile: ModelProfile, cluster: Cluster, method: str = "vpipe") -> Comparison:
    """What the lab's planner would change about ``imported`` (same schedule and micro-batches) and by how much."""
    found = search_sharded(profile, cluster, microbatches=imported.microbatches, schedule=imported.schedule,
                           method=method, current=imported, virtual_stages=imported.virtual_stages,
                           shards=imported.shards, replicas=imported.replicas)  # on the mesh it was made for
    now = estimate(imported, profile, cluster).iteration_s
    better = found.estimate.iteration_s < now
    return Comparison(imported, now, found.plan if better else imported, found.estimate.iteration_s if better else now,
                      found.moves if better else ())


def import_plan(source: Any, of: Any, **kw: Any) -> Plan:
    """A production config as a plan over a model's partition units: ``source`` is a torchtitan TOML file or text, a
    torchtitan ``[parallelism]`` dict, a Megatron-LM layout string (``"Et*3|t*4|t*3L"``), lists of module names (one
    per torch stage) or an export bundle; ``of`` says whose units: a ``Session``, a checkpoint the lab wrote, an
    export bundle or a list of ``UnitInfo``. Keywords: ``ranks``, ``batch_size``, ``microbatches``, ``schedule``
    (what the source leaves open)."""
    units, current = _units_of(of)
    return read(source, units, current, **kw)


def _units_of(of: Any) -> tuple[list[UnitInfo], Plan | None]:
    if isinstance(of, list):
        return of, None
    if hasattr(of, "_state") and hasattr(of, "plan"):  # a Session (control may not import it: it imports us)
        return list(of._state.unit_info), of.plan
    target = Path(of)
    if (target / files.PIPELINE).exists() or target.name == files.PIPELINE:
        found = files.read(target)
        return list(found.units), found.plan
    plan, units = from_checkpoint(target)
    return units, plan


def _is_path(source: Any) -> bool:
    """Whether ``source`` names a file: TOML or layout text is not a path (a long one is not even a valid name)."""
    if isinstance(source, Path):
        return True
    if not isinstance(source, str) or "\n" in source or "\0" in source:
        return False
    try:
        return Path(source).exists()
    except (OSError, ValueError):  # a name too long for the file system
        return False


def _given(value: int | None, current_value: int | None, what: str, name: str, option: str) -> int:
    """``value`` if given, else the running plan's, else refused naming the option (never a silent default)."""
    if value is not None:
        return value
    if current_value is not None:
        return current_value
    raise PlanError(f"the {what} does not say {name}: give {option} (there is no running plan to take it from)")


def read(source: Any, units: list[UnitInfo], current: Plan | None, *, ranks: int | None = None,
         batch_size: int | None = None, microbatches: int | None = None, schedule: str | None = None) -> Plan:
    """``import_plan`` over known ``units``. What the source leaves open comes from the keywords, else from
    ``current`` (the running plan); with neither it is refused naming the keyword, never defaulted."""
    if _is_path(source):
        target = Path(source)
        if target.is_dir() or target.name == files.PIPELINE:
            return files.read(target).plan
        text = _small(target, "the plan to import")
        if target.suffix == ".toml":
            csv = _csv_next_to(text, target)
            return torchtitan.read_toml(text, units, batch_size=batch_size, microbatches=microbatches, csv_text=csv)
        source = text.strip()
    m_now = current.microbatches if current is not None else None
    ranks_now = current.stages if current is not None else None
    m_said, ranks_said = "the number of micro-batches", "how many ranks run its stages"
    if isinstance(source, dict):
        if batch_size is None:
            microbatches = _given(microbatches, m_now, "[parallelism] table", m_said,
                                  "microbatches= (--microbatches) or batch_size= (--batch-size)")
        return torchtitan.read(source, units, batch_size=batch_size, microbatches=microbatches)
    if isinstance(source, list):
        what = "list of modules per stage"
        stages = _given(ranks, ranks_now, what, ranks_said, "ranks= (--ranks)")
        return plan_from_parts(source, units,
                               microbatches=_given(microbatches, m_now, what, m_said, "microbatches= (--microbatches)"),
                               schedule=schedule or (current.schedule if current is not None else "1f1b"),
                               virtual_stages=max(1, len(source) // stages), where="the module lists")
    if isinstance(source, str):
        if "[parallelism]" in source:
            return torchtitan.read_toml(source, units, batch_size=batch_size, microbatches=microbatches)
        what = "Megatron-LM layout"
        return megatron.plan_from_layout(
            source, _given(ranks, ranks_now, what, ranks_said, "ranks= (--ranks)"), units,
            microbatches=_given(microbatches, m_now, what, m_said, "microbatches= (--microbatches)"),
            schedule=schedule)
    raise PlanError(f"cannot import {type(source).__name__}: give a torchtitan TOML path or text, a [parallelism] "
                    "dict, a Megatron-LM layout string, lists of module names per stage or an export bundle")


def _csv_next_to(text: str, toml: Path) -> str | None:
    """The schedule CSV a torchtitan TOML names, read from where it says (relative: beside the TOML)."""
    import tomllib

    try:
        name = (tomllib.loads(text).get("parallelism") or {}).get("pipeline_parallel_schedule_csv")
    except tomllib.TOMLDecodeError:
        return None
    if not name:
        return None
    path = Path(name) if Path(name).is_absolute() else toml.parent / name
    if not path.exists():
        raise PlanError(f"{toml} names the schedule CSV {name}, which does not exist")
    return _small(path, "the schedule CSV")


def _small(path: Path, what: str) -> str:
    """A file to import, bounded (``wire/small_file.py``): refused in one line if it is not a small regular file."""
    try:
        return small_file.read_text(path, what)
    except small_file.TooLarge as exc:
        raise PlanError(str(exc)) from None
    except UnicodeDecodeError:
        raise PlanError(f"{what} {str(path)[:200]!r} is not UTF-8 text") from None
