"""The lab's schedules as torch.distributed.pipelining runs them: its action strings, its schedule classes and its
stage-to-rank placement.

torch numbers pipeline stages as the lab numbers chunks (virtual stages): stage ``i`` holds the lab's chunk ``i``, and
``_PipelineScheduleRuntime._load_csv`` reads one CSV row per rank of compute actions ``{stage}{op}{micro-batch}``:
``F`` forward, ``B`` a full backward, ``I`` the input gradient and ``W`` the weights' gradients of a split backward.
The lab's zero-bubble ``B`` is torch's ``I``. torch places stage ``i`` on rank ``i % ranks`` ("loop") or down and
back up ("v", ZBV and DualPipeV); the lab's placements are the same.

``torch_name`` says which ``get_schedule_class`` name runs *exactly* the lab's order, where one does: each schedule
kind's rule (``ScheduleKind.torch``, ``core/schedules/``) was found by comparing the orders over many shapes, and
``tests/core/interop/test_torch_schedules.py`` checks every rule against the installed torch's own schedules.
Everywhere else the exported CSV is the contract.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence

from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.schedules import TorchSchedule
from vpipe_lab.core.schedules.actions import Op
from vpipe_lab.core.schedules.builders import for_plan


def torch_classes() -> dict[str, TorchSchedule]:
    """Each registered schedule that a torch class can run: lab name -> the class (the rule is the schedule's own,
    ``ScheduleKind.torch``). The rules are about orders, not speed: a schedule whose order differs still trains the
    same model to the same numbers when torch runs the exported CSV instead."""
    return {k.name: k.torch for k in schedules.kinds() if k.torch is not None}


def torch_schedule(plan: Plan) -> TorchSchedule:
    """The torch class family for ``plan``'s schedule; PlanError for one torch cannot run."""
    kind = schedules.get(plan.schedule)
    if kind.export_refusal:
        raise PlanError(f"schedule {plan.schedule!r} cannot be exported: {kind.export_refusal}")
    if kind.torch is None:  # no class of torch's runs it: its CSV does, on torch's runtime (loop placement)
        return TorchSchedule("", "loop", lambda k, v, m: False, "no torch class: the exported CSV runs it")
    return kind.torch


def torch_name(plan: Plan) -> str | None:
    """The ``get_schedule_class`` name whose class runs exactly ``plan``'s compute order, else None."""
    found = torch_schedule(plan)
    return found.name if found.name and found.exact(plan.stages, plan.virtual_stages, plan.microbatches) else None


def style(plan: Plan) -> str:
    """torch's placement style for the plan's chunks: "v" under ZBV, else "loop"."""
    return torch_schedule(plan).style


def rows(plan: Plan) -> list[list[str]]:
    """Each rank's compute actions in torch's format, exactly in the order the lab runs them."""
    split = plan.kind.split_backward
    whole = plan.kind.full_backwards(plan.stages, plan.microbatches)  # B then its W at once: torch's whole B
    out = []
    for row in for_plan(plan).compute_only().stages:
        cells = []
        for a in row:
            if a.op is Op.W and (a.stage, a.microbatch) in whole:
                continue  # part of the whole backward just written
            letter = {Op.F: "F", Op.W: "W"}.get(a.op) or ("I" if split and (a.stage, a.microbatch) not in whole else "B")
            cells.append(f"{a.stage}{letter}{a.microbatch}")
        out.append(cells)
    return out


def csv_text(plan: Plan) -> str:
    """``rows(plan)`` as the compute-only CSV ``_PipelineScheduleRuntime._load_csv`` reads: one row per rank."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for row in rows(plan):
        writer.writerow(row)
    return out.getvalue()


def read_csv(text: str) -> list[list[str]]:
    """A compute-only CSV schedule's rows of action strings (empty cells dropped, as torch drops them)."""
    return [[cell.strip() for cell in row if cell.strip()] for row in csv.reader(io.StringIO(text))]


def schedule_of_rows(found: Sequence[Sequence[str]], candidates: Sequence[Plan]) -> Plan | None:
    """Which of ``candidates`` (plans of the lab's schedules) runs exactly the actions ``found``; None if none does."""
    want = [list(r) for r in found]
    for plan in candidates:
        try:
            if rows(plan) == want:
                return plan
        except Exception:  # a candidate the lab cannot order (micro-batches not a multiple of stages, say)
            continue
    return None


def rank_of_stage(plan: Plan) -> list[int]:
    """torch's stage index -> rank, for the plan's chunks (the lab's placement, which is torch's)."""
    return list(plan.placement)
