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
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vpipe_lab import examples
from vpipe_lab.core.settings import SettingError, Settings
from vpipe_lab.core.settings_flags import from_args
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


def _roles(args: argparse.Namespace) -> tuple[dict[str, str], dict[str, str]]:
    """What the job is made of, from the command line: bundled example names and 'package.module:attribute' names
    (importable on every node) by role; a bad one is refused before this rank joins the others."""
    named: dict[str, str] = {}
    imported: dict[str, str] = {}
    for role in ("model", "data", "loss", "optimizer", "lr_scheduler", "eval_data"):
        value = getattr(args, role)
        if value is None:
            continue
        if value in examples.EXAMPLES:
            named[role] = value
        elif ":" in value:
            imported[role] = value
        else:
            raise ValueError(f"--{role.replace('_', '-')} {value!r}: give a bundled example "
                             f"({', '.join(examples.EXAMPLES)}) or 'package.module:attribute'")
    return named, imported


def _key(args: argparse.Namespace, rank: int) -> str:
    if os.environ.get("VPIPE_LAB_KEY"):
        return os.environ["VPIPE_LAB_KEY"]
    path = Path(args.key_file)
    if rank == 0 and not path.exists():  # the first start makes one; clients read it from this file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, P.new_key().encode())
    return read_key(path) if rank == 0 else ""


def job_settings(args: argparse.Namespace) -> Settings:
    """This job's settings, validated before joining anything (``SettingError`` names a bad one in the words
    ``launch()`` uses): the flags, with the stage count torchrun's process count gives."""
    if getattr(args, "key", None):
        raise ValueError("--key puts the session key in this process's command line, which every user of the machine "
                         "can read (ps, /proc/PID/cmdline): export VPIPE_LAB_KEY=... or give --key-file FILE (mode 0600)")
    world, replicas, shards = _env("WORLD_SIZE"), args.replicas, getattr(args, "shards", 1)
    # else the settings' own check refuses them, by name
    counted = all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (replicas, shards))
    if counted and world % (replicas * shards):
        raise SettingError(f"shards={shards} x replicas={replicas} does not divide the {world} ranks torchrun "
                           "started: the job has stages x shards x replicas ranks (WORLD_SIZE)")
    stages = world // (replicas * shards) if counted else world
    return from_args(args, "worker", stages=stages).validated()


def _snapshots(settings: Settings, run_dir: Path | None) -> str | None:
    """Where this job's restart snapshots go: in the run directory unless ``--snapshot-every 0``, no run directory,
    the torch engine, or sharded stages (whose restart resumes from the run's checkpoints)."""
    if run_dir is None or settings.snapshot_every == 0 or settings.engine != "lab" or settings.shards > 1:
        return None
    return str(run_dir / "snapshots")


def _resume_point(run_dir: Path, stages: int, snapshots: str | None = None) -> dict[str, Any] | None:
    """Rank 0: where a restarted job continues: the newest complete snapshot (``snapshots``) or checkpoint in the run
    directory, whichever is newer; None for a first start."""
    from vpipe_lab.core.errors import ProfileError
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.core.planning.fewer import onto
    from vpipe_lab.wire import snapshot_format
    from vpipe_lab.wire.checkpoint_format import Manifest

    found: dict[str, Any] | None = None  # what the workers are told: path or snapshot, iteration, plan
    source = ""  # the directory it is read from, for the log
    root = run_dir / "checkpoints"
    if root.exists():
        try:
            manifest = Manifest.read(root)
            found = {"path": str(root.absolute()), "iteration": manifest.iteration, "plan": manifest.plan}
            source = str(manifest.directory)
        except ProfileError as exc:
            log.warning("not resuming from %s: %s", root, exc)
    newest = snapshot_format.newest(Path(snapshots)) if snapshots else None
    if newest is not None and newest[1].model_version != 0:
        log.warning("not resuming from %s: the model was changed with set_model, which a restarted worker cannot "
                    "rebuild", newest[0])
    elif newest is not None and newest[1].iteration > (found or {}).get("iteration", -1):
        where, meta = newest
        found, source = {"snapshot": str(where), "iteration": meta.iteration, "plan": meta.plan}, str(where)
    if found is None:
        return None
    what = f"the {'snapshot' if 'snapshot' in found else 'checkpoint'} of iteration {found['iteration']}"
    plan = Plan.from_dict(found["plan"])
    note = ""
    if plan.stages != stages:  # torchrun's elastic membership changed (a node left or came back): re-partition
        moved = onto(plan, stages)  # DCP keys are the model's own names: every stage reads its units, whoever wrote them
        note = (f"torchrun started {stages} stage(s) where {what} was taken on {plan.stages} (a node left or "
                f"joined): going on with {moved.how}")
        log.warning("%s", note)
        plan = moved.plan
    log.info("resuming from %s at iteration %d", source, found["iteration"])
    return {**found, "plan": plan.to_dict(), "note": note or f"resumed from {what}"}


def _join(backend: str, rank: int, world: int, timeout: timedelta) -> None:
    """Join torchrun's process group through its store, under a prefix of this attempt's own.

    torchrun's agent keeps one store for every attempt of a job (TCPStore sharing), and nothing takes the keys a
    process group wrote out of it: after a restart, a new rank could read a dead rank's address from the attempt before
    and fail with "Connection refused" (2 of 3 restarts by hand here). ``TORCHELASTIC_RESTART_COUNT`` names the
    attempt."""
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"vpipe_lab/attempt-{attempt}", store), rank=rank,
                            world_size=world, timeout=timeout)


def main(args: argparse.Namespace) -> int:
    settings = job_settings(args)
    named, imported = _roles(args)
    rank, world = _env("RANK"), _env("WORLD_SIZE")
    local_rank, local_world = _env("LOCAL_RANK"), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    pin_cores(settings.device, local_rank, local_world, settings.threads)
    torch.set_num_threads(settings.threads)
    placement = select(settings.device, local_rank, local_world)
    _join(placement.backend, rank, world, timedelta(seconds=settings.timeout))
    peer = Peer(rank, world, placement.device if placement.is_cuda else torch.device("cpu"), settings.timeout)
    job = JobInfo(uuid.uuid4().hex[:12], settings.to_json(), os.environ.get("MASTER_ADDR", ""),
                  int(os.environ.get("MASTER_PORT", "0")))
    broker = runlog = None
    shared: dict[str, Any] | None = None
    run_dir = Path(settings.run_dir).absolute() if settings.run_dir else None
    snapshot_dir = _snapshots(settings, run_dir)
    if rank == 0:
        resume = _resume_point(run_dir, settings.stages, snapshot_dir) if run_dir is not None else None
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

            runlog = runlogs.RunLog(run_dir, settings.stages, resume["iteration"] if resume else 0,
                                    open_sink(settings.log), replicas=settings.data_parallel,
                                    note=resume["note"] if resume else "")
            broker.observer = runlog.observe
            key_file = None if os.environ.get("VPIPE_LAB_KEY") else str(Path(args.key_file).absolute())
            where = runlogs.write_attach(run_dir, broker.frontend, socket.gethostname(), key_file)
            log.info("how to attach: %s", where)
    # Every rank learns the key, the backend and the job's id over the process group it already trusts.
    shared = peer.broadcast_json(shared)
    assert shared is not None
    spec = JobSpec(session_id=shared["session"], key=shared["key"], address=shared["backend"],
                   master_addr=job.master_addr, master_port=job.master_port,
                   settings=replace(settings, run_dir=str(run_dir) if run_dir is not None else None),
                   snapshot_dir=snapshot_dir)
    resume = shared.get("resume")
    if resume is not None:
        spec.resume_path, spec.restore_snapshot = resume.get("path"), resume.get("snapshot")
        spec.start_iteration, spec.plan = resume["iteration"], resume["plan"]
    spec.examples, spec.imports, spec.split = named, imported, args.split
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
