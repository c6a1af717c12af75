"""A plan's schedule as a grid of time steps by rank, in torch.distributed.pipelining's action strings: the schedule
visualiser of the editor and ``%vpipe grid``, printed as torch's ``_format_pipeline_order`` prints a schedule, and
as a CSV a spreadsheet opens.

Each rank runs its compute actions (``torch_schedules.rows``: ``{stage}{F|B|I|W}{micro-batch}``) in the lab's order,
one per step; an action waits until the actions it needs ran at an earlier step on whichever rank: the forward of
the chunk before (same micro-batch), the input gradient of the chunk after (the loss chunk's own forward for the
last), the input gradient of the same chunk for a weight gradient. A step where a rank waits is empty: the bubbles
are where the grid has holes. Every action takes one step, so the grid shows an order's shape, not its times (the
simulator's timeline shows those).
"""

from __future__ import annotations

import csv
import io
import itertools
import re

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.interop.torch_schedules import rows
from vpipe_lab.core.plan import Plan

_ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")


def _parse(action: str) -> tuple[int, str, int]:
    found = _ACTION.match(action)
    if found is None:
        raise PlanError(f"cannot read the action {action!r}: actions are {{stage}}{{F|B|I|W}}{{micro-batch}}, e.g. 0F1")
    return int(found[1]), found[2], int(found[3])


def _needs(action: str, chunks: int) -> list[str]:
    """What must have run before ``action``; each entry lists alternatives (a full ``B`` or a split ``I``)."""
    stage, op, mb = _parse(action)
    if op == "F":
        return [f"{stage - 1}F{mb}"] if stage > 0 else []
    if op in ("B", "I"):
        return [f"{stage}F{mb}"] + ([f"{stage + 1}I{mb}|{stage + 1}B{mb}"] if stage < chunks - 1 else [])
    return [f"{stage}I{mb}"]  # W: its input gradient ran


def align(order: list[list[str]], chunks: int) -> list[list[str]]:
    """Each rank's actions of ``order`` (rank -> its actions in order) placed on unit time steps: a grid of steps by
    ranks, "" where a rank waits. PlanError when the order cannot complete (a rank waits forever)."""
    done_at: dict[str, int] = {}
    position = [0] * len(order)
    grid: list[list[str]] = []
    total = sum(len(r) for r in order)
    while sum(position) < total:
        step = len(grid)
        cells = []
        for rank, actions in enumerate(order):
            cell = ""
            if position[rank] < len(actions):
                action = actions[position[rank]]
                if all(any(done_at.get(alt, step) < step for alt in need.split("|"))
                       for need in _needs(action, chunks)):
                    cell = action
            cells.append(cell)
        if not any(cells):
            stuck = [actions[position[r]] for r, actions in enumerate(order) if position[r] < len(actions)]
            raise PlanError(f"the schedule cannot go on after step {step}: every rank waits ({', '.join(stuck)} "
                            "each need an action that never runs first)")
        for rank, cell in enumerate(cells):
            if cell:
                done_at[cell] = step
                position[rank] += 1
        grid.append(cells)
    return grid


def grid(plan: Plan) -> list[list[str]]:
    """``plan``'s schedule as time steps by ranks (see the module docstring)."""
    return align(rows(plan), plan.chunks)


def format_grid(steps: list[list[str]]) -> str:
    """The grid laid out as torch's ``_format_pipeline_order`` lays out a schedule: a header of ranks, then a line per
    step (``Step 07: 0F1 1B0 ...``), each column as wide as its widest entry."""
    if not steps:
        return ""
    ranks = len(steps[0])
    labels = ["Step " + str(i).zfill(len(str(len(steps) - 1))) for i in range(len(steps))]
    names = [f"Rank {r}" for r in range(ranks)]
    # torch sizes rank r's column by its entries and by step r's label (it zips the labels with the rows): kept, so
    # the two print the same text
    widths = [max(len(labels[r]), *(len(row[r]) for row in steps)) for r in range(ranks)]
    header = " " * (len(labels[0]) + 2) + " ".join(f"{name:<{widths[i]}}" for i, name in enumerate(names))
    lines = [f"{label}: " + " ".join(f"{cell:<{widths[i]}}" for i, cell in enumerate(row))
             for label, row in zip(labels, steps)]
    return header + "\n" + "\n".join(lines) + "\n"


def grid_csv(steps: list[list[str]]) -> str:
    """The grid as CSV: a ``step`` column and one column per rank, empty cells where a rank waits."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["step", *(f"rank {r}" for r in range(len(steps[0]) if steps else 0))])
    for step, row in enumerate(steps):
        writer.writerow([step, *row])
    return out.getvalue()


def busy(steps: list[list[str]]) -> float:
    """The share of the grid's cells that run an action (1 - the bubble share of the unit-time order)."""
    cells = list(itertools.chain.from_iterable(steps))
    return sum(1 for c in cells if c) / len(cells) if cells else 0.0
