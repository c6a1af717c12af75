"""The `vpipe-lab` command: plan and simulate from the shell, run a pipeline, open the lab, serve a worker."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from vpipe_lab.core import schedules, workloads
from vpipe_lab.core.cost import scaling
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.errors import VpipeError
from vpipe_lab.core.plan import AUTO, Plan
from vpipe_lab.core.planning.mesh import choose, search_sharded
from vpipe_lab.core.planning.methods import METHODS
from vpipe_lab.core.planning.planner import PlanResult
from vpipe_lab.core.profile import Cluster, ModelProfile
from vpipe_lab.core.report import human_time, mesh_words, plan_table
from vpipe_lab.core.settings_flags import byte_size

log = logging.getLogger("vpipe_lab.cli")


class CliError(Exception):
    """A bad command line or input file; printed as one line, never a traceback."""


def _load_profile(source: str, device: str, microbatch_size: int | None) -> ModelProfile:
    if source in workloads.WORKLOADS:
        return workloads.workload(source, device=device, microbatch_size=microbatch_size)
    if not Path(source).exists():
        raise CliError(
            f"{source!r} is neither a profile file nor a bundled workload; bundled: {', '.join(workloads.WORKLOADS)}"
        )
    return ModelProfile.from_json(Path(source))


def _cluster(args: argparse.Namespace, stages: int | None = None) -> Cluster:
    stages = args.stages if stages is None else stages
    if args.cluster:
        cluster = Cluster.from_json(Path(args.cluster))
        if cluster.stages != stages and stages is not None:
            if args.devices is None:
                raise CliError(f"--stages {stages} disagrees with {args.cluster}, which has {cluster.stages} stages")
            cluster = replace(cluster, stages=stages, memory_bytes=cluster.budgets[0])  # its device, per stage
    else:
        cluster = workloads.cluster(args.device, stages, memory_bytes=args.memory)
    return replace(cluster, shard_bandwidth=args.shard_bandwidth) if args.shard_bandwidth else cluster


def _add_planning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("profile", help=f"profile JSON file, or a bundled workload: {', '.join(workloads.WORKLOADS)}")
    devices = p.add_mutually_exclusive_group(required=True)
    devices.add_argument("--stages", "-k", type=int, help="pipeline stages (one device each; --shards more)")
    devices.add_argument("--devices", type=int, help="devices in all: the planner chooses stages x shards x replicas "
                         "too (needs --batch-size)")
    p.add_argument("--shards", type=int, default=1, help="ranks sharding each stage with FSDP2 (with --stages): the "
                   "planner chooses each stage's sharding")
    p.add_argument("--replicas", type=int, default=1, help="data-parallel copies of the pipeline (with --stages)")
    p.add_argument("--shard-bandwidth", type=float, default=None, help="bytes/s of a sharded stage's collectives "
                   "(default: the devices' link; give your inter-node bandwidth when shards span nodes)")
    count = p.add_mutually_exclusive_group(required=True)
    count.add_argument("--microbatches", "-m", type=int, help="micro-batches per mini-batch")
    count.add_argument("--batch-size", type=int, help="the global batch: the planner chooses how many micro-batches "
                       "(each count dividing it, on the profile rescaled to its micro-batch size)")
    p.add_argument("--schedule", choices=(*schedules.names(), AUTO), default="1f1b",
                   help="the pipeline schedule, or auto: the planner plans each and keeps the fastest that fits")
    p.add_argument("--method", choices=METHODS, default="vpipe")
    p.add_argument("--device", choices=sorted(workloads.DEVICES), default="rtx2080ti",
                   help="device preset for the cluster and for bundled workloads")
    p.add_argument("--memory", type=byte_size, default=None, help="memory budget per stage (e.g. 8GiB)")
    p.add_argument("--cluster", help="cluster JSON file instead of a device preset")
    p.add_argument("--microbatch-size", type=int, default=None, help="samples per micro-batch (bundled workloads)")


def cmd_plan(args: argparse.Namespace) -> int:
    profile = _load_profile(args.profile, args.device, args.microbatch_size)
    if args.devices is not None:
        result = chosen_mesh(args, profile)
        cluster = _cluster(args, result.plan.stages)
    else:
        cluster = _cluster(args)
        result = search_sharded(profile, cluster, shards=args.shards, replicas=args.replicas,
                                microbatches=args.microbatches, batch_size=args.batch_size, schedule=args.schedule,
                                method=args.method)
    print(f"{profile.name or args.profile}: {len(profile)} layers on {cluster.name or f'{cluster.stages} stages'}, "
          f"method {args.method}")
    if result.candidates:
        share = args.batch_size // result.plan.data_parallel  # each data-parallel rank's share of the batch
        tried = ", ".join(f"{m} x {share // m}: " + (human_time(t) if t is not None else "does not fit")
                          for m, t in result.candidates)
        whose = f"each of {result.plan.data_parallel} data-parallel ranks' {share}" if share != args.batch_size else (
            f"a batch of {args.batch_size}")
        print(f"micro-batches x size for {whose}: {tried}; chosen {result.plan.microbatches} x "
              f"{result.microbatch_size}")
    if result.schedules:
        tried = ", ".join(f"{s}: " + (human_time(t) if t is not None else "does not fit") for s, t in result.schedules)
        print(f"schedules: {tried}; chosen {result.plan.schedule}")
    print(plan_table(result.plan, result.estimate, profile))
    bound = "proven optimal" if result.proven_optimal else f"lower bound {human_time(result.lower_bound_s)}"
    print(f"{bound}; within {result.gap:.2%} of the bound")
    if args.output:
        Path(args.output).write_text(result.plan.to_json(indent=1))
        print(f"plan written to {args.output}")
    return 0


def chosen_mesh(args: argparse.Namespace, profile: ModelProfile) -> PlanResult:
    """``--devices N``: every mesh of N devices planned (core/planning/mesh.py); prints them and the chosen one beside
    the fastest pipeline of whole devices."""
    if args.batch_size is None:
        raise CliError("--devices chooses the mesh for a global batch: give --batch-size (the batch is split over "
                       "shards x replicas, then into micro-batches)")
    if args.shards != 1 or args.replicas != 1:
        raise CliError("--devices chooses shards and replicas itself: give --stages with --shards/--replicas instead")
    found = choose(profile, lambda stages: _cluster(args, stages), devices=args.devices, batch_size=args.batch_size,
                   schedule=args.schedule, method=args.method)
    ranked = sorted(((t, shape) for shape, t in found.tried if t is not None))
    shown = ", ".join(f"{s}x{k}x{r}: {human_time(t)}" for t, (s, k, r) in ranked[:8])
    unfit = sum(1 for _, t in found.tried if t is None)
    print(f"meshes of {args.devices} devices (stages x shards x replicas), fastest first: {shown}"
          + (f"; {unfit} more do not fit" if unfit else ""))
    line = f"chosen {mesh_words(*found.shape)}: {human_time(found.result.estimate.iteration_s)}"
    whole = found.pipeline_only
    if whole is None:
        line += "; no pipeline of whole devices (shards=1) fits"
    else:
        ratio = whole.estimate.iteration_s / found.result.estimate.iteration_s
        line += (f"; the fastest pipeline of whole devices, "
                 f"{mesh_words(whole.plan.stages, whole.plan.shards, whole.plan.replicas)}: "
                 f"{human_time(whole.estimate.iteration_s)} ({ratio:.2f}x as long)")
    print(line)
    return found.result


def cmd_simulate(args: argparse.Namespace) -> int:
    from vpipe_lab.core.cost.simulator import simulate

    profile = _load_profile(args.profile, args.device, args.microbatch_size)
    if args.plan:
        plan = Plan.from_json(Path(args.plan))
        cluster = _cluster(args, plan.stages)
        plan.validate(len(profile), cluster.stages)
    else:
        found = chosen_mesh(args, profile) if args.devices is not None else search_sharded(
            profile, _cluster(args), shards=args.shards, replicas=args.replicas, microbatches=args.microbatches,
            batch_size=args.batch_size, schedule=args.schedule, method=args.method)
        plan = found.plan
        cluster = _cluster(args, plan.stages)
        if found.microbatch_size is not None:
            profile = scaling.at(profile, found.microbatch_size)
    est = estimate(plan, profile, cluster)
    timeline = simulate(plan, profile, cluster)
    print(plan_table(plan, est, profile))
    print(f"simulated iteration: {human_time(timeline.iteration_s)} (cost model: {human_time(est.iteration_s)})")
    if args.trace:
        timeline.save_chrome_trace(args.trace)
        print(f"Chrome trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    if args.html:
        try:
            from vpipe_lab.charts.figures import gantt_figure, memory_figure, memory_values, save_html
        except ImportError as exc:
            raise CliError(f"--html needs plotly ({exc}); pip install 'vpipe_lab[jupyter]'") from None
        gantt = gantt_figure(timeline, title=f"simulated {plan.schedule} iteration: {human_time(timeline.iteration_s)}")
        mem = memory_figure(plan.stages, est.budget_bytes, title="predicted memory per stage")
        values = memory_values(est.static_bytes, est.activation_bytes, est.peak_bytes, est.host_bytes)
        for trace, ys in zip((mem.data[0], mem.data[1], mem.data[2], mem.data[4]), values):
            trace.y = ys
        save_html([gantt, mem], args.html, title=f"{profile.name or args.profile}: simulated pipeline",
                  intro=plan_table(plan, est, profile))
        print(f"timeline written to {args.html}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vpipe-lab", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a profile: partition and per-layer keep/swap/recompute")
    _add_planning_args(p)
    p.add_argument("-o", "--output", help="write the plan as JSON")
    p.set_defaults(func=cmd_plan)
    p = sub.add_parser("simulate", help="simulate a plan's iteration; write a Gantt chart and a Chrome trace")
    _add_planning_args(p)
    p.add_argument("--plan", help="plan JSON (default: plan with --method)")
    p.add_argument("--html", help="write an interactive plotly timeline here")
    p.add_argument("--trace", help="write a Chrome-trace JSON here (Perfetto)")
    p.set_defaults(func=cmd_simulate)
    from vpipe_lab.cli import export_import, jobs  # the commands that start processes live apart from the planning ones

    jobs.add_commands(sub)
    export_import.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what produced a run's files and report
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args))
    except (VpipeError, CliError, ValueError, TimeoutError, OSError) as exc:  # OSError: a file given
        print(f"vpipe-lab: error: {exc}", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"vpipe-lab: error: bad JSON: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vpipe-lab: interrupted", file=sys.stderr)
        return 130

