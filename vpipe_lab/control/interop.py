"""A running session's plan taken out of the lab (an export bundle) and a production config brought in (a plan over
the session's units): what ``Session.export_plan`` and ``Session.import_plan`` do, and what the command line does
with a checkpoint or a saved plan instead of a session."""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

from vpipe_lab.core.costmodel import estimate
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop import megatron, torchtitan
from vpipe_lab.core.interop.bundle import Bundle, UnitInfo, make, plan_from_parts
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.wire import bundle as files
from vpipe_lab.wire.checkpoint import Manifest

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


def import_plan(source: Any, units: list[UnitInfo], current: Plan, *, ranks: int | None = None,
                batch_size: int | None = None, microbatches: int | None = None, schedule: str | None = None) -> Plan:
    """A production config as a plan over ``units``: a torchtitan TOML file or text, a torchtitan ``[parallelism]``
    dict, a Megatron-LM layout string (``"Et*3|t*4|t*3L"``), a list of module-name lists (one per torch stage), or an
    export bundle (its directory or ``pipeline.json``). Missing counts come from ``current`` (the running plan)."""
    m = microbatches
    text = None
    if isinstance(source, Path) or (isinstance(source, str) and Path(source).exists()):
        target = Path(source)
        if target.is_dir() or target.name == files.PIPELINE:
            return files.read(target).plan
        text = target.read_text()
        if target.suffix == ".toml":
            csv = _csv_next_to(text, target)
            return torchtitan.read_toml(text, units, batch_size=batch_size, microbatches=m, csv_text=csv)
        source = text.strip()
    if isinstance(source, dict):
        if batch_size is None and m is None:
            m = current.microbatches
        return torchtitan.read(source, units, batch_size=batch_size, microbatches=m)
    if isinstance(source, list):
        return plan_from_parts(source, units, microbatches=m or current.microbatches,
                               schedule=schedule or current.schedule, virtual_stages=len(source) // (ranks or current.stages),
                               where="the module lists")
    if isinstance(source, str):
        if "[parallelism]" in source:
            return torchtitan.read_toml(source, units, batch_size=batch_size, microbatches=m)
        return megatron.plan_from_layout(source, ranks or current.stages, units, microbatches=m or current.microbatches,
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
    return path.read_text()
