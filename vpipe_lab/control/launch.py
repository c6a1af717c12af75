"""Starting a pipeline (``launch``) and attaching to one that torchrun started (``attach``)."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import replace
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from vpipe_lab.control.lifecycle import Joining, Opening
from vpipe_lab.control.session import Session
from vpipe_lab.control.workers import unit_preview
from vpipe_lab.control.workers.processes import JOB_DIR_PREFIX, Launcher, reap_stale
from vpipe_lab.core import schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.core.settings import Settings
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Client, Hub
from vpipe_lab.wire.checkpoint_format import Manifest, is_foreign
from vpipe_lab.wire.jobspec import JobSpec
from vpipe_lab.wire.private import DEFAULT_KEY_FILE, read_key, write_private


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def launch(model: Any, data: Any = None, *, loss: Any = None, optimizer: Any = None, lr_scheduler: Any = None,
           eval_data: Any = None, split: Sequence[str] | Any = None, plan: Plan | None = None,
           resume: str | Path | None = None, settings: Settings | None = None, **options: Any) -> Session:
    """Start one worker process per stage and return the Session once every stage is ready (training not started).

    What the job trains: ``model`` is any ``nn.Module``, a zero-argument callable returning one (built in each worker
    after ``torch.manual_seed(seed)``), a bundled example name, or ``"package.module:attribute"`` naming one (each
    worker imports it from this directory or the PYTHONPATH; so do the other parts below, as ``vpipe-lab run`` names
    them). An ``nn.Sequential``'s children are the partition units; any other model is captured with torch.export and
    cut at its repeated blocks (each transformer layer, each ResNet block), or at ``split``: module names
    (``["transformer.h.4", ...]``) or a function ``(name, module) -> bool`` choosing where units begin. ``data`` is
    ``data(iteration) -> (inputs, targets)`` (deterministic per iteration), any iterable of ``(inputs, targets)`` such
    as a DataLoader, or a bundled example name (default: the model's, when the model is one); inputs are a tensor, a
    tuple of positional arguments or a dict of keyword arguments. ``loss(output, targets)`` gets the model's own output
    object (default: the output's ``loss`` when targets are None, else cross-entropy / MSE on the logits). ``optimizer``
    is ``params -> Optimizer``; ``lr_scheduler`` is ``optimizer -> scheduler`` (stepped once per iteration, carried
    through migration and checkpoints); ``eval_data`` (like ``data``) is what ``eval_every`` evaluates (see
    ``Session.evaluate``). ``plan`` is the partition and per-layer policies to start from (default: an even split); its
    stages, micro-batches, schedule and chunks are the job's unless given. ``resume`` restores a ``Session.save()``
    checkpoint (parameters, optimizer state, plan unless ``plan`` is given, iteration) onto any partition, stage count
    or schedule, or a torch.distributed.checkpoint directory another job wrote of the same model (its ``state_dict()``
    keys, read without running code).

    How it trains: every other keyword (``stages=``, ``microbatches=``, ``schedule=``, ``precision=``, ...) is a
    field of ``vpipe_lab.Settings``, each with its default, help and check (``core/settings.py``); or pass a whole
    ``settings=Settings(...)`` and keywords over it. They are checked together before anything starts, with the words
    ``%vpipe start``, ``vpipe-lab run`` and ``vpipe-lab worker`` use. Among them: ``nonfinite`` says what a NaN or
    infinite loss does ("pause", the default, pauses before that iteration's optimizer step and ``wait()`` raises
    ``NonFiniteLoss``; "skip"; "continue"); ``replicas=R`` trains R data-parallel copies of the pipeline, gradients
    averaged per stage (``runtime/training/replicas.py``); ``shards=K`` shards each stage over K ranks with FSDP2
    (``runtime/engine/shards.py``: stages x K x R processes); ``virtual_stages`` V gives each stage V chunks under
    interleaved-1f1b (looped) or zbv (a V: stage s holds chunks s and 2 stages - 1 - s, stage 0 computes the loss);
    ``engine="torch"`` trains on torch.distributed.pipelining's runtime with the lab around it
    (``runtime/torch_pp/engine.py``); ``max_restarts=N`` replaces a worker that dies, raises or hangs and replays from
    the newest snapshot (``control/workers/restarts.py``); ``auto_replan`` turns on vPipe's online replanning."""
    settings = job_settings(settings, options, plan)
    plan, manifest = _plan_to_run(plan, resume, settings)
    named, imported, user = _roles(settings.stages, model=model, data=data, loss=loss, optimizer=optimizer,
                                   lr_scheduler=lr_scheduler, eval_data=eval_data, split=split)
    reap_stale()
    job_dir = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX))
    session_id = uuid.uuid4().hex[:12]
    callables_path, blob = _write_callables(job_dir, user)
    model_key = unit_preview.fingerprint(blob, {**named, **{f"{role} from": v for role, v in imported.items()}})
    seen = unit_preview.known(model_key)
    if seen is not None:
        unit_preview.check(settings.stages, seen)  # this model was launched before: refused before any worker starts
    scout = _scouts(settings, seen is not None or "model" in named)
    key = P.new_key()
    hub = Hub(key, settings.host, session=session_id)
    spec = JobSpec(
        session_id=session_id, key=key, address=hub.address, master_addr=settings.host,
        master_port=_free_port(settings.host), settings=settings,
        plan=plan.to_dict() if plan is not None else None,
        callables_path=str(callables_path) if callables_path else None, job_dir=str(job_dir), examples=named,
        imports=imported, start_iteration=manifest.iteration if manifest else 0,
        resume_path=str(Path(resume).absolute()) if resume is not None else None, scout=scout,
        snapshot_dir=str(job_dir / "snapshots") if settings.max_restarts else None,
    )
    spec_path = job_dir / "job.json"
    spec.save(spec_path)
    launcher = Launcher(session_id, job_dir)
    opening = Opening(launcher, spec_path, model_key, settings.log, settings.max_restarts,
                      manifest.plan_version if manifest is not None else 0)
    session = Session(spec, hub, launcher, job_dir, model=model, opening=opening)
    if settings.auto_replan:
        replan = settings.auto_replan
        session.auto_replan(**(replan if isinstance(replan, dict) else {}))
    return session


def _scouts(settings: Settings, units_known: bool) -> bool:
    """Whether rank 0 starts alone first: many workers would start and the model's units are not known (the others
    start if the units fill them), or the batch is split over data-parallel ranks (a first batch they cannot share
    is refused in one line before the others start)."""
    return settings.data_parallel > 1 or (not units_known and settings.workers > unit_preview.SCOUT_ABOVE)


def job_settings(given: Settings | None, options: dict[str, Any], plan: Plan | None) -> Settings:
    """The settings ``launch()`` runs, validated: ``given`` (else the defaults) with ``options`` over it; what a plan
    fixes (stages, micro-batches, schedule, chunks) is the plan's where neither says otherwise."""
    Settings.of("api", **options)  # an unknown name, or one only a torchrun job takes: a TypeError saying so
    base = given if given is not None else Settings()
    if plan is not None and given is None:
        taken = {"stages": plan.stages, "microbatches": plan.microbatches, "schedule": plan.schedule,
                 "virtual_stages": plan.virtual_stages}
        options = {**{k: v for k, v in taken.items() if k not in options}, **options}
    return replace(base, **options).validated()


def _plan_to_run(plan: Plan | None, resume: str | Path | None,
                 settings: Settings) -> tuple[Plan | None, Manifest | None]:
    """The plan the job starts on (None: the workers split evenly) and the lab checkpoint it resumes, if any."""
    stages, microbatches, schedule = settings.stages, settings.microbatches, settings.schedule
    virtual_stages = settings.chunks
    manifest = None
    if resume is not None and not is_foreign(resume):  # torch's own DCP checkpoint: weights by name, no plan in it
        manifest = Manifest.read(resume)
        if plan is None:
            saved = Plan.from_dict(manifest.plan)
            # Tensors are saved by name, so a checkpoint resumes onto another partition and stage count too.
            same = (saved.stages, saved.virtual_stages) == (stages, virtual_stages)
            plan = saved if same else Plan(uniform(manifest.num_layers, stages * virtual_stages), saved.policies,
                                           saved.microbatches, schedule, virtual_stages)
            plan = plan.replace(microbatches=microbatches, schedule=schedule)
    if plan is not None:
        plan = plan.validate(stages=stages)
        if (plan.microbatches, plan.schedule, plan.virtual_stages) != (microbatches, schedule, virtual_stages):
            raise PlanError(f"the plan is for {plan.schedule} with {plan.microbatches} micro-batches and "
                            f"{plan.virtual_stages} virtual stages but the session runs {schedule} with {microbatches} "
                            f"and {virtual_stages}; make them agree")
    return plan, manifest


def _roles(stages: int, **roles: Any) -> tuple[dict[str, str], dict[str, str], dict[str, Any]]:
    """What the job is made of: bundled example names by role (a bundled model brings its own data, loss and
    optimizer unless given), ``package.module:attribute`` names by role (each worker imports its own) and the user's
    own objects by role (pickled for the workers)."""
    from vpipe_lab import examples

    split = roles["split"]
    if isinstance(split, str) and ":" not in split:
        split = [split]
    if split is not None and not callable(split) and not isinstance(split, str) and (
            not all(isinstance(n, str) and n for n in split)):
        raise ValueError(f"split must be a list of module names or a function (name, module) -> bool, got {split!r}")
    roles["split"] = None if split is None else (split if callable(split) or isinstance(split, str) else list(split))
    named: dict[str, str] = {}
    imported: dict[str, str] = {}
    user: dict[str, Any] = {}
    for role, value in roles.items():
        if isinstance(value, str) and ":" in value:
            imported[role] = _importable(role, value)
        elif isinstance(value, str):
            if role in ("lr_scheduler", "split"):
                raise ValueError(f"{role}={value!r}: give a function or 'package.module:attribute', not a name")
            examples.check(value)  # fails early with the list of names (imports nothing: no torch here)
            named[role] = value
        elif value is not None:
            user[role] = value
    model = roles["model"]
    if isinstance(model, str) and "model" in named:
        examples.check_stages(model, stages)
        for role in ("data", "loss", "optimizer"):
            if role not in named and role not in user and role not in imported:
                named[role] = model
    if not any("data" in given for given in (named, imported, user)):
        raise ValueError("no data: pass data(iteration) -> (inputs, targets), an iterable of (inputs, targets) such "
                         "as a DataLoader, 'package.module:attribute' naming one, or a bundled example name")
    return named, imported, user


def _importable(role: str, value: str) -> str:
    """``value`` if it reads ``package.module:attribute`` and its top package is importable where the workers look
    (this directory first, as ``python -m`` has it, then ``sys.path``); found without importing anything, so a
    misspelt name is refused before a worker starts, not after a model is built."""
    module, _, attr = value.partition(":")
    if not all(part.isidentifier() for part in (*module.split("."), attr)):
        raise ValueError(f"{role}={value!r}: write 'package.module:attribute' (e.g. 'mypkg.models:build')")
    top = module.split(".")[0]
    if top not in sys.modules and PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
        raise ValueError(f"{role}={value!r}: there is no module {top!r} in {os.getcwd()} or on sys.path; the workers "
                         "import it from there (run from the directory that holds it, or add it to PYTHONPATH)")
    return value


def _write_callables(job_dir: Path, user: dict[str, Any]) -> tuple[Path | None, bytes | None]:
    """The user's objects (and the schedules registered in this process, which the workers register too), pickled
    into the job directory for the workers (never sent over a socket): the file and its bytes (None: nothing)."""
    if added := schedules.added():
        user["schedules"] = added
    if not user:
        return None, None
    import cloudpickle

    path, blob = job_dir / "callables.pkl", cloudpickle.dumps(user)
    write_private(path, blob)
    return path, blob


def attach(address: str, *, key: str | None = None, key_file: str | Path | None = None,
           timeout: float = 30.0) -> Session:
    """The Session of a running job whose rank 0 serves ``address`` (a torchrun job: ``vpipe-lab worker``).

    ``key`` is the job's session key, or it is read from ``key_file`` (default: the file rank 0 writes,
    ``~/.cache/vpipe_lab/torchrun.key``), which must not be readable by other users.

    Everything a launched Session does works (metrics, dashboard, apply and live migration, replan, stop) except
    what needs the local job directory; ``detach()`` lets go while training continues, ``attach`` again later.
    """
    if not address.startswith("tcp://"):
        address = f"tcp://{address}"
    if key is None:
        key = read_key(key_file if key_file is not None else DEFAULT_KEY_FILE)
    client = Client(address, key, timeout=timeout)
    welcome = client.welcome
    assert welcome is not None  # Client() returns only once it was welcomed
    return Session(welcome.job.to_spec(key, address), client, launcher=None, job_dir=None,
                   joining=Joining(client, welcome, timeout))
