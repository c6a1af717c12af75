"""``%load_ext vpipe_lab`` and the ``%vpipe`` line magic: thin adapters over ``Session``.

The parser (``magic_parser.build_parser``) is the one statement of the magic's vocabulary: its sub-commands are ``COMMANDS``,
``%vpipe help`` prints its help, and tab completion offers its options and their choices (planner ``METHODS``,
the schedule registry's names, ``Policy`` values, devices). ``%vpipe help`` lists every command; ``%vpipe start
gpt-tiny --stages 2 --run 50`` is the shortest start.

Training runs in the background; the kernel answers other cells meanwhile. Interrupting the kernel while a cell waits
on training pauses the training instead of killing it (workers live in their own process session anyway).
"""

from __future__ import annotations

import argparse
import logging
import shlex
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from vpipe_lab.core.change import Applied, Change
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.report import human_time, plan_table
from vpipe_lab.core.settings_flags import from_args
from vpipe_lab.examples import EXAMPLES
from vpipe_lab.jupyter import record_commands
from vpipe_lab.jupyter.interop_commands import InteropCommands
from vpipe_lab.jupyter.magic_parser import COMMANDS, POLICIES, _Done, build_parser, subcommands, unknown
from vpipe_lab.jupyter.mesh_command import plan_mesh

__all__ = ["COMMANDS", "VpipeMagics", "build_parser", "complete", "load_ipython_extension", "subcommands"]
log = logging.getLogger(__name__)


@magics_class
class VpipeMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.parser = build_parser()
        self.session: Any = None
        self.views: list[Any] = []
        # the sub-commands whose handlers live in modules of their own, over this magic (``MagicHost``)
        self._handlers = (self, record_commands.RecordCommands(self), InteropCommands(self))

    # --- plumbing ---------------------------------------------------------------------------------------------
    def value(self, name: str, what: str) -> Any:
        if name not in self.shell.user_ns:
            from vpipe_lab.examples import EXAMPLES

            raise UsageError(f"{name!r} is neither a bundled example ({', '.join(EXAMPLES)}) nor a notebook variable "
                             f"holding the {what}: define it first, or give a bundled name")
        return self.shell.user_ns[name]

    def need(self) -> Any:
        """The session to act on: the one this notebook named or started, else the newest running one (a session
        started from Python with launch() or attach() is as much the notebook's as one %vpipe started)."""
        from vpipe_lab.control.sessions import latest

        if self.session is None or self.session.closed:
            newest = latest()
            if newest is None:
                raise UsageError("no running session: start one with %vpipe start gpt-tiny --stages 2, or "
                                 "vpipe_lab.launch(...) in a cell")
            self.session = newest
        return self.session

    def on_interrupt(self, result: Any) -> None:
        """post_run_cell: an interrupted cell (Interrupt kernel) pauses training instead of killing it."""
        if isinstance(getattr(result, "error_in_exec", None), KeyboardInterrupt) and self.session is not None \
                and not self.session.closed and self.session.failure is None:
            try:
                at = self.session.pause()
                print(f"vpipe: training paused before iteration {at} (kernel interrupted); %vpipe resume to go on")
            except Exception as exc:  # never turn an interrupt into a second error
                log.warning("could not pause training after an interrupt: %s", exc)

    # --- the magic --------------------------------------------------------------------------------------------
    @line_magic
    def vpipe(self, line: str) -> Any:
        """Drive a vpipe_lab pipeline; `%vpipe help` lists the commands."""
        try:
            words = shlex.split(line)
        except ValueError as exc:  # an unterminated quote, say
            raise UsageError(f"cannot read the line {line!r}: {exc}") from None
        try:
            args, extra = self.parser.parse_known_args(words)
        except _Done:
            return None
        if extra:
            unknown(self.parser, args.command, extra)
        command = args.command or "help"
        handler = next(getattr(h, f"cmd_{command}") for h in self._handlers if hasattr(h, f"cmd_{command}"))
        try:
            return handler(args)
        except UsageError:
            raise
        except VpipeError as exc:
            raise UsageError(f"{type(exc).__name__}: {exc}") from None
        # What the user asked cannot be done as asked (a bad value, a folder that is not there, a wait that ran out):
        # one line that says why, not a traceback into the lab's code.
        except (ValueError, TypeError, OSError, TimeoutError, RuntimeError) as exc:
            raise UsageError(f"%vpipe {command}: {type(exc).__name__}: {exc}") from None

    def cmd_help(self, args: argparse.Namespace) -> None:
        print(self.parser.format_help())

    def cmd_use(self, args: argparse.Namespace) -> None:
        from vpipe_lab.control.session import Session

        session = self.value(args.variable, "session")
        if not isinstance(session, Session):
            raise UsageError(f"{args.variable!r} holds a {type(session).__name__}, not a vpipe_lab Session (what "
                             "launch() and attach() return)")
        self.session = session
        print(f"vpipe: %vpipe commands now act on `{args.variable}` ({session.status})")

    def cmd_start(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.control.launch import launch

        if self.session is not None and not self.session.closed:
            raise UsageError("a session is already running: %vpipe stop it first")
        if args.run is not None and args.run != "forever" and not (args.run.isdigit() and int(args.run) > 0):
            raise UsageError(f"--run {args.run!r}: give a number of iterations (>= 1) or 'forever'")
        settings = from_args(args, "magics")
        if isinstance(settings.log, str) and ":" not in settings.log:  # a notebook variable holding a function
            settings = replace(settings, log=self.value(settings.log, "logging function"))
        try:  # the settings are checked before anything else is looked up: a bad one is named, nothing started
            settings = settings.validated()
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        part = self._part
        try:
            session = launch(
                part(args.model, "model"), self._data(args.data), settings=settings, loss=part(args.loss, "loss"),
                optimizer=part(args.optimizer, "optimizer factory"), split=self._split(args.split),
                plan=self.value(args.plan, "plan") if args.plan else None, resume=args.resume,
                lr_scheduler=part(args.lr_scheduler, "LR scheduler factory"), eval_data=self._data(args.eval_data),
            )
        except ValueError as exc:  # a stage count the model cannot fill, say: the reason, not a traceback
            raise UsageError(str(exc)) from None
        self.session = session
        self.shell.user_ns[args.name] = session
        if args.run is not None:
            session.run(None if args.run == "forever" else int(args.run))
        training = "" if args.run is None else ("; training in the background until stopped" if args.run == "forever"
                                                else f"; training {args.run} iterations in the background")
        print(f"vpipe: {session.plan.stages} stages ready on {session.processes.device}, bound to `{args.name}`"
              + training)
        return None

    def _part(self, name: str | None, what: str) -> Any:
        """A part of the job as the command line names it: a bundled example or 'package.module:attribute' (as
        `vpipe-lab run` takes them; launch() checks them), else a notebook variable."""
        if name is None:
            return None
        return name if name in EXAMPLES or ":" in name else self.value(name, what)

    def _data(self, name: str | None) -> Any:
        return self._part(name, "data")

    def cmd_eval(self, args: argparse.Namespace) -> float:
        value = self.need().evaluate(self._data(args.data), batches=args.batches)
        print(f"vpipe: evaluation loss {value:.4f} over {args.batches} batch(es)")
        return value

    def _split(self, text: str | None) -> Any:
        if not text:
            return None
        if "," not in text and text in self.shell.user_ns and callable(self.shell.user_ns[text]):
            return self.shell.user_ns[text]
        return [name.strip() for name in text.split(",") if name.strip()]

    def cmd_status(self, args: argparse.Namespace) -> None:
        s = self.need()
        print(repr(s))
        last = s.metrics.latest()
        if last:
            print(f"last iteration {last['iteration']}: loss {last['loss']:.4f}, {human_time(last['time_s'])}")

    def cmd_run(self, args: argparse.Namespace) -> None:
        target = self.need().run(args.iterations)
        print(f"vpipe: training until iteration {target}" if target is not None else "vpipe: training until stopped")

    def cmd_wait(self, args: argparse.Namespace) -> int:
        return int(self.need().wait(args.iteration, timeout=args.timeout))

    def cmd_pause(self, args: argparse.Namespace) -> None:
        print(f"vpipe: paused before iteration {self.need().pause()}")

    def cmd_resume(self, args: argparse.Namespace) -> None:
        print(f"vpipe: resumed at iteration {self.need().resume()}")

    def cmd_stop(self, args: argparse.Namespace) -> None:
        if self.session is None or self.session.closed:
            from vpipe_lab.control.sessions import latest

            self.session = latest() or self.session
        if self.session is None or self.session.closed:
            print("vpipe: no running session to stop")
            return
        self.session.stop()  # the dashboard and editor stay on screen, frozen at their last state
        self.views.clear()
        left = self.session.processes.remaining()  # said as checked, not assumed
        print("vpipe: stopped; no worker process is left" if not left else
              f"vpipe: stopped, but processes {left} have not exited yet")

    def cmd_plan(self, args: argparse.Namespace) -> Any:
        s = self.need()
        if args.devices is not None:
            return plan_mesh(s, args)
        found = s.replan(args.method, apply=args.apply, choose_microbatches=args.choose_microbatches,
                         schedule=args.schedule)
        if args.schedule is not None:
            print(f"schedule: {found.plan.schedule}")
        if args.choose_microbatches:
            print(f"micro-batches: {found.plan.microbatches} of {found.profile.microbatch_size} samples")
        est = estimate(found.plan, found.profile, s.cluster())
        print(plan_table(found.plan, est, found.profile))
        print(f"predicted {human_time(found.predicted_s)} per iteration, now {human_time(found.current_s)} "
              f"({-found.gain:+.1%}); {len(found.moves)} layer move(s), migration ~{human_time(found.migration_s)}"
              + (f"; applied at iteration {found.applied_at}" if found.applied_at is not None else ""))
        return found

    def _change(self, change: Change, force: bool = False) -> Applied:
        done = self.need().change(change, force=force)
        print(f"vpipe: {change.describe()}: {done.describe()}")
        return done

    def cmd_apply(self, args: argparse.Namespace) -> None:
        self._change(Change.to(self.value(args.plan, 'plan'), "magic"), args.force)

    def cmd_partition(self, args: argparse.Namespace) -> None:
        self._change(Change.of(boundaries=args.boundaries, source="magic"))

    def cmd_policy(self, args: argparse.Namespace) -> None:
        changes: dict[int, str] = {}
        for item in args.assignments:
            layer, sep, policy = item.partition("=")
            if not sep or not layer.strip().isdigit():
                raise UsageError(f"cannot read {item!r}: write LAYER=POLICY, e.g. 3=swap")
            changes[int(layer)] = policy
        self._change(Change.of(policies=changes, source="magic"))

    def cmd_trace(self, args: argparse.Namespace) -> None:
        timeline = self.need().metrics.timeline(args.iterations)
        timeline.save_chrome_trace(args.file)
        print(f"vpipe: {len(timeline)} spans written to {args.file} (open it in https://ui.perfetto.dev)")

    def cmd_dashboard(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.jupyter.dashboard import Dashboard

        board = Dashboard(self.need())
        self.views.append(board)
        return board

    def cmd_editor(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.jupyter.partition_widget import PartitionEditor

        editor = PartitionEditor(self.need())
        self.views.append(editor)
        return editor


def complete(self: Any, event: Any) -> list[str]:
    """Tab completion for %vpipe, read off the parser: commands; then a command's options, or the choices of the
    option just typed; bundled models for ``start``, sessions for ``use``, policies for ``policy``."""

    words = event.line.split()
    if len(words) <= 1 or (len(words) == 2 and not event.line.endswith(" ")):
        return list(COMMANDS)
    sub = subcommands(build_parser()).get(words[1])
    if sub is None:
        return []
    if words[1] == "use":
        from vpipe_lab.control.session import Session

        return [name for name, value in self.user_ns.items() if isinstance(value, Session)]
    if words[1] == "policy":
        return list(POLICIES)
    previous = words[-1] if event.line.endswith(" ") else words[-2] if len(words) > 2 else ""
    options = {opt: action for action in sub._actions for opt in action.option_strings if opt not in ("-h", "--help")}
    chosen = options.get(previous)
    if chosen is not None and chosen.choices is not None:
        return [str(c) for c in chosen.choices]
    values = [str(c) for action in sub._actions if not action.option_strings and action.choices is not None
              for c in action.choices]
    return [*(EXAMPLES if words[1] == "start" else ()), *values, *options]


_MAGICS: list[VpipeMagics] = []


def load_ipython_extension(ipython: Any) -> None:
    magics = VpipeMagics(ipython)
    ipython.register_magics(magics)
    ipython.events.register("post_run_cell", magics.on_interrupt)
    ipython.set_hook("complete_command", complete, str_key="%vpipe")
    _MAGICS.append(magics)


def unload_ipython_extension(ipython: Any) -> None:
    for magics in _MAGICS:
        ipython.events.unregister("post_run_cell", magics.on_interrupt)
        if magics.session is not None:
            magics.session.stop()
    _MAGICS.clear()
