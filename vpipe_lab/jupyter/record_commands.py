"""``%vpipe history``, ``%vpipe revert N`` and ``%vpipe compare A B``: the session's record of plans in a notebook;
``%vpipe grid``: a plan's schedule as each rank's actions by step (``magics.VpipeMagics`` hands them its sub-commands;
the parser's sub-commands are added by ``add_commands``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.interop import torch_grid
from vpipe_lab.jupyter.magic_host import MagicHost


def add_commands(sub: Any) -> None:
    """The three sub-commands, on ``%vpipe``'s parser."""
    sub.add_parser("history", help="every plan that ran: measured and predicted time, who applied it; revert, compare")
    r = sub.add_parser("revert", help="run entry N of the history's plan again from the next iteration")
    r.add_argument("entry", type=int)
    c = sub.add_parser("compare", help="two entries of the history side by side: timelines and where time went")
    c.add_argument("a", type=int)
    c.add_argument("b", type=int)
    g = sub.add_parser("grid", help="the schedule as each rank's actions by time step, as torch prints a schedule")
    g.add_argument("--plan", help="notebook variable holding another Plan (default: the plan in force)")
    g.add_argument("--csv", help="also write the grid to this CSV file (a step column, a column per rank)")


class RecordCommands:
    """The handlers, over the magic that runs them (``MagicHost``)."""

    def __init__(self, host: MagicHost) -> None:
        self.host = host

    def cmd_grid(self, args: argparse.Namespace) -> str:
        plan = self.host.value(args.plan, "plan") if args.plan else self.host.need().plan
        try:
            steps = torch_grid.grid(plan)
        except VpipeError as exc:
            raise UsageError(f"no grid for {plan.describe()}: {exc}") from None
        text = torch_grid.format_grid(steps)
        print(f"{plan.describe()}: {len(steps)} steps, {torch_grid.busy(steps):.0%} of the cells busy\n{text}", end="")
        if args.csv:
            Path(args.csv).write_text(torch_grid.grid_csv(steps), encoding="utf-8")
            print(f"vpipe: the grid written to {args.csv}")
        return text

    def cmd_history(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.jupyter.history_panel import HistoryPanel

        panel = HistoryPanel(self.host.need())
        self.host.views.append(panel)
        return panel

    def cmd_revert(self, args: argparse.Namespace) -> None:
        try:
            done = self.host.need().revert(args.entry)
        except ValueError as exc:  # no such entry
            raise UsageError(str(exc)) from None
        print(f"vpipe: entry {args.entry}'s plan ({done.plan.describe()}) in force from iteration {done.iteration} "
              f"({done.moves} layer(s) moved)")

    def cmd_compare(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.jupyter.history_panel import HistoryPanel

        session = self.host.need()
        try:
            session.compare(args.a, args.b)  # an entry that does not exist is refused here, by name
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        panel = HistoryPanel(session)
        panel.a.value, panel.b.value = args.a, args.b
        panel._compare_chosen()
        self.host.views.append(panel)
        return panel
