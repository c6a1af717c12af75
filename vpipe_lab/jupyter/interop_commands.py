"""``%vpipe export`` and ``%vpipe import``: the running plan out to torch/torchtitan/Megatron-LM, a production config
in as a plan to see, simulate and improve (``magics.VpipeMagics`` hands them its sub-commands; the parser's
sub-commands are added by ``add_commands``)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError

from vpipe_lab.control.changes import interop
from vpipe_lab.core import schedules
from vpipe_lab.core.change import Change
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.report import human_time, plan_table
from vpipe_lab.jupyter.magic_host import MagicHost
from vpipe_lab.wire import bundle_files


def add_commands(sub: Any) -> None:
    """The two sub-commands, on ``%vpipe``'s parser."""
    e = sub.add_parser("export", help="write the plan in force as an export bundle (torch.distributed.pipelining, "
                                      "torchtitan, Megatron-LM) to a directory")
    e.add_argument("path")
    e.add_argument("--plan", help="notebook variable holding another Plan to export (default: the plan in force)")
    i = sub.add_parser("import", help="a torchtitan TOML, a Megatron-LM layout string, module lists or a bundle as a "
                                      "plan over this model: shown, simulated, compared with the lab's plan")
    i.add_argument("source", help="a file or bundle path, a layout string ('Et*3|t*4L'), or a notebook variable")
    i.add_argument("--batch-size", type=int, help="samples per batch (with pipeline_parallel_microbatch_size)")
    i.add_argument("--microbatches", type=int)
    i.add_argument("--ranks", type=int, help="pipeline ranks of a layout string (default: the session's stages)")
    i.add_argument("--schedule", choices=schedules.names(), help="for a layout string without virtual stages")
    i.add_argument("--apply", action="store_true", help="run it from the next iteration (live migration)")
    i.add_argument("--name", default="imported", help="notebook variable for the plan (default: imported)")


class InteropCommands:
    """The handlers, over the magic that runs them (``MagicHost``)."""

    def __init__(self, host: MagicHost) -> None:
        self.host = host

    def cmd_export(self, args: argparse.Namespace) -> Path:
        s = self.host.need()
        plan = self.host.value(args.plan, "plan") if args.plan else None
        path = s.export_plan(args.path, plan=plan)
        found = bundle_files.read(path)
        runs = found.schedule or "schedule.csv (no torch class runs this exact order)"
        print(f"vpipe: {(plan or s.plan).describe()} exported to {path}: {len(found.stages)} torch stages over the "
              f"model's module names, run by {runs}; see its README.md")
        return Path(path)

    def cmd_import(self, args: argparse.Namespace) -> Any:
        from vpipe_lab.jupyter.partition_widget import PartitionEditor

        s = self.host.need()
        source: Any = args.source
        if source in self.host.shell.user_ns and not Path(source).exists():
            source = self.host.shell.user_ns[source]
        try:
            plan = s.import_plan(source, batch_size=args.batch_size, microbatches=args.microbatches,
                                 ranks=args.ranks, schedule=args.schedule)
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot import {args.source!r}: {exc}") from None
        self.host.shell.user_ns[args.name] = plan
        profile, cluster = s.profile(), s.cluster()
        print(plan_table(plan, estimate(plan, profile, cluster), profile))
        now = estimate(s.plan, profile, cluster).iteration_s
        found = interop.compare(plan, profile, cluster)
        print(f"imported plan: {found.describe()}; the plan in force: {human_time(now)}")
        if args.apply:
            print(f"vpipe: imported plan in effect from iteration {s.change(Change.to(plan, 'magic')).iteration}")
        # An editor over the imported plan: its what-if simulates the production plan; Apply migrates the session.
        editor = PartitionEditor(plan=plan, profile=profile, cluster=cluster, on_apply=s.apply)
        self.host.views.append(editor)
        print(f"vpipe: bound to `{args.name}`; the editor below starts from it (Apply runs a draft on this session)")
        return editor
