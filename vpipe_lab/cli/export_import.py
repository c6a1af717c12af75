"""`vpipe-lab export` (a bundle from a run directory, a checkpoint, a running torchrun job, a saved plan) and
`vpipe-lab import` (a torchtitan config, a Megatron-LM layout or a bundle as a plan JSON over a model's units)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vpipe_lab.cli.jobs import module_names
from vpipe_lab.control.changes import interop
from vpipe_lab.core import schedules
from vpipe_lab.core.interop.bundle import UnitInfo
from vpipe_lab.core.plan import Plan
from vpipe_lab.wire import bundle_files as files
from vpipe_lab.wire.private import DEFAULT_KEY_FILE


class UsageProblem(ValueError):
    """A command line that names no model to export or import for."""


def units_of_model(model: str, data: str | None, split: list[str] | None, microbatches: int) -> list[UnitInfo]:
    """Cut ``model`` (a bundled example or package.module:factory) into its units here, as the workers would."""
    from vpipe_lab import examples
    from vpipe_lab.runtime.build import unit_chain
    from vpipe_lab.runtime.model.batches import Source
    from vpipe_lab.runtime.model.batches import split as split_batch
    from vpipe_lab.runtime.model.callables import load_data
    from vpipe_lab.runtime.model.compat import allow_torchvision_without_ops

    allow_torchvision_without_ops()
    source: str | None = data
    if model in examples.EXAMPLES:
        factory, source = examples.get(model).model, data or model
    else:
        factory = load_data(model, named_by_user=True)  # package.module:factory, or file: (code)
    if source is None:
        raise UsageProblem("--data is needed to capture a model that is not bundled (one batch of its inputs)")
    data_fn = load_data(source, named_by_user=True)

    def first() -> Any:
        inputs, _ = Source(data_fn, 0).get(0)
        return split_batch(inputs, microbatches, "inputs")[0]

    chain = unit_chain(factory, split, 0, first)
    return [UnitInfo.from_dict(d) for d in chain.infos()]


def _units(args: argparse.Namespace) -> tuple[list[UnitInfo], Plan | None]:
    if args.checkpoint:
        plan, units = interop.from_checkpoint(args.checkpoint)
        return units, plan
    if args.bundle:
        found = files.read(args.bundle)
        return list(found.units), found.plan
    if args.model:
        return units_of_model(args.model, args.data, args.split, getattr(args, "microbatches", None) or 1), None
    raise UsageProblem("say whose units: --checkpoint DIR, --bundle DIR, --model NAME (or --attach for export)")


def _checked_export(args: argparse.Namespace) -> Plan | None:
    """Every argument read or refused before anything is captured or attached: the destination (replaced only when
    it is a bundle and nothing else), the plan file, the run directory."""
    problem = files.replaceable(Path(args.output).absolute())
    if problem is not None:
        raise FileExistsError(f"{Path(args.output).absolute()} {problem}: give a new or empty directory")
    if args.run_dir is not None and not (Path(args.run_dir) / "checkpoints").is_dir():
        raise FileNotFoundError(f"--run-dir {args.run_dir}: no checkpoints/ in it (vpipe-lab run --run-dir DIR "
                                "leaves one)")
    return Plan.from_json(Path(args.plan)) if args.plan else None


def from_run(run_dir: Path, plan: Plan | None, microbatch_size: int | None) -> Any:
    """The bundle of what `vpipe-lab run --run-dir` left: the plan in force at its end (or ``plan``) over the units
    its checkpoint names, with the cost model's prediction from the measured profile and cluster, and the measured
    iteration (the median of the newest ones that ran under that plan, from metrics.jsonl)."""
    from vpipe_lab.core.profile import Cluster, ModelProfile
    from vpipe_lab.telemetry import runlog

    saved, units = interop.from_checkpoint(run_dir / "checkpoints")
    ran = Plan.from_json(run_dir / "plan.json") if (run_dir / "plan.json").exists() else saved
    plan = plan if plan is not None else ran
    profile = cluster = measured = None
    if (run_dir / "profile.json").exists() and (run_dir / "cluster.json").exists():
        profile = ModelProfile.from_json(run_dir / "profile.json")
        cluster = Cluster.from_json(run_dir / "cluster.json")
    if plan == ran and (run_dir / runlog.METRICS).exists():
        rows = runlog.read(run_dir).to_dict("records")
        versions = [int(r["plan_version"]) for r in rows if r.get("plan_version") is not None]
        measured = interop.measured_s(rows, max(versions)) if versions else None
    size = microbatch_size or interop.microbatch_size_of(run_dir / "checkpoints")
    return interop.bundle_of(plan, units, microbatch_size=size, profile=profile, cluster=cluster, measured=measured)


def cmd_export(args: argparse.Namespace) -> int:
    given = _checked_export(args)
    if args.run_dir is not None:
        path = interop.write(args.output, from_run(Path(args.run_dir), given, args.microbatch_size))
    elif args.attach:
        import vpipe_lab

        session = vpipe_lab.attach(args.attach, key_file=args.key_file)
        try:
            path = session.export_plan(args.output, plan=given, microbatch_size=args.microbatch_size)
        finally:
            session.detach()
    else:
        if given is None and not (args.checkpoint or args.bundle):  # nothing to capture a model for
            raise UsageProblem("no plan: give --plan PLAN.json (vpipe-lab plan -o writes one), a --checkpoint or "
                               "--run-dir DIR (vpipe-lab run --run-dir leaves both)")
        units, saved = _units(args)
        plan = given if given is not None else saved
        if plan is None:
            raise UsageProblem("no plan: give --plan PLAN.json (vpipe-lab plan -o writes one) or a checkpoint")
        size = args.microbatch_size
        if size is None and args.checkpoint:  # the size the job ran with: torchtitan would split the batch otherwise
            size = interop.microbatch_size_of(args.checkpoint)
        path = interop.write(args.output, interop.bundle_of(plan, units, microbatch_size=size))
    found = files.read(path)
    print(f"{found.plan.describe()} exported to {path} ({found.schedule or 'schedule.csv'}); see {path / 'README.md'}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    if not (args.checkpoint or args.bundle or args.model) and Path(args.source).is_dir():
        args.bundle = args.source  # a bundle as it is: its own units are the model's
    units, current = _units(args)
    source: Any = args.source
    plan = interop.read(source, units, current, ranks=args.ranks, batch_size=args.batch_size,
                        microbatches=args.microbatches, schedule=args.schedule)
    print(f"{plan.describe()}  ({len(units)} units: {', '.join(u.name for u in units[:4])}"
          f"{', ...' if len(units) > 4 else ''})")
    if args.output:
        Path(args.output).write_text(plan.to_json(indent=1))
        print(f"plan written to {args.output} (vpipe-lab run --plan, launch(plan=Plan.from_json(...)))",
              file=sys.stderr)
    return 0


def _whose(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("whose units (module names)")
    g.add_argument("--checkpoint", help="a checkpoint the lab wrote (its manifest names the units)")
    g.add_argument("--bundle", help="an export bundle")
    g.add_argument("--model", help="bundled example, package.module:factory, or file:PATH (a pickled factory: loading it "
                   "runs its code, like python PATH; name only files you trust), cut here as the workers cut it")
    g.add_argument("--data", help="bundled example, package.module:data or file:PATH (likewise code): one batch to "
                   "capture the model on")
    g.add_argument("--split", type=module_names,
                   help="module names where units begin, comma-separated (as launch(split=...))")


def add_commands(sub: Any) -> None:
    e = sub.add_parser("export", help="write an export bundle (torch.distributed.pipelining, torchtitan, "
                                      "Megatron-LM) from a checkpoint, a running torchrun job or a plan JSON")
    e.add_argument("output", help="the bundle directory to write")
    e.add_argument("--plan", help="plan JSON to export (default: the checkpoint's or the job's plan)")
    e.add_argument("--microbatch-size", type=int, help="samples per micro-batch, for torchtitan and Megatron-LM")
    e.add_argument("--attach", help="export the plan in force of the torchrun job serving this address")
    e.add_argument("--run-dir", help="export what vpipe-lab run --run-dir DIR left: its plan over its checkpoint's "
                   "units, with the measured and predicted iteration")
    e.add_argument("--key-file", default=str(DEFAULT_KEY_FILE))
    _whose(e)
    e.set_defaults(func=cmd_export)
    i = sub.add_parser("import", help="a torchtitan TOML, Megatron-LM layout string or bundle as a plan JSON")
    i.add_argument("source", help="torchtitan TOML file, export bundle, or a Megatron-LM layout string")
    i.add_argument("--ranks", type=int, help="pipeline ranks of a layout string")
    i.add_argument("--batch-size", type=int)
    i.add_argument("--microbatches", "-m", type=int)
    i.add_argument("--schedule", choices=schedules.names())
    i.add_argument("-o", "--output", help="write the plan JSON here")
    _whose(i)
    i.set_defaults(func=cmd_import)
