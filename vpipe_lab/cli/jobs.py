"""`vpipe-lab run` (train a bundled example in a pipeline from the shell) and `vpipe-lab worker` (one stage under
torchrun); `vpipe-lab lab` lives in cli/lab.py."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from vpipe_lab.cli import lab
from vpipe_lab.core.cost.costmodel import estimate
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.report import human_bytes, human_time, plan_table
from vpipe_lab.core.settings import Settings
from vpipe_lab.core.settings_flags import add_flags, from_args
from vpipe_lab.examples import EXAMPLES
from vpipe_lab.wire.private import DEFAULT_KEY_FILE


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="it", file=sys.stderr, dynamic_ncols=True, leave=True)


def profile_and_plan(model: str, settings: Settings) -> Plan:
    """Measure every layer on the real workers for two iterations, then let vPipe plan the measured profile."""
    import vpipe_lab
    from vpipe_lab.core.planning.planner import search

    probing = replace(settings, max_restarts=0, snapshot_every=None, auto_replan=False, log=None)
    with vpipe_lab.launch(model, settings=probing) as probe:
        probe.run(2)
        probe.wait(timeout=600)
        profile = probe.profile()
        cluster = probe.cluster()
    result = search(profile, cluster, microbatches=settings.microbatches, schedule=settings.schedule, method="vpipe",
                    virtual_stages=settings.chunks)
    print(f"vpipe planned from the measured profile: {result.plan.describe()} "
          f"(predicted {human_time(result.estimate.iteration_s)} per iteration)")
    return result.plan


def cmd_run(args: argparse.Namespace) -> int:
    import vpipe_lab

    settings = from_args(args, "run").validated()  # a bad setting is named before anything starts
    plan = None
    if args.plan == "auto":
        plan = profile_and_plan(args.model, settings)
    elif args.plan:
        plan = Plan.from_json(Path(args.plan))
    print(f"starting {settings.stages} stage workers for {args.model!r} ...", file=sys.stderr)
    with vpipe_lab.launch(args.model, plan=plan, settings=settings) as session:
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
        session.wait(timeout=args.wait_timeout)
        unsubscribe()
        # the last iteration's event comes on another thread than wait()'s answer: the bar counts what was done
        bar.update(max(0, len(session.metrics.records()) - bar.n))
        bar.close()
        frame = session.metrics.iterations
        memory = session.metrics.memory
        profile = session.profile()  # measured: the peaks predicted below are over it
        cluster = session.cluster()
        timeline = session.metrics.timeline(3)
        steady = frame.iloc[min(2, len(frame) - 1):]
        est = estimate(session.plan, profile, cluster)
        print()
        print(plan_table(session.plan, est, profile))
        print()
        last = memory[memory["iteration"] == memory["iteration"].max()].sort_values(["stage", "replica"])
        both = session.memory(ask=False)  # the planner's peak beside the allocator's, a row per worker
        shards = session.plan.shards
        predicted_of = {(r.stage, r.replica * shards + r.shard): r.predicted_peak for r in both.itertuples()}
        for row in last.itertuples():
            dp = getattr(row, "replica", 0)  # a worker reports as its data-parallel pipeline (shard, replica)
            who = f"stage {row.stage}" + (f" shard {dp % shards}" if shards > 1 else "") + (
                f" replica {dp // shards}" if session.plan.replicas > 1 else "")
            line = (f"{who}: params {human_bytes(row.params)}, optimizer {human_bytes(row.optimizer)}, "
                    f"activations peak {human_bytes(row.activations)}, swapped to host {human_bytes(row.host)}")
            predicted, held = predicted_of.get((row.stage, dp)), getattr(row, "allocated_peak", None)
            if predicted == predicted and predicted is not None and held == held and held:
                line += f"; peak predicted {human_bytes(predicted)}, measured {human_bytes(held)}"
            print(line)
        loss0, loss1 = frame["loss"].iloc[0], frame["loss"].iloc[-1]
        print(f"{len(frame)} iterations: loss {loss0:.4f} -> {loss1:.4f}; median iteration "
              f"{human_time(float(steady['time_s'].median()))}, {float(steady['samples_per_s'].median()):.1f} samples/s "
              f"(cost model from the measured profile: {human_time(est.iteration_s)})")
        if args.report:  # by stage: its largest rank's
            write_report(args.report, session, timeline, frame, memory, est, profile,
                         both.groupby("stage")["predicted_peak"].max().tolist())
            print(f"report written to {args.report}")
    return 0


def write_report(path: str, session: Any, timeline: Any, frame: Any, memory: Any, est: Any, profile: Any,
                 predicted: list[Any]) -> None:
    """The run's HTML report: its timeline, memory per stage (the allocator's peak, ``predicted`` by the planner beside
    it), loss and the experts' load."""
    import plotly.graph_objects as go

    from vpipe_lab.charts.figures import gantt_figure, memory_figure, memory_values, save_html

    gantt = gantt_figure(timeline.with_idle(), title="measured timeline (last iterations)", stages=session.stages)
    last = memory[memory["iteration"] == memory["iteration"].max()]
    if "allocated_peak" in last:  # by stage: the rank that held the most (a sharded stage's ranks hold alike)
        last = last.sort_values("allocated_peak", ascending=False, na_position="last")
    last = last.drop_duplicates("stage").sort_values("stage")
    mem = memory_figure(session.stages, [b if isinstance(b, int) else 0 for b in last["budget"].fillna(0)],
                        title="measured memory per stage")
    static = last["static"].tolist()
    held = last["allocated_peak"].tolist() if "allocated_peak" in last else [None] * len(last)
    counted = (static + last["activations"]).tolist()
    values = memory_values(static, last["resident"].tolist(),
                           [h if h == h and h else c for h, c in zip(held, counted)], last["host"].tolist())
    for trace, ys in zip((mem.data[0], mem.data[1], mem.data[2], mem.data[4]), values):
        trace.y = ys
    mem.data[5].y, mem.data[5].visible = [p / 2**30 if p == p and p else None for p in predicted], True
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
    """Options of `vpipe-lab worker` (kept here, torch-free: parsing must not import the runtime): what the job is
    made of and how to reach it; its settings are ``Settings``' fields (``core/settings_flags.py``)."""
    p.add_argument("--model", required=True, help=f"bundled example ({', '.join(EXAMPLES)}) or package.module:factory")
    p.add_argument("--data", help="bundled example or package.module:data (default: the model's, if bundled)")
    p.add_argument("--loss", help="package.module:loss")
    p.add_argument("--optimizer", help="package.module:optimizer_factory")
    p.add_argument("--lr-scheduler", help="package.module:attr, an optimizer -> scheduler factory")
    p.add_argument("--eval-data", help="evaluation data: a bundled example or package.module:attr")
    p.add_argument("--plan", help="plan JSON to start from (default: an even split)")
    p.add_argument("--control-host", default="127.0.0.1", help="where rank 0 listens for clients (default: loopback)")
    p.add_argument("--control-port", type=int, default=29600,
                   help="where rank 0 serves clients; 0: any free port (attach.json in --run-dir says which)")
    p.add_argument("--backend-port", type=int, default=0, help="where ranks reach rank 0 (default: any free port)")
    p.add_argument("--key", help="refused: a key on the command line is in every process's /proc/PID/cmdline, which "
                   "every user of the machine can read (ps); give it in $VPIPE_LAB_KEY or --key-file")
    p.add_argument("--key-file", default=str(DEFAULT_KEY_FILE),
                   help="read the key from here; rank 0 creates it if missing")
    add_flags(p.add_argument_group("settings", "a job's settings (vpipe_lab.Settings), as launch() takes them; the "
                                   "stage count is torchrun's process count divided by --replicas"), "worker")


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
    p.add_argument("--iterations", "-n", type=int, default=20)
    p.add_argument("--plan", default=None, help="'auto' (profile, then plan with vpipe) or a plan JSON file")
    p.add_argument("--wait-timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--report", help="write an HTML report (timeline, memory, loss) here")
    add_flags(p.add_argument_group("settings", "a job's settings (vpipe_lab.Settings), as launch() takes them"), "run")
    p.set_defaults(func=cmd_run)
