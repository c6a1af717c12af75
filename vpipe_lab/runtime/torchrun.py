"""A stage worker under torchrun (one process per stage, across nodes): ``vpipe-lab worker --model ... --data ...``.

torchrun (c10d rendezvous) sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and MASTER_ADDR/PORT. Rank 0 serves the
control endpoint (a broker): ranks connect to its backend, notebooks attach to its frontend, which listens on
loopback unless ``--control-host`` says otherwise and refuses anything not signed with the session key. The job
runs on its own: attaching, detaching and re-attaching never pause it; STOP from a client ends it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab import examples
from vpipe_lab.runtime.broker import Broker
from vpipe_lab.runtime.engine.comm import Peer
from vpipe_lab.runtime.engine.device import pin_cores, select
from vpipe_lab.runtime.process import serve
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Link
from vpipe_lab.wire.events import Hello, JobInfo
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.private import read_key, write_private

log = logging.getLogger("vpipe_lab.torchrun")


def _env(name: str) -> int:
    if name not in os.environ:
        raise RuntimeError(f"{name} is not set: run `vpipe-lab worker` under torchrun, which sets RANK, WORLD_SIZE, "
                           "LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
    return int(os.environ[name])


def _role(value: str | None, role: str, spec: JobSpec) -> None:
    """A bundled example name, or 'package.module:attribute' importable on every node."""
    if value is None:
        return
    if value in examples.EXAMPLES:
        spec.examples[role] = value
    elif ":" in value:
        spec.imports[role] = value
    else:
        raise ValueError(f"--{role} {value!r}: give a bundled example ({', '.join(examples.EXAMPLES)}) or "
                         "'package.module:attribute'")


def _key(args: argparse.Namespace, rank: int) -> str:
    if args.key:
        return str(args.key)
    if os.environ.get("VPIPE_LAB_KEY"):
        return os.environ["VPIPE_LAB_KEY"]
    path = Path(args.key_file)
    if rank == 0 and not path.exists():  # the first start makes one; clients read it from this file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, P.new_key().encode())
    return read_key(path) if rank == 0 else ""


def _check(args: argparse.Namespace) -> None:
    """Refuse options that cannot work before joining anything, naming the value."""
    from vpipe_lab.telemetry.sinks import check
    from vpipe_lab.wire.jobspec import check_training

    check_training(args.clip_grad_norm, args.precision, args.eval_every, args.eval_batches)
    from vpipe_lab.wire.jobspec import engine_refusal

    if problem := engine_refusal(args.engine, args.replicas, args.precision, args.schedule):
        raise ValueError(f"--engine {args.engine}: {problem}")
    check(args.log)
    from vpipe_lab.core import schedules  # as launch() refuses (a --plan file's schedule meets the stage's own check)

    if problem := schedules.get(args.schedule).training_refusal(args.clip_grad_norm, args.precision, args.replicas):
        raise ValueError(f"--schedule {args.schedule}: {problem}")
    for name in ("iterations", "save_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.save_every and not args.run_dir:
        raise ValueError("--save-every needs --run-dir: where the checkpoints go")


def _resume_point(run_dir: Path, stages: int) -> dict[str, Any] | None:
    """Rank 0: the newest complete checkpoint in the run directory, if any (a restarted job continues from it)."""
    from vpipe_lab.core.errors import ProfileError
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.core.planning.fewer import onto
    from vpipe_lab.wire.checkpoint import Manifest

    root = run_dir / "checkpoints"
    if not root.exists():
        return None
    try:
        manifest = Manifest.read(root)
    except ProfileError as exc:
        log.warning("not resuming from %s: %s", root, exc)
        return None
    plan = Plan.from_dict(manifest.plan)
    note = ""
    if plan.stages != stages:  # torchrun's elastic membership changed (a node left or came back): re-partition
        moved = onto(plan, stages)  # DCP keys are the model's own names: every stage reads its units, whoever wrote them
        note = (f"torchrun started {stages} stage(s) where the checkpoint of iteration {manifest.iteration} was taken on "
                f"{plan.stages} (a node left or joined): going on with {moved.how}")
        log.warning("%s", note)
        plan = moved.plan
    log.info("resuming from %s at iteration %d", manifest.directory, manifest.iteration)
    return {"path": str(root.absolute()), "iteration": manifest.iteration, "plan": plan.to_dict(), "note": note}


def main(args: argparse.Namespace) -> int:
    _check(args)
    rank, world = _env("RANK"), _env("WORLD_SIZE")
    local_rank, local_world = _env("LOCAL_RANK"), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    pin_cores(args.device, local_rank, local_world, args.threads)
    torch.set_num_threads(args.threads)
    placement = select(args.device, local_rank, local_world)
    dist.init_process_group(placement.backend, init_method="env://", timeout=timedelta(seconds=args.timeout))
    peer = Peer(rank, world, placement.device if placement.is_cuda else torch.device("cpu"), args.timeout)
    if args.replicas < 1 or world % args.replicas:
        raise ValueError(f"--replicas {args.replicas} does not divide the {world} ranks torchrun started: the job "
                         "has stages x replicas ranks")
    stages = world // args.replicas
    budget = [args.memory_budget] * stages if args.memory_budget else None
    job = JobInfo(uuid.uuid4().hex[:12], stages, args.microbatches, args.schedule, args.device, args.seed,
                  args.timeout, args.replicas, budget, os.environ.get("MASTER_ADDR", ""),
                  int(os.environ.get("MASTER_PORT", "0")))
    broker = runlog = None
    shared: dict[str, Any] | None = None
    run_dir = Path(args.run_dir).absolute() if args.run_dir else None
    if rank == 0:
        resume = _resume_point(run_dir, stages) if run_dir is not None else None
        key = _key(args, rank)
        master = socket.gethostbyname(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        backend = f"tcp://{master}:{args.backend_port}" if args.backend_port else f"tcp://{master}:0"
        broker = Broker(key, backend.replace(":0", ":*") if backend.endswith(":0") else backend,
                        f"tcp://{args.control_host}:{args.control_port or '*'}", job)
        shared = {"key": key, "backend": broker.backend, "session": job.session_id, "resume": resume}
        log.info("control endpoint for clients: %s (backend for ranks: %s)", broker.frontend, broker.backend)
        if run_dir is not None:
            from vpipe_lab.telemetry import runlog as runlogs
            from vpipe_lab.telemetry.sinks import open_sink

            runlog = runlogs.RunLog(run_dir, stages, resume["iteration"] if resume else 0, open_sink(args.log),
                                    replicas=args.replicas, note=resume["note"] if resume else "")
            broker.observer = runlog.observe
            key_file = None if (args.key or os.environ.get("VPIPE_LAB_KEY")) else str(Path(args.key_file).absolute())
            where = runlogs.write_attach(run_dir, broker.frontend, socket.gethostname(), key_file)
            log.info("how to attach: %s", where)
    # Every rank learns the key, the backend and the job's id over the process group it already trusts.
    shared = peer.broadcast_json(shared)
    assert shared is not None
    spec = JobSpec(session_id=shared["session"], key=shared["key"], address=shared["backend"],
                   master_addr=job.master_addr, master_port=job.master_port, stages=stages,
                   replicas=args.replicas,
                   microbatches=args.microbatches, schedule=args.schedule, device=args.device, seed=args.seed,
                   memory_budget=budget, timeout_s=args.timeout, threads=args.threads,
                   clip_grad_norm=args.clip_grad_norm, precision=args.precision, eval_every=args.eval_every,
                   eval_batches=args.eval_batches, iterations=args.iterations, save_every=args.save_every,
                   fused_wgrad=args.fused_wgrad, engine=args.engine,
                   run_dir=str(run_dir) if run_dir is not None else None)
    resume = shared.get("resume")
    if resume is not None:
        spec.resume_path, spec.start_iteration, spec.plan = resume["path"], resume["iteration"], resume["plan"]
    _role(args.model, "model", spec)
    _role(args.data, "data", spec)
    _role(args.loss, "loss", spec)
    _role(args.optimizer, "optimizer", spec)
    _role(args.lr_scheduler, "lr_scheduler", spec)
    _role(args.eval_data, "eval_data", spec)
    if args.plan and resume is None:
        from vpipe_lab.core.plan import Plan

        spec.plan = Plan.from_json(Path(args.plan)).to_dict()
    link = Link(spec.address, spec.key, f"rank{rank}", session=spec.session_id)
    link.send(Hello(rank, os.getpid(), socket.gethostname()).message())
    try:
        return serve(spec, rank, world, local_rank, local_world, link)
    finally:
        if broker is not None:
            broker.close()
        if runlog is not None:
            runlog.close()
