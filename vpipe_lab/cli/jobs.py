"""`vpipe-lab run` (train a model in a pipeline of worker processes from the shell, headless) and `vpipe-lab worker`
(one stage under torchrun); `vpipe-lab lab` lives in cli/lab.py, the run's HTML report in cli/html_report.py."""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import threading
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

ROLES = ("model", "data", "loss", "optimizer", "lr_scheduler", "eval_data")
RUN_FILES = ("plan.json", "profile.json", "cluster.json", "run.json")  # beside checkpoints/ and metrics.jsonl


def module_names(text: str) -> list[str]:
    """``--split a.b,c.d``: the module names where units begin (as ``launch(split=[...])``)."""
    names = [n.strip() for n in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: give module names separated by commas, e.g. 'h.2,h.4'")
    return names


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="it", file=sys.stderr, dynamic_ncols=True, leave=True)


def job_parts(args: argparse.Namespace) -> dict[str, Any]:
    """What ``launch()`` takes of the job's own parts, from the command line (each a bundled example or
    'package.module:attribute'; ``launch`` checks them before anything starts)."""
    return {**{role: getattr(args, role) for role in ROLES}, "split": args.split}


def profile_and_plan(parts: dict[str, Any], settings: Settings) -> Plan:
    """Measure every layer on the real workers for two iterations, then let vPipe plan the measured profile."""
    import vpipe_lab
    from vpipe_lab.core.planning.planner import search

    probing = replace(settings, max_restarts=0, snapshot_every=None, auto_replan=False, log=None, run_dir=None,
                      save_every=None)
    with vpipe_lab.launch(**parts, settings=probing) as probe:
        probe.run(2)
        probe.wait(timeout=600)
        profile = probe.profile()
        cluster = probe.cluster()
    result = search(profile, cluster, microbatches=settings.microbatches, schedule=settings.schedule, method="vpipe",
                    virtual_stages=settings.chunks)
    print(f"vpipe planned from the measured profile: {result.plan.describe()} "
          f"(predicted {human_time(result.estimate.iteration_s)} per iteration)")
    return result.plan


def _checked(args: argparse.Namespace, settings: Settings) -> Plan | None:
    """Every file the command line names, read or refused before a worker starts: the plan, the checkpoint to
    resume, the run directory (a file there is not one)."""
    from vpipe_lab.wire.checkpoint_format import Manifest, is_foreign

    if args.resume is not None:
        if not Path(args.resume).exists():
            raise FileNotFoundError(f"--resume {args.resume}: no such checkpoint (Session.save or --run-dir writes "
                                    "one; give its directory)")
        if not is_foreign(args.resume):
            Manifest.read(args.resume)  # a damaged or foreign-looking one is refused here, in one line
    if settings.run_dir is not None and Path(settings.run_dir).exists() and not Path(settings.run_dir).is_dir():
        raise NotADirectoryError(f"--run-dir {settings.run_dir}: that is a file; give a directory (made if missing)")
    if args.plan and args.plan != "auto":
        return Plan.from_json(Path(args.plan))
    return None


def cmd_run(args: argparse.Namespace) -> int:
    import vpipe_lab

    settings = from_args(args, "run").validated()  # a bad setting is named before anything starts
    parts = job_parts(args)
    plan = _checked(args, settings)
    if args.plan == "auto":
        plan = profile_and_plan(parts, settings)
    print(f"starting {settings.workers} workers for {args.model!r} ...", file=sys.stderr)
    with vpipe_lab.launch(**parts, plan=plan, resume=args.resume, settings=settings) as session:
        bar = _progress(args.iterations)
        printed: set[int] = set()
        lock = threading.Lock()  # events come on the session's thread, the last ones are printed from this one

        def line(record: dict[str, Any]) -> None:
            with lock:
                if record["iteration"] in printed:
                    return
                printed.add(record["iteration"])
                bar.update(1)
                rate = record.get("samples_per_s") or float("nan")
                bar.write(f"iteration {record['iteration']:4d}  loss {record['loss']:.4f}  "
                          f"{1e3 * record['time_s']:8.1f} ms  {rate:9.1f} samples/s")

        def on_event(event: dict[str, Any]) -> None:
            if event["type"] == "iteration":
                line(event)
            elif event["type"] == "restarted":
                bar.write(f"restart {event['number']}: stage {event['stage']} failed ({event['cause']}); back at "
                          f"iteration {event['snapshot']}, {event['replayed']} iteration(s) to replay"
                          + (f"; {event['note']}" if event.get("note") else ""))

        unsubscribe = session.on_event(on_event)
        session.run(args.iterations)
        session.wait(timeout=args.wait_timeout)
        unsubscribe()
        for record in session.metrics.records(args.iterations):  # what the event thread had not printed yet
            line(record)
        bar.close()
        _print_results(args, session, settings)
    return 0


def _print_results(args: argparse.Namespace, session: Any, settings: Settings) -> None:
    """The plan's table, memory per worker beside its prediction, the run's summary; the report and the run
    directory's files where asked for."""
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
    both = session.memory(ask=False)  # the planner's peak beside the allocator's, a row per worker
    _print_memory(session, memory, both)
    loss0, loss1 = frame["loss"].iloc[0], frame["loss"].iloc[-1]
    measured = float(steady["time_s"].median())
    print(f"{len(frame)} iterations: loss {loss0:.4f} -> {loss1:.4f}; median iteration "
          f"{human_time(measured)}, {float(steady['samples_per_s'].median()):.1f} samples/s "
          f"(cost model from the measured profile: {human_time(est.iteration_s)})")
    from vpipe_lab.cli.html_report import Provenance, write_report

    provenance = Provenance(shlex.join(["vpipe-lab", *getattr(args, "argv", sys.argv[1:])]), args.model,
                            session.plan.describe(), session.plan_version,
                            datetime.datetime.now().astimezone().isoformat(timespec="seconds"))
    if args.report:  # by stage: its largest rank's
        write_report(args.report, session, timeline, frame, memory, est, profile,
                     both.groupby("stage")["predicted_peak"].max().tolist(), provenance)
        print(f"report written to {args.report}")
    if settings.run_dir is not None:
        where = leave_run(Path(settings.run_dir), session, profile, cluster, settings, provenance, measured,
                          est.iteration_s)
        print(f"plan, profile, checkpoint and metrics in {where}")


def _print_memory(session: Any, memory: Any, both: Any) -> None:
    last = memory[memory["iteration"] == memory["iteration"].max()].sort_values(["stage", "replica"])
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


def leave_run(run_dir: Path, session: Any, profile: Any, cluster: Any, settings: Settings, provenance: Any,
              measured_s: float, predicted_s: float) -> Path:
    """What a headless run leaves for the shell's next steps: the plan in force (``vpipe-lab run --plan``,
    ``export --plan``), the measured profile and cluster (``vpipe-lab plan run/profile.json --cluster
    run/cluster.json``), a checkpoint of the last iteration (``--resume run/checkpoints``), ``run.json`` (what
    produced it) beside ``metrics.jsonl``, which the job wrote as it trained (``telemetry/runlog.py``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    every = settings.save_every
    if not (every and session.iteration % every == 0):  # the workers saved this iteration already otherwise
        session.save(run_dir / "checkpoints", keep=3)
    (run_dir / "plan.json").write_text(session.plan.to_json(indent=1))
    (run_dir / "profile.json").write_text(profile.to_json())
    (run_dir / "cluster.json").write_text(cluster.to_json())
    about = {"command": provenance.command, "model": provenance.model, "plan_version": provenance.plan_version,
             "iteration": session.iteration, "finished": provenance.finished, "measured_s": measured_s,
             "predicted_s": predicted_s}
    (run_dir / "run.json").write_text(json.dumps(about, indent=1) + "\n")
    return run_dir


def add_job_arguments(p: argparse.ArgumentParser, model_default: str | None) -> None:
    """What a job is made of, as ``launch()`` takes it, for `vpipe-lab run` and `vpipe-lab worker` alike (kept here,
    torch-free: parsing must not import the runtime)."""
    g = p.add_argument_group("the job's parts", "each a bundled example or package.module:attribute, importable "
                             "from this directory or the PYTHONPATH on every node")
    g.add_argument("--model", required=model_default is None, default=model_default,
                   help=f"bundled example ({', '.join(EXAMPLES)}) or package.module:factory (a zero-argument "
                   "callable returning an nn.Module)" + (f" (default: {model_default})" if model_default else ""))
    g.add_argument("--data", help="bundled example or package.module:data, data(iteration) -> (inputs, targets) or "
                   "an iterable of them (default: the model's, if bundled)")
    g.add_argument("--loss", help="package.module:loss, loss(output, targets)")
    g.add_argument("--optimizer", help="package.module:optimizer_factory, params -> Optimizer")
    g.add_argument("--lr-scheduler", help="package.module:attr, an optimizer -> scheduler factory")
    g.add_argument("--eval-data", help="evaluation data: a bundled example or package.module:attr")
    g.add_argument("--split", type=module_names, help="module names where units begin, comma-separated (as "
                   "launch(split=[...]); default: the model's repeated blocks)")
    p.add_argument("--plan", help="plan JSON to start from (default: an even split)" + (
        "; 'auto': profile two iterations, then plan with vpipe" if model_default else ""))


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `vpipe-lab worker`: what the job is made of and how to reach it; its settings are ``Settings``'
    fields (``core/settings_flags.py``)."""
    add_job_arguments(p, None)
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
    p = sub.add_parser("run", help="train a model in a pipeline of worker processes, headless: the bundled examples "
                       "or your own (package.module:factory)")
    add_job_arguments(p, "gpt-tiny")
    p.add_argument("--iterations", "-n", type=int, default=20)
    p.add_argument("--resume", help="a checkpoint to start from (Session.save's, --run-dir's checkpoints/, or a "
                   "torch.distributed.checkpoint of the same model), onto any stage count or schedule")
    p.add_argument("--wait-timeout", type=float, default=3600.0, help="give up after this many seconds")
    p.add_argument("--report", help="write an HTML report (summary, timeline, memory, loss) here")
    add_flags(p.add_argument_group("settings", "a job's settings (vpipe_lab.Settings), as launch() takes them"), "run")
    p.set_defaults(func=cmd_run)
