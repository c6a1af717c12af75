"""Starting a pipeline (``launch``) and attaching to one that torchrun started (``attach``)."""

from __future__ import annotations

import socket
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vpipe_lab.control.session import Session
from vpipe_lab.control.workers import units
from vpipe_lab.control.workers.processes import JOB_DIR_PREFIX, Launcher, reap_stale
from vpipe_lab.core import checks, schedules
from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.plan import Plan, default_virtual_stages
from vpipe_lab.core.planning.partition import uniform
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Client, Hub
from vpipe_lab.wire.checkpoint import Manifest, is_foreign
from vpipe_lab.wire.jobspec import DEVICES, JobSpec, check_nonfinite, check_training, engine_refusal
from vpipe_lab.wire.private import DEFAULT_KEY_FILE, read_key, write_private


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _budgets(memory_budget: int | Sequence[int] | None, stages: int) -> list[int] | None:
    if memory_budget is None:
        return None
    if isinstance(memory_budget, int) and not isinstance(memory_budget, bool):
        return [memory_budget] * stages
    budgets = list(memory_budget)
    if len(budgets) != stages or not all(isinstance(b, int) and b > 0 for b in budgets):
        raise ValueError(f"memory_budget must be bytes per stage: one positive int or {stages} of them, "
                         f"got {memory_budget!r}")
    return budgets


def launch(
    model: Any,
    data: Any = None,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    loss: Any = None,
    optimizer: Any = None,
    device: str = "auto",
    memory_budget: int | Sequence[int] | None = None,
    plan: Plan | None = None,
    seed: int = 0,
    telemetry: bool = True,
    timeout: float = 120.0,
    threads: int = 1,
    start_timeout: float = 120.0,
    host: str = "127.0.0.1",
    resume: str | Path | None = None,
    auto_replan: bool | dict[str, Any] = False,
    split: Sequence[str] | Any = None,
    lr_scheduler: Any = None,
    clip_grad_norm: float | None = None,
    precision: str = "fp32",
    nonfinite: str = "pause",
    eval_data: Any = None,
    eval_every: int | None = None,
    eval_batches: int = 1,
    log: Any = None,
    replicas: int = 1,
    fused_wgrad: bool | int = True,
    virtual_stages: int | None = None,
    engine: str = "lab",
    max_restarts: int = 0,
    snapshot_every: int | None = None,
) -> Session:
    """Start one worker process per stage and return the Session once every stage is ready (training not started).

    ``model`` is any ``nn.Module``, a zero-argument callable returning one (built in each worker after
    ``torch.manual_seed(seed)``), or a bundled example name. An ``nn.Sequential``'s children are the partition units;
    any other model is captured with torch.export and cut at its repeated blocks (each transformer layer, each
    ResNet block), or at ``split``: module names (``["transformer.h.4", ...]``) or a function ``(name, module) ->
    bool`` choosing where units begin. ``data`` is ``data(iteration) -> (inputs, targets)`` (deterministic per
    iteration), any iterable of ``(inputs, targets)`` such as a DataLoader, or a bundled example name (default: the
    model's, when the model is one); inputs are a tensor, a tuple of positional arguments or a dict of keyword
    arguments. ``loss(output, targets)`` gets the model's own output object (default: the output's ``loss`` when
    targets are None, else cross-entropy / MSE on the logits).
    ``resume`` restores a ``Session.save()`` checkpoint (parameters, optimizer state, plan unless ``plan`` is given,
    iteration) onto any partition, stage count or schedule, or a torch.distributed.checkpoint directory another job
    wrote of the same model (its ``state_dict()`` keys; optimizer state where it holds torch's flattened layout);
    ``auto_replan`` turns on vPipe's online replanning (True, or the options of ``Session.auto_replan``).

    A training job's other parts: ``lr_scheduler`` is ``optimizer -> scheduler`` (stepped once per iteration, carried
    through migration and checkpoints); ``clip_grad_norm`` clips by the global 2-norm over every stage, as
    ``torch.nn.utils.clip_grad_norm_`` does on the whole model; ``precision`` is "fp32", "bf16" or "fp16" (autocast,
    float32 master weights, a loss scale all stages agree on); ``nonfinite`` says what a NaN or infinite loss does:
    "pause" (default) pauses before that iteration's optimizer step with nothing changed and ``wait()`` raises
    ``NonFiniteLoss`` naming the iteration and micro-batch, "skip" skips that step on every stage and trains on,
    "continue" trains on it; ``eval_data`` (like ``data``) is evaluated every
    ``eval_every`` iterations on ``eval_batches`` batches (see ``Session.evaluate``); ``log`` sends the metrics to
    "tensorboard:DIR", "wandb:PROJECT", "mlflow:URI" or a function (see ``telemetry/sinks.py``). ``replicas=R``
    trains R data-parallel copies of the pipeline (stages x R worker processes), each on 1/R of every batch, with
    gradients averaged per stage across them (see ``runtime/training/replicas.py``). ``fused_wgrad`` (default True) has every
    ``nn.Linear`` (and HuggingFace ``Conv1D``) whose weight has at least 2**18 elements add its weight gradient
    into ``.grad`` inside the backward's GEMM, not as a new tensor added afterwards: one pass over each weight less
    per micro-batch (see ``runtime/engine/wgrad.py``); a number sets that size (0: every linear layer), False turns it off.
    ``virtual_stages`` V > 1 (with ``schedule="interleaved-1f1b"``; unless given, the plan's, else 2) gives each
    stage V chunks of the model in looped placement; the plan then has ``stages * V + 1`` boundaries (see
    ``core/schedules/orders/interleaved.py``).
    ``schedule="zbv"`` gives each stage two chunks in V placement (``core/schedules/orders/zbv.py``): stage s holds chunks s and
    2 stages - 1 - s, and stage 0 computes the loss.
    ``engine="torch"`` trains the plan on torch.distributed.pipelining's own runtime (the plan's export bundle, as
    ``vpipe_lab.export.torch_pipeline`` builds it) with the lab around it: metrics, timeline and memory stream as
    usual, and a plan change applies at the next iteration as a reshard (``runtime/torch_engine.py``). It runs one
    pipeline in fp32 without PipeDream; the default ``"lab"`` is vpipe_lab's engine with live layer migration.
    ``max_restarts=N`` (torchrun's word): a worker that dies, raises or hangs (no progress within ``timeout``) is
    replaced, the pipeline goes back to its newest snapshot (taken every ``snapshot_every`` iterations, by default as
    often as costs at most ~5% of training) and replays the lost iterations on the same batches; ``wait()`` does
    not raise. The N+1st failure ends the job as without restarts (``control/workers/restarts.py``).
    """
    from vpipe_lab.telemetry import sinks

    virtual_stages = _check_settings(stages, microbatches, schedule, device, clip_grad_norm, precision, eval_every,
                                     eval_batches, fused_wgrad, replicas, engine, virtual_stages, plan)
    check_nonfinite(nonfinite)
    _check_timeouts(timeout=timeout, start_timeout=start_timeout)
    _check_restarts(max_restarts, snapshot_every, engine)
    sinks.check(log)
    plan, manifest = _plan_to_run(plan, resume, stages, microbatches, schedule, virtual_stages)
    named, user = _roles(stages, model=model, data=data, loss=loss, optimizer=optimizer, lr_scheduler=lr_scheduler,
                         eval_data=eval_data, split=split)
    reap_stale()
    job_dir = Path(tempfile.mkdtemp(prefix=JOB_DIR_PREFIX))
    session_id = uuid.uuid4().hex[:12]
    callables_path, blob = _write_callables(job_dir, user)
    model_key = units.fingerprint(blob, named)
    seen = units.known(model_key)
    if seen is not None:
        units.check(stages, seen)  # this model was launched before: refused before any worker starts
    # Rank 0 cuts the model alone first when many workers would start: the others start only if it fills them.
    scout = seen is None and stages * replicas > units.SCOUT_ABOVE and not isinstance(model, str)
    key = P.new_key()
    hub = Hub(key, host, session=session_id)
    spec = JobSpec(
        session_id=session_id, key=key, address=hub.address, master_addr=host, master_port=_free_port(host),
        stages=stages, microbatches=microbatches, schedule=schedule, device=device, seed=seed,
        plan=plan.to_dict() if plan is not None else None, memory_budget=_budgets(memory_budget, stages),
        telemetry=telemetry, timeout_s=timeout, threads=threads,
        callables_path=str(callables_path) if callables_path else None, job_dir=str(job_dir), examples=named,
        start_iteration=manifest.iteration if manifest else 0,
        resume_path=str(Path(resume).absolute()) if resume is not None else None,
        clip_grad_norm=None if clip_grad_norm is None else float(clip_grad_norm), precision=precision,
        nonfinite=nonfinite,
        eval_every=eval_every, eval_batches=eval_batches, replicas=replicas, fused_wgrad=fused_wgrad, scout=scout,
        virtual_stages=virtual_stages, engine=engine,
        snapshot_dir=str(job_dir / "snapshots") if max_restarts else None, snapshot_every=snapshot_every,
    )
    spec_path = job_dir / "job.json"
    spec.save(spec_path)
    launcher = Launcher(session_id, job_dir)
    session = Session(spec, hub, launcher, job_dir, model=model)
    hub.set_handler(session.receive)
    try:
        session.logger.sink = sinks.open_sink(log)
    except Exception:
        session.stop()
        raise
    _start_workers(session, launcher, spec_path, model_key, start_timeout)
    if max_restarts:
        session.restart_on_failure(max_restarts, start_timeout)
    if manifest is not None:
        session.state.plan_version = manifest.plan_version
    if auto_replan:
        session.auto_replan(**(auto_replan if isinstance(auto_replan, dict) else {}))
    return session


def _check_settings(stages: int, microbatches: int, schedule: str, device: str, clip_grad_norm: float | None,
                    precision: str, eval_every: int | None, eval_batches: int, fused_wgrad: bool | int,
                    replicas: int, engine: str, virtual_stages: int | None, plan: Plan | None) -> int:
    """Refuse settings no job can run (ValueError naming the value and what would work); returns the chunks per
    stage: ``virtual_stages``, else the plan's, else the schedule's default."""
    checks.count(stages, "stages")
    checks.count(microbatches, "microbatches")
    if schedule not in schedules.names():
        raise ValueError(f"unknown schedule {schedule!r}: use one of {', '.join(schedules.names())}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    check_training(clip_grad_norm, precision, eval_every, eval_batches)
    if not isinstance(fused_wgrad, int) or fused_wgrad < 0:  # True and False are meant here: not a count
        raise ValueError(f"fused_wgrad must be True, False or the smallest weight to fuse (elements, >= 0), got "
                         f"{fused_wgrad!r}")
    checks.count(replicas, "replicas")
    if problem := engine_refusal(engine, replicas, precision, schedule):
        raise ValueError(problem)
    if virtual_stages is None:  # the given plan's chunks per stage, else the schedule's default
        virtual_stages = plan.virtual_stages if plan is not None else default_virtual_stages(schedule)
    checks.count(virtual_stages, "virtual_stages")
    if problem := schedules.job_refusal(schedule, stages=stages, microbatches=microbatches,
                                        virtual_stages=virtual_stages, clip_grad_norm=clip_grad_norm,
                                        precision=precision, replicas=replicas):
        raise ValueError(problem)
    return virtual_stages


def _check_timeouts(**timeouts: Any) -> None:
    """A timeout is a number of seconds the workers and the controller wait at most: None (or anything else) would be
    accepted here and fail in the workers, so it is refused before anything starts."""
    for name, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"{name}={value!r}: give the seconds to wait at most (a number > 0); a stuck worker is "
                             "found only by a timeout")


def _check_restarts(max_restarts: int, snapshot_every: int | None, engine: str) -> None:
    checks.count(max_restarts, "max_restarts", 0)
    checks.count(snapshot_every, "snapshot_every", optional=True)
    if max_restarts and engine != "lab":
        raise ValueError(f"max_restarts={max_restarts} needs engine='lab' (the torch engine takes no snapshots); "
                         "under torchrun, torchrun's own --max-restarts restarts the job from its checkpoints")
    if snapshot_every is not None and not max_restarts:
        raise ValueError(f"snapshot_every={snapshot_every} without max_restarts: snapshots are for restarts; "
                         "give max_restarts=N too (Session.save writes a checkpoint whenever you like)")


def _plan_to_run(plan: Plan | None, resume: str | Path | None, stages: int, microbatches: int, schedule: str,
                 virtual_stages: int) -> tuple[Plan | None, Manifest | None]:
    """The plan the job starts on (None: the workers split evenly) and the lab checkpoint it resumes, if any."""
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


def _roles(stages: int, **roles: Any) -> tuple[dict[str, str], dict[str, Any]]:
    """What the job is made of: bundled example names by role (a bundled model brings its own data, loss and
    optimizer unless given) and the user's own objects by role (pickled for the workers)."""
    from vpipe_lab import examples

    split = roles["split"]
    if isinstance(split, str):
        split = [split]
    if split is not None and not callable(split) and (not all(isinstance(n, str) and n for n in split)):
        raise ValueError(f"split must be a list of module names or a function (name, module) -> bool, got {split!r}")
    roles["split"] = None if split is None else (split if callable(split) else list(split))
    named: dict[str, str] = {}
    user: dict[str, Any] = {}
    for role, value in roles.items():
        if isinstance(value, str):
            if role in ("lr_scheduler", "split"):
                raise ValueError(f"{role}={value!r}: give a function, not a name")
            examples.check(value)  # fails early with the list of names (imports nothing: no torch here)
            named[role] = value
        elif value is not None:
            user[role] = value
    model = roles["model"]
    if isinstance(model, str):
        examples.check_stages(model, stages)
        for role in ("data", "loss", "optimizer"):
            if role not in named and role not in user:
                named[role] = model
    if "data" not in named and "data" not in user:
        raise ValueError("no data: pass data(iteration) -> (inputs, targets), an iterable of (inputs, targets) such "
                         "as a DataLoader, or a bundled example name")
    return named, user


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


def _start_workers(session: Session, launcher: Launcher, spec_path: Path, model_key: str,
                   start_timeout: float) -> None:
    """Spawn rank 0 (alone first when it scouts the model's units), then the rest; wait until every rank is
    ready. A failure stops whatever started and raises."""
    spec = session.spec
    try:
        launcher.start_rank(0, spec_path)
        if spec.scout:
            session.starting(lambda: session.state.units is not None, start_timeout,
                             lambda: (0, "rank 0 did not report the model's partition units"))
            names = list(session.state.units or [])
            units.remember(model_key, names)
            units.check(spec.stages, names)
        for rank in range(1, spec.stages * spec.replicas):
            launcher.start_rank(rank, spec_path)
    except Exception:
        session.stop(timeout=2.0)  # nothing trains yet: rank 0 at most waits for the others to join
        raise
    def late() -> tuple[int, str]:
        missing = sorted(set(range(session.workers)) - set(session.state.ready))
        return (missing or [0])[0], f"ranks {missing} did not start"

    session.starting(lambda: len(session.state.ready) >= session.workers, start_timeout, late)
    session.state.adopt([], None)
    units.remember(model_key, session.names)


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
    session = Session(welcome.job.to_spec(key, address), client, launcher=None, job_dir=None)
    if len(welcome.ready) < session.workers:
        session.detach()
        raise TimeoutError(f"only {len(welcome.ready)} of {session.workers} ranks are ready yet; attach again "
                           "shortly")
    session.state.adopt(welcome.ready, welcome.current)
    client.wait_replay(min(timeout, 10.0))
    client.set_handler(session.receive)  # the replayed recent iterations fill the metrics first
    return session
