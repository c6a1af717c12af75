"""The lab's schedules as torch.distributed.pipelining runs them: its action strings, its schedule classes and its
stage-to-rank placement.

torch numbers pipeline stages as the lab numbers chunks (virtual stages): stage ``i`` holds the lab's chunk ``i``, and
``_PipelineScheduleRuntime._load_csv`` reads one CSV row per rank of compute actions ``{stage}{op}{micro-batch}``:
``F`` forward, ``B`` a full backward, ``I`` the input gradient and ``W`` the weights' gradients of a split backward.
The lab's zero-bubble ``B`` is torch's ``I``. torch places stage ``i`` on rank ``i % ranks`` ("loop") or down and
back up ("v", ZBV and DualPipeV); the lab's placements are the same.

``torch_name`` says which ``get_schedule_class`` name runs *exactly* the lab's order, where one does: each entry's
rule below was found by comparing the orders over many shapes, and ``tests/core/interop/test_torch_schedules.py``
checks every rule against the installed torch's own schedules. Everywhere else the exported CSV is the contract.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.generators import for_plan
from vpipe_lab.core.plan import SPLIT, Plan
from vpipe_lab.core.schedule import Op


@dataclass(frozen=True)
class TorchSchedule:
    """A torch schedule class that can run one of the lab's schedules: its ``get_schedule_class`` name, its
    placement style and when its order is exactly the lab's (stages, chunks per stage, micro-batches)."""

    name: str
    style: str  # "loop" | "v": torch.distributed.pipelining._utils.generate_stage_to_rank_mapping's style
    exact: Callable[[int, int, int], bool]
    note: str


# Which torch class each lab schedule corresponds to. The rules are about orders, not speed: a schedule whose order
# differs still trains the same model to the same numbers when torch runs the exported CSV instead.
TORCH: dict[str, TorchSchedule] = {
    "gpipe": TorchSchedule("GPipe", "loop", lambda k, v, m: True, "the same order"),
    "1f1b": TorchSchedule("1F1B", "loop", lambda k, v, m: m >= k,
                          "the same order; torch's 1F1B refuses fewer micro-batches than stages"),
    "eager-1f1b": TorchSchedule("1F1B", "loop", lambda k, v, m: False,
                                "one more warm-up forward per stage than torch's 1F1B: the CSV runs it"),
    "zb-h1": TorchSchedule("InterleavedZeroBubble", "loop", lambda k, v, m: m in (1, k),
                           "torch's ZB1P holds fewer W steps back on the first stages: the same order only when "
                           "micro-batches = 1 or = stages"),
    "interleaved-1f1b": TorchSchedule("Interleaved1F1B", "loop", lambda k, v, m: m % k == 0,
                                      "the same order (Megatron-LM's) whenever micro-batches are a multiple of stages"),
    "zbv": TorchSchedule("ZBVZeroBubble", "v", lambda k, v, m: m == 1 or m >= 2 * k - 1,
                         "the same order from 2 x stages - 1 micro-batches on (and for 1); with fewer, the two "
                         "orders fill the warm-up differently"),
}
# Schedules torch.distributed.pipelining cannot run at all, and why.
UNSUPPORTED = {"pipedream": "PipeDream updates the weights after every micro-batch with stashed weight versions; "
                            "torch.distributed.pipelining's schedules step once per iteration. Replan with "
                            "method='pipedream-flush' (its synchronous schedule, 1F1B) before exporting"}


def torch_schedule(plan: Plan) -> TorchSchedule:
    """The torch class family for ``plan``'s schedule; PlanError for one torch cannot run."""
    if plan.schedule in UNSUPPORTED:
        raise PlanError(f"schedule {plan.schedule!r} cannot be exported: {UNSUPPORTED[plan.schedule]}")
    return TORCH[plan.schedule]


def torch_name(plan: Plan) -> str | None:
    """The ``get_schedule_class`` name whose class runs exactly ``plan``'s compute order, else None."""
    found = torch_schedule(plan)
    return found.name if found.exact(plan.stages, plan.virtual_stages, plan.microbatches) else None


def style(plan: Plan) -> str:
    """torch's placement style for the plan's chunks: "v" under ZBV, else "loop"."""
    return torch_schedule(plan).style


def rows(plan: Plan) -> list[list[str]]:
    """Each rank's compute actions in torch's format, exactly in the order the lab runs them."""
    split = plan.schedule in SPLIT
    names = {Op.F: "F", Op.B: "I" if split else "B", Op.W: "W"}
    return [[f"{a.stage}{names[a.op]}{a.microbatch}" for a in row]
            for row in for_plan(plan).compute_only().stages]


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
