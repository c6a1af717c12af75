"""The ``%vpipe`` magic's vocabulary: its parser (``build_parser``, the one statement of every sub-command, option
and choice), its sub-commands (``COMMANDS``) and the refusal of what a sub-command does not take (``unknown``: that
sub-command's usage, and the option meant where one is close)."""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from IPython.core.error import UsageError

from vpipe_lab.core import schedules
from vpipe_lab.core.plan import AUTO, Policy
from vpipe_lab.core.planning.methods import METHODS
from vpipe_lab.core.settings_flags import add_flags, byte_size
from vpipe_lab.examples import EXAMPLES
from vpipe_lab.jupyter import record_commands
from vpipe_lab.jupyter.interop_commands import add_commands

POLICIES = tuple(p.value for p in Policy)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # an IPython usage error, not SystemExit
        raise UsageError(f"{self.prog}: {message}\n\n{self.format_usage()}")

    def exit(self, status: int = 0, message: str | None = None) -> Any:
        if message:
            raise UsageError(message)
        raise _Done


class _Done(Exception):
    """--help was printed."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%vpipe", description="Drive a vpipe_lab pipeline from the notebook.", add_help=True)
    sub = p.add_subparsers(dest="command", parser_class=_Parser)
    s = sub.add_parser("start", help="start stage workers in the background")
    s.add_argument("model", help=f"bundled example ({', '.join(EXAMPLES)}), package.module:factory or the name of a "
                   "notebook variable (as are the job's other parts)")
    s.add_argument("--data", help="data function: bundled name or notebook variable (default: the model's)")
    s.add_argument("--loss", help="notebook variable holding the loss function")
    s.add_argument("--optimizer", help="notebook variable holding the optimizer factory")
    s.add_argument("--resume", help="a checkpoint directory to start from (session.save's, vpipe-lab run --run-dir's "
                   "checkpoints/), onto any stage count or schedule")
    s.add_argument("--split", help="where partition units begin: module names, comma-separated (transformer.h.4,...), "
                                   "or a notebook variable holding a function (name, module) -> bool")
    s.add_argument("--plan", help="notebook variable holding a Plan")
    s.add_argument("--lr-scheduler", help="notebook variable holding an optimizer -> scheduler factory")
    s.add_argument("--eval-data", help="evaluation data: a bundled example or a notebook variable")
    add_flags(s.add_argument_group("settings", "a job's settings (vpipe_lab.Settings), as launch() takes them; "
                                   "--log also takes a notebook variable holding a function"), "magics")
    s.add_argument("--run", default=None, help="start training right away: N iterations or 'forever'")
    s.add_argument("--name", default="session", help="notebook variable to bind the Session to (default: session)")
    u = sub.add_parser("use", help="act on the Session held by a notebook variable (e.g. one launch() returned)")
    u.add_argument("variable")
    sub.add_parser("status", help="the session, its plan and the last iteration")
    r = sub.add_parser("run", help="train N more iterations in the background (default: until stopped)")
    r.add_argument("iterations", nargs="?", type=int)
    w = sub.add_parser("wait", help="block until iteration N (default: the run's target)")
    w.add_argument("iteration", nargs="?", type=int)
    w.add_argument("--timeout", type=float, default=None)
    sub.add_parser("pause", help="pause at the next iteration boundary")
    sub.add_parser("resume", help="resume training")
    sub.add_parser("stop", help="stop the workers")
    pl = sub.add_parser("plan", help="vPipe's replanning from the measured profile: show the plan, its gain, moves")
    pl.add_argument("--method", default="vpipe", choices=METHODS)
    pl.add_argument("--apply", action="store_true", help="apply it (live migration)")
    pl.add_argument("--choose-microbatches", action="store_true",
                    help="let the planner choose the micro-batch count too, for the same global batch")
    pl.add_argument("--schedule", choices=(*schedules.names(), AUTO), default=None,
                    help="plan for this schedule, or auto to let the planner choose it (default: the current one)")
    pl.add_argument("--devices", type=int, default=None,
                    help="choose stages x shards x replicas for this many devices, the job's global batch and its "
                         "measured profile (a new mesh runs after a restart: save, then launch on it)")
    pl.add_argument("--memory", type=byte_size, default=None, help="bytes per device for --devices (default: the "
                    "job's budget per stage)")
    a = sub.add_parser("apply", help="apply a Plan held in a notebook variable")
    a.add_argument("plan")
    a.add_argument("--force", action="store_true", help="even if its estimate exceeds a memory budget")
    pa = sub.add_parser("partition", help="set the stage boundaries, e.g. 0 4 10")
    pa.add_argument("boundaries", nargs="+", type=int)
    po = sub.add_parser("policy", help=f"set layer policies LAYER=POLICY, POLICY one of {', '.join(POLICIES)} or "
                                       "a prefix of one (k, s, r): e.g. 3=swap 4=recompute, or 3=s 4=r")
    po.add_argument("assignments", nargs="+")
    ev = sub.add_parser("eval", help="mean loss of a forward-only pass (eval mode) at the next iteration boundary")
    ev.add_argument("data", nargs="?", help="bundled name or notebook variable (default: the job's eval data)")
    ev.add_argument("--batches", type=int, default=1)
    t = sub.add_parser("trace", help="write the last iterations as a Chrome trace (open it in Perfetto)")
    t.add_argument("file")
    t.add_argument("--iterations", type=int, default=3)
    add_commands(sub)
    record_commands.add_commands(sub)
    sub.add_parser("dashboard", help="live timeline, memory and loss")
    sub.add_parser("editor", help="the partition editor: drag boundaries, toggle policies, preview, apply")
    sub.add_parser("help", help="this help")
    return p


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser's sub-commands by name, in the order ``%vpipe help`` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


COMMANDS = tuple(subcommands(build_parser()))


def unknown(parser: argparse.ArgumentParser, command: str | None, extra: list[str]) -> None:
    """Refuse what the sub-command does not take, with its own usage and the option meant where one is close."""
    sub = subcommands(parser).get(command or "", parser)
    options = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    hints = [f"did you mean {close[0]}?" for word in extra if word.startswith("-")
             if (close := difflib.get_close_matches(word.split("=")[0], options, n=1, cutoff=0.6))]
    raise UsageError(f"{sub.prog}: unrecognized arguments: {' '.join(extra)}"
                     + (f" ({'; '.join(hints)})" if hints else "") + f"\n\n{sub.format_usage()}")
