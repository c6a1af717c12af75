"""`vpipe-lab run` (train a bundled example in a pipeline from the shell) and `vpipe-lab worker` (one stage under
torchrun); `vpipe-lab lab` lives in cli/lab.py."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from vpipe_lab.cli import lab
from vpipe_lab.core import schedules
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.plan import VIRTUAL_HELP, Plan, default_virtual_stages
from vpipe_lab.core.report import human_bytes, human_time, plan_table
from vpipe_lab.examples import EXAMPLES
from vpipe_lab.wire.jobspec import DEVICES, ENGINES, NONFINITE, NONFINITE_HELP, add_training_options
from vpipe_lab.wire.private import DEFAULT_KEY_FILE


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="it", file=sys.stderr, dynamic_ncols=True, leave=True)


def virtual(args: argparse.Namespace) -> int:
    """``--virtual-stages``, or the schedule's default (``plan.default_virtual_stages``)."""
    given = getattr(args, "virtual_stages", None)
    return given if given is not None else default_virtual_stages(args.schedule)


def profile_and_plan(args: argparse.Namespace, budget: int | None) -> Plan:
    """Measure every layer on the real workers for two iterations, then let vPipe plan the measured profile."""
    import vpipe_lab
    from vpipe_lab.core.planning.planner import search

    with vpipe_lab.launch(args.model, stages=args.stages, microbatches=args.microbatches, schedule=args.schedule,
                          virtual_stages=virtual(args), device=args.device, memory_budget=budget,
                          seed=args.seed) as probe:
        probe.run(2)
        probe.wait(timeout=600)
        profile = probe.profile()
        cluster = probe.cluster()
    result = search(profile, cluster, microbatches=args.microbatches, schedule=args.schedule, method="vpipe",
                    virtual_stages=virtual(args))
    print(f"vpipe planned from the measured profile: {result.plan.describe()} "
          f"(predicted {human_time(result.estimate.iteration_s)} per iteration)")
    return result.plan


def cmd_run(args: argparse.Namespace) -> int:
    import vpipe_lab

    budget = args.memory_budget
    plan = None
    if args.plan == "auto":
        plan = profile_and_plan(args, budget)
    elif args.plan:
        plan = Plan.from_json(Path(args.plan))
    print(f"starting {args.stages} stage workers for {args.model!r} ...", file=sys.stderr)
    with vpipe_lab.launch(args.model, stages=args.stages, microbatches=args.microbatches, schedule=args.schedule,
                          virtual_stages=virtual(args), device=args.device, memory_budget=budget, plan=plan,
                          seed=args.seed, engine=args.engine, max_restarts=args.max_restarts,
                          nonfinite=args.nonfinite) as session:
        bar = _progress(args.iterations)

        def on_event(event: dict[str, Any]) -> None:
            if event["type"] == "iteration":
                bar.update(1)
                rate = event.get("samples_per_s") or float("nan")
                bar.write(f"iteration {event['iteration']:4d}  loss {event['loss']:.4f}  "
                          f"{1e3 * event['time_s']:8.1f} ms  {rate:9.1f} samples/s")
            elif event["type"] == "restarted":
                bar.write(f"restart {event['number']}: stage {event['stage']} failed ({event['cause']}); back at "
                          f"iteration {event['snapshot']}, {event['replayed']} iteration(s) to replay"
                          + (f"; {event['note']}" if event.get("note") else ""))

        unsubscribe = session.on_event(on_event)
        session.run(args.iterations)
        session.wait(timeout=args.timeout)
        unsubscribe()
        # the last iteration's event comes on another thread than wait()'s answer: the bar counts what was done
        bar.update(max(0, len(session.metrics.records()) - bar.n))
        bar.close()
        frame = session.metrics.iterations
        memory = session.metrics.memory
        profile = session.profile()
        cluster = session.cluster()
        timeline = session.metrics.timeline(3)
        steady = frame.iloc[min(2, len(frame) - 1):]
        est = estimate(session.plan, profile, cluster)
        print()
        print(plan_table(session.plan, est, profile))
        print()
        last = memory[memory["iteration"] == memory["iteration"].max()]
        for row in last.itertuples():
            print(f"stage {row.stage}: params {human_bytes(row.params)}, optimizer {human_bytes(row.optimizer)}, "
                  f"activations peak {human_bytes(row.activations)}, swapped to host {human_bytes(row.host)}")
        loss0, loss1 = frame["loss"].iloc[0], frame["loss"].iloc[-1]
        print(f"{len(frame)} iterations: loss {loss0:.4f} -> {loss1:.4f}; median iteration "
              f"{human_time(float(steady['time_s'].median()))}, {float(steady['samples_per_s'].median()):.1f} samples/s "
              f"(cost model from the measured profile: {human_time(est.iteration_s)})")
        if args.report:
            write_report(args.report, session, timeline, frame, memory, est, profile)
            print(f"report written to {args.report}")
    return 0


def write_report(path: str, session: Any, timeline: Any, frame: Any, memory: Any, est: Any, profile: Any) -> None:
    import plotly.graph_objects as go

    from vpipe_lab.charts.figures import gantt_figure, memory_figure, memory_values, save_html

    gantt = gantt_figure(timeline.with_idle(), title="measured timeline (last iterations)", stages=session.stages)
    last = memory[memory["iteration"] == memory["iteration"].max()].sort_values("stage")
    mem = memory_figure(session.stages, [b if isinstance(b, int) else 0 for b in last["budget"].fillna(0)],
                        title="measured memory per stage")
    static = last["static"].tolist()
    values = memory_values(static, last["resident"].tolist(), (static + last["activations"]).tolist(),
                           last["host"].tolist())
    for trace, ys in zip((mem.data[0], mem.data[1], mem.data[2], mem.data[4]), values):
        trace.y = ys
    loss = go.Figure(go.Scatter(x=frame["iteration"], y=frame["loss"], mode="lines+markers", name="loss"))
    loss.update_layout(title="loss per iteration", height=300, xaxis_title="iteration")
    if not math.isnan(float(frame["samples_per_s"].iloc[-1])):
        loss.add_trace(go.Scatter(x=frame["iteration"], y=frame["samples_per_s"], yaxis="y2", name="samples/s"))
        loss.update_layout(yaxis2={"overlaying": "y", "side": "right", "title": "samples/s"})
    figures = [gantt, mem, loss]
    rows = session.metrics.expert_records()
    if rows:  # a mixture-of-experts model: tokens per expert over the whole run
        from vpipe_lab.charts.experts import experts_spec

        figures.append(go.Figure(experts_spec(rows, title=f"experts' load over {len(frame)} iterations (share of "
                                                          "each layer's tokens)")))
    save_html(figures, path, title="vpipe_lab run report", intro=plan_table(session.plan, est, profile))


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `vpipe-lab worker` (kept here, torch-free: parsing must not import the runtime)."""
    p.add_argument("--model", required=True, help=f"bundled example ({', '.join(EXAMPLES)}) or package.module:factory")
    p.add_argument("--data", help="bundled example or package.module:data (default: the model's, if bundled)")
    p.add_argument("--loss", help="package.module:loss")
    p.add_argument("--optimizer", help="package.module:optimizer_factory")
    p.add_argument("--microbatches", "-m", type=int, default=4)
    p.add_argument("--replicas", type=int, default=1, help="data-parallel copies of the pipeline: torchrun starts "
                   "stages x replicas processes")
    p.add_argument("--schedule", choices=schedules.names(), default="1f1b")
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--engine", choices=ENGINES, default="lab",
                   help="lab: vpipe_lab's runtime; torch: torch.distributed.pipelining's (runtime/torch_engine.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plan", help="plan JSON to start from (default: an even split)")
    p.add_argument("--memory-budget", type=int, help="bytes per stage")
    p.add_argument("--control-host", default="127.0.0.1", help="where rank 0 listens for clients (default: loopback)")
    p.add_argument("--control-port", type=int, default=29600,
                   help="where rank 0 serves clients; 0: any free port (attach.json in --run-dir says which)")
    p.add_argument("--backend-port", type=int, default=0, help="where ranks reach rank 0 (default: any free port)")
    p.add_argument("--key", help="refused: a key on the command line is in every process's /proc/PID/cmdline, which "
                   "every user of the machine can read (ps); give it in $VPIPE_LAB_KEY or --key-file")
    p.add_argument("--key-file", default=str(DEFAULT_KEY_FILE),
                   help="read the key from here; rank 0 creates it if missing")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--threads", type=int, default=1)
    add_training_options(p.add_argument_group("training", "the same options as launch()"), "package.module:attr")
    u = p.add_argument_group("unattended runs", "train without a client; attaching later still works")
    u.add_argument("--iterations", type=int, help="train until this iteration, then save and exit (default: wait "
                   "for a client's run command)")
    u.add_argument("--save-every", type=int, help="checkpoint into --run-dir every this many iterations")
    u.add_argument("--run-dir", help="checkpoints, snapshots, metrics.jsonl and attach.json; a restart (torchrun's "
                   "--max-restarts) resumes from the newest complete snapshot or checkpoint here, whichever is newer")
    u.add_argument("--snapshot-every", type=int, help="with --run-dir: snapshot every stage's state for a restart "
                   "every this many iterations (default: as often as costs at most ~5%%; 0: no snapshots)")


def cmd_worker(args: argparse.Namespace) -> int:
    from vpipe_lab.runtime import torchrun

    return torchrun.main(args)


def add_commands(sub: Any) -> None:
    worker = sub.add_parser("worker", help="one pipeline stage under torchrun (multi-node); attach with "
                            "vpipe_lab.attach(address, key=...)")
    add_worker_arguments(worker)
    worker.set_defaults(func=cmd_worker)
    lab.add_command(sub)
    p = sub.add_parser("run", help="train a bundled example in a pipeline of worker processes")
    p.add_argument("--model", default="gpt-tiny", choices=list(EXAMPLES), help="bundled example")
    p.add_argument("--stages", "-k", type=int, default=2)
    p.add_argument("--microbatches", "-m", type=int, default=4)
    p.add_argument("--iterations", "-n", type=int, default=20)
    p.add_argument("--schedule", choices=schedules.names(), default="1f1b")
    p.add_argument("--virtual-stages", "-v", type=int, default=None, help=VIRTUAL_HELP)
    p.add_argument("--device", choices=DEVICES, default="auto")
    p.add_argument("--engine", choices=ENGINES, default="lab",
                   help="lab: vpipe_lab's runtime; torch: torch.distributed.pipelining's, from the plan's export bundle")
    p.add_argument("--plan", default=None, help="'auto' (profile, then plan with vpipe) or a plan JSON file")
    p.add_argument("--memory-budget", type=int, default=None, help="bytes per stage")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-restarts", type=int, default=0,
                   help="replace a dead or hung worker and replay from the newest snapshot, this many times")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--nonfinite", choices=NONFINITE, default="pause", help=NONFINITE_HELP)
    p.add_argument("--report", help="write an HTML report (timeline, memory, loss) here")
    p.set_defaults(func=cmd_run)
