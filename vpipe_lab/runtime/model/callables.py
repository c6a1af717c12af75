"""The worker's view of the job: the spec, and the user's callables rebuilt from the controller's file."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cloudpickle

from vpipe_lab import examples
from vpipe_lab.core import schedules
from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire.jobspec import JobSpec

__all__ = ["Callables", "agreed_plan", "load_callables", "load_data", "register_schedules"]


@dataclass
class Callables:
    model: Any
    data: Any
    loss: Any
    optimizer: Any
    split: Any = None  # split points: module names or a function (name, module) -> bool
    lr_scheduler: Any = None  # optimizer -> scheduler
    eval_data: Any = None  # like data: what periodic evaluation reads


def load_callables(spec: JobSpec) -> Callables:
    """User callables from the pickle the controller wrote (a local file, never a socket), else the bundled ones."""
    user: dict[str, Any] = {}
    if spec.callables_path:
        with open(Path(spec.callables_path), "rb") as fh:
            user = cloudpickle.load(fh)
    for kind in user.get("schedules", ()):  # schedules the controller's process registered (core/schedules/)
        schedules.register(kind)
    found: dict[str, Any] = {}
    for role in ("model", "data", "loss", "optimizer", "lr_scheduler", "eval_data", "split"):
        if role in user and user[role] is not None:
            found[role] = user[role]
        elif role in spec.imports:
            module, _, attr = spec.imports[role].partition(":")
            try:
                found[role] = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"cannot load the {role} {spec.imports[role]!r}: {exc}; it must be importable on "
                                 "every node (same package, same PYTHONPATH)") from None
        elif role in spec.examples:
            found[role] = getattr(examples.get(spec.examples[role]), "data" if role == "eval_data" else role)
        else:
            found[role] = spec.split if role == "split" else None  # module names given on a command line
    if found["model"] is not None and "model" in spec.examples:  # a bundled model brings its own parts
        bundled = examples.get(spec.examples["model"])
        for role in ("data", "loss", "optimizer"):
            if found[role] is None:
                found[role] = getattr(bundled, role)
    if found["model"] is None or found["data"] is None:
        raise ValueError("the job has no model or no data function: give both, or a bundled example name")
    return Callables(**found)


def register_schedules(path: str | None, within: Path | None) -> None:
    """Register the schedule kinds the controller pickled into ``path`` (its job directory ``within``) for a live
    change."""
    if path:
        for kind in load_data(f"file:{path}", within):
            schedules.register(kind)


def agreed_plan(doc: dict[str, Any], schedules_path: str | None, layers: int, world: int,
                all_max: Callable[[list[float]], list[float]], within: Path | None = None) -> Plan | str:
    """The plan a live change names, checked on this rank (after registering the schedules it brings), or why not;
    every rank agrees (``all_max``), so a plan one rank cannot read changes nothing anywhere instead of ending the
    job (an attached job's workers do not know a schedule registered only in the client, say)."""
    problem = ""
    plan: Plan | None = None
    try:
        register_schedules(schedules_path, within)
        plan = Plan.from_dict(doc).validate(layers, world)  # the one check on this rank
    except (VpipeError, ValueError, OSError) as exc:
        problem = f"{exc}; a schedule the workers do not know must be registered in their own script"
    if all_max([1.0 if problem else 0.0])[0] > 0:
        return problem or "another stage could not read the plan"
    assert plan is not None
    return plan


def job_dir(spec: JobSpec) -> Path | None:
    """The directory the controller writes this job's files in, None without one (a torchrun job)."""
    return Path(spec.job_dir).resolve() if spec.job_dir else None


def load_data(ref: str, within: Path | None = None, *, named_by_user: bool = False) -> Any:
    """Data a command names: a file of the controller's (a pickled function or iterable, in its job directory
    ``within``), a bundled example, or 'package.module:attribute'. Unpickling runs code, so a ``file:`` reference
    is read only inside ``within``, or where the user named the file themselves (``named_by_user``: the command
    line's ``--model file:PATH``, which is code like ``python PATH``)."""
    if ref.startswith("file:"):
        path = Path(ref[5:]).resolve()
        if not named_by_user and (within is None or not path.is_relative_to(within)):
            raise ValueError(f"{ref!r} is outside this job's directory ({within}): a worker unpickles only the files "
                             "its controller wrote there")
        with open(path, "rb") as fh:
            return cloudpickle.load(fh)
    if ref in examples.EXAMPLES:
        return examples.get(ref).data
    module, sep, attr = ref.partition(":")
    if not sep:
        raise ValueError(f"data {ref!r}: give a bundled example ({', '.join(examples.EXAMPLES)}) or "
                         "'package.module:attribute'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load the data {ref!r}: {exc}") from None
