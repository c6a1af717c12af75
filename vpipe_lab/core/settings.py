"""A job's settings: one frozen dataclass whose every field carries its type, default, one line of help, its check and
the doors it comes through; ``launch()``, ``%vpipe start``, ``vpipe-lab run``, ``vpipe-lab worker`` and the job file
the workers read are all built from it (their flags by ``core/settings_flags.py``), and validated here, once."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from typing import Any

from vpipe_lab.core import checks, documents, schedules
from vpipe_lab.core.plan import MAX_MICROBATCHES, default_virtual_stages

# The ways a job is started: the Python API (launch), the notebook's %vpipe start, the shell's `vpipe-lab run` and a
# torchrun stage (`vpipe-lab worker`). A setting reaches each of them, or says where that door takes it from instead.
DOORS = ("api", "magics", "run", "worker")
DEVICES = ("auto", "cpu", "cuda")
ENGINES = ("lab", "torch")  # who runs the pipeline: vpipe_lab's runtime, or torch.distributed.pipelining's
PRECISIONS = ("fp32", "bf16", "fp16")
# A NaN or inf loss: pause before the optimizer step with nothing changed, skip that step everywhere, or train on it.
NONFINITE = ("pause", "skip", "continue")
LOG_KINDS = ("tensorboard", "wandb", "mlflow")
UNATTENDED = "a launched session trains when told (session.run(N), %vpipe run N); an unattended job is a torchrun one"


class SettingError(ValueError):
    """A setting no job can run with, named with its value and what would work (the same text at every door)."""


@dataclass(frozen=True)
class Meta:
    """What a field says about itself beyond its type and default."""

    help: str
    check: Callable[[str, Any], None] | None = None  # refuses a bad value of this field alone
    flags: tuple[str, ...] = ()  # more spellings on the command line (a short option, an older name)
    parse: Callable[[str], Any] | None = None  # how a flag's text becomes the value, where it is not the field's type
    choices: Callable[[], tuple[str, ...]] | None = None  # the values it takes (read when asked: schedules register)
    away: Mapping[str, str] = field(default_factory=dict)  # door -> where that door takes this setting from instead
    door_default: Mapping[str, Any] = field(default_factory=dict)  # a door whose default differs, and to what


def setting(default: Any, help: str, check: Callable[[str, Any], None] | None = None, **meta: Any) -> Any:
    """A field of ``Settings``: its default, one line of help, its check and, in ``meta``, the rest of ``Meta``."""
    return field(default=default, metadata={"setting": Meta(help, check, **meta)})


def _count(minimum: int = 1, optional: bool = False, maximum: int | None = None) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        checks.count(value, name, minimum, optional=optional, maximum=maximum, error=SettingError)
    return check


def _choice(options: Callable[[], tuple[str, ...]]) -> Callable[[str, Any], None]:
    def check(name: str, value: Any) -> None:
        if value not in options():
            raise SettingError(f"unknown {name} {value!r}: use one of {', '.join(options())}")
    return check


def _seconds(name: str, value: Any) -> None:
    # None (or a string) would be accepted here and fail in the workers: a stuck worker is found only by a timeout.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise SettingError(f"{name}={value!r}: give the seconds to wait at most (a number > 0); a stuck worker is "
                           "found only by a timeout")


def _positive(name: str, value: Any) -> None:
    checks.positive(value, name, optional=True, error=SettingError, what="the largest global gradient 2-norm")


def _integer(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingError(f"{name} must be a whole number, got {value!r}")


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SettingError(f"{name} must be True or False, got {value!r}")


def _budget(name: str, value: Any) -> None:
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                           for b in value))
    if not ok:
        raise SettingError(f"{name} must be bytes per stage (one positive int, or one per stage), got {value!r}")


def _fused(name: str, value: Any) -> None:
    if not isinstance(value, int) or value < 0:  # True and False are meant here, as is a size
        raise SettingError(f"{name} must be True, False or the smallest weight to fuse (elements, >= 0), got {value!r}")


def _replan(name: str, value: Any) -> None:
    if not isinstance(value, (bool, dict)):
        raise SettingError(f"{name} must be True, False or the options of Session.auto_replan (a dict), got {value!r}")


def check_log(name: str, value: Any) -> None:
    """Refuse a ``log`` that names no sink the lab has (the telemetry's sinks open what passes)."""
    if value is None or callable(value):
        return
    kind, sep, target = value.partition(":") if isinstance(value, str) else ("", "", "")
    if not sep or kind not in LOG_KINDS or not target:
        raise SettingError(f"{name}={value!r}: use 'tensorboard:DIR', 'wandb:PROJECT', 'mlflow:URI' or a function of "
                           "one dict")


def _text(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise SettingError(f"{name} must be a non-empty string, got {value!r}")


@dataclass(frozen=True)
class Settings:
    """Everything that says how a job trains, apart from what it trains (the model, data, loss, optimizer and plan)."""

    stages: int = setting(2, "pipeline stages: one worker process each (per replica)", _count(), flags=("-k",),
                          away={"worker": "torchrun's process count (WORLD_SIZE) divided by --shards x --replicas"})
    microbatches: int = setting(4, "micro-batches each batch is split into", _count(maximum=MAX_MICROBATCHES),
                                flags=("-m",))
    schedule: str = setting("1f1b", "the pipeline schedule", _choice(schedules.names), choices=schedules.names)
    virtual_stages: int | None = setting(
        None, "model chunks per stage (default: the plan's, else 2 under interleaved-1f1b and zbv, which needs 2; "
        "else 1)", _count(optional=True), flags=("-v",))
    replicas: int = setting(1, "data-parallel copies of the pipeline: stages x shards x replicas worker processes",
                            _count())
    shards: int = setting(1, "ranks sharding each stage with FSDP2 (torch's fully_shard): its parameters, gradients and "
                          "optimizer state split over them, the batch over shards x replicas", _count())
    device: str = setting("auto", "where the stages run: auto (a GPU per stage where there are enough), cpu or cuda",
                          _choice(lambda: DEVICES), choices=lambda: DEVICES)
    engine: str = setting("lab", "lab: vpipe_lab's runtime (live migration); torch: torch.distributed.pipelining's",
                          _choice(lambda: ENGINES), choices=lambda: ENGINES)
    seed: int = setting(0, "torch.manual_seed in every worker before the model is built", _integer)
    memory_budget: int | tuple[int, ...] | None = setting(
        None, "bytes per stage the planners keep to (e.g. 2GiB): one for every stage, or one each", _budget,
        flags=("--budget",))
    precision: str = setting("fp32", "fp32, or bf16/fp16 autocast with float32 master weights",
                             _choice(lambda: PRECISIONS), choices=lambda: PRECISIONS)
    clip_grad_norm: float | None = setting(None, "clip by the global gradient 2-norm over every stage", _positive)
    nonfinite: str = setting("pause", "a NaN or infinite loss: pause before the optimizer step, nothing changed; skip "
                             "that iteration's step on every stage; or continue training on it",
                             _choice(lambda: NONFINITE), choices=lambda: NONFINITE)
    fused_wgrad: bool | int = setting(True, "Linear weight gradients accumulate inside the backward's GEMM for "
                                      "weights of at least 2**18 elements (a number: that size; False: off)", _fused)
    eval_every: int | None = setting(None, "evaluate on the evaluation data every this many iterations",
                                     _count(optional=True))
    eval_batches: int = setting(1, "batches each evaluation reads", _count())
    log: Any = setting(None, "send the metrics to tensorboard:DIR, wandb:PROJECT, mlflow:URI or a function", check_log)
    telemetry: bool = setting(True, "stream per-op timings and memory to the controller", _flag)
    timeout: float = setting(120.0, "seconds a worker may go without progress before it is reported stuck", _seconds,
                             door_default={"worker": 300.0})
    start_timeout: float = setting(120.0, "seconds the workers may take to start", _seconds,
                                   away={"worker": "torchrun's rendezvous, bounded by --timeout"})
    threads: int = setting(1, "torch threads per worker", _count())
    host: str = setting("127.0.0.1", "the address the controller and the workers listen on (loopback unless a "
                        "remote peer must reach them)", _text,
                        away={"worker": "torchrun's --master-addr; clients reach rank 0 at --control-host"})
    auto_replan: bool | dict[str, Any] = setting(False, "let vPipe replan and migrate on its own (True, or the "
                                                 "options of Session.auto_replan)", _replan,
                                                 away={"worker": "a client that attaches: session.auto_replan()"})
    max_restarts: int = setting(0, "replace a dead or hung worker and replay from the newest snapshot, this many "
                                "times", _count(0), away={"worker": "torchrun's own --max-restarts"})
    snapshot_every: int | None = setting(
        None, "iterations between restart snapshots (default: as often as costs at most ~5%; 0: none)",
        _count(0, optional=True))
    iterations: int | None = setting(None, "unattended: train until this iteration, then save and exit",
                                     _count(optional=True), away={"api": UNATTENDED, "magics": UNATTENDED,
                                                                  "run": "`vpipe-lab run --iterations N`"})
    save_every: int | None = setting(None, "headless: checkpoint into run_dir every this many iterations",
                                     _count(optional=True), away={d: UNATTENDED for d in ("api", "magics")})
    run_dir: str | None = setting(None, "headless: where the job leaves checkpoints/ and metrics.jsonl (vpipe-lab run "
                                  "also its plan.json, profile.json, cluster.json and run.json; a torchrun job "
                                  "attach.json and its snapshots, and a restart resumes from the newest here)", _text,
                                  away={d: UNATTENDED for d in ("api", "magics")})

    def validated(self) -> Settings:
        """These settings checked, every field and then how they combine (``SettingError`` naming the value and the
        fix), with ``virtual_stages`` resolved and ``memory_budget`` one entry per stage."""
        for f in fields(self):
            meta = meta_of(f)
            if meta.check is not None:
                meta.check(f.name, getattr(self, f.name))
        budget = self.memory_budget
        if isinstance(budget, (list, tuple)) and len(budget) != self.stages:
            raise SettingError(f"memory_budget must be bytes per stage: one positive int or {self.stages} of them, "
                               f"got {budget!r}")
        done = replace(self, virtual_stages=self.chunks, memory_budget=self.budgets)
        if problem := done.refusal():
            raise SettingError(problem)
        return done

    @property
    def chunks(self) -> int:
        """Model chunks per stage: ``virtual_stages`` as given, else the schedule's default (what ``validated`` sets)."""
        return self.virtual_stages if self.virtual_stages is not None else default_virtual_stages(self.schedule)

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: shards x replicas, each running its share of the batch through a pipeline."""
        return self.shards * self.replicas

    @property
    def workers(self) -> int:
        """The job's worker processes (ranks): stages x shards x replicas."""
        return self.stages * self.data_parallel

    @property
    def budgets(self) -> tuple[int, ...] | None:
        """Bytes per stage, one entry each (None: no budget)."""
        budget = self.memory_budget
        return None if budget is None else (budget,) * self.stages if isinstance(budget, int) else tuple(budget)

    def refusal(self) -> str | None:
        """Why settings that are each fine cannot work together (None: they can)."""
        if problem := engine_refusal(self.engine, self.replicas, self.precision, self.schedule, self.shards):
            return problem
        if problem := schedules.job_refusal(self.schedule, stages=self.stages, microbatches=self.microbatches,
                                            virtual_stages=self.virtual_stages, clip_grad_norm=self.clip_grad_norm,
                                            precision=self.precision, replicas=self.replicas):
            return problem
        if self.shards > 1 and self.schedule in schedules.names() and schedules.get(self.schedule).asynchronous:
            return (f"shards={self.shards} reduce each stage's gradients over its shards once per step; "
                    f"{self.schedule} steps after every micro-batch: use shards=1 or a synchronous schedule")
        if self.shards > 1 and (self.max_restarts or self.snapshot_every):
            return (f"shards={self.shards}: restart snapshots hold whole stages, and a sharded stage's state is in its "
                    "shards; checkpoint instead (session.save, or --save-every under torchrun: DCP, resumed onto any "
                    "mesh)")
        if self.max_restarts and self.engine != "lab":
            return (f"max_restarts={self.max_restarts} needs engine='lab' (the torch engine takes no snapshots); "
                    "under torchrun, torchrun's own --max-restarts restarts the job from its checkpoints")
        if self.snapshot_every and self.engine != "lab":
            return f"snapshot_every={self.snapshot_every} needs engine='lab' (the torch engine takes no snapshots)"
        if self.snapshot_every is not None and not (self.max_restarts or self.run_dir):
            return (f"snapshot_every={self.snapshot_every}: snapshots are for restarts; give max_restarts=N too, or "
                    "under torchrun --run-dir (Session.save writes a checkpoint whenever you like)")
        if self.max_restarts and self.snapshot_every == 0:
            return f"max_restarts={self.max_restarts} replays from snapshots: snapshot_every=0 takes none"
        if self.save_every and not self.run_dir:
            return f"save_every={self.save_every} needs run_dir: where the checkpoints go"
        return None

    def to_json(self) -> dict[str, Any]:
        """The settings as the job file holds them (a logging function stays with the controller that opened it)."""
        return {**documents.dump(self), "log": self.log if isinstance(self.log, str) else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Settings:
        """Settings from ``to_json``'s document, each field checked against its type (``core/documents.py``)."""
        return documents.load_fields(cls, data, "settings", ValueError)

    @classmethod
    def of(cls, door: str, **options: Any) -> Settings:
        """Settings from keyword options as ``door`` takes them: an unknown name, or one that door takes elsewhere,
        is a TypeError naming what to use instead."""
        known = {f.name: f for f in fields(cls)}
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                raise TypeError(f"unknown setting {name!r}" + (f": did you mean {close[0]!r}?" if close else
                                                                f"; the settings are {', '.join(known)}"))
            if door in (where := meta_of(known[name]).away):
                raise TypeError(f"{name} is not set here: {where[door]}")
        return cls(**{**door_defaults(door), **options})


def meta_of(f: Field[Any]) -> Meta:
    return f.metadata["setting"]  # type: ignore[no-any-return]


def door_fields(door: str) -> list[Field[Any]]:
    """The fields ``door`` takes itself, in order (the rest it takes from where ``Meta.away`` says)."""
    if door not in DOORS:
        raise ValueError(f"unknown door {door!r}: one of {', '.join(DOORS)}")
    return [f for f in fields(Settings) if door not in meta_of(f).away]


def door_defaults(door: str) -> dict[str, Any]:
    """The settings whose default differs at ``door``, with that door's default."""
    return {f.name: meta_of(f).door_default[door] for f in fields(Settings) if door in meta_of(f).door_default}


def default(f: Field[Any], door: str) -> Any:
    """The field's default at ``door``."""
    return meta_of(f).door_default.get(door, f.default if f.default is not MISSING else None)


def engine_refusal(engine: str, replicas: int, precision: str, schedule: str, shards: int = 1) -> str | None:
    """What the chosen engine cannot run, said as the fix (None: it can); settings and live changes ask here."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}"
    if engine == "lab":
        return None
    if precision != "fp32":
        return f"engine='torch' trains in fp32; precision={precision!r} needs engine='lab'"
    if schedule in schedules.names() and (why := schedules.get(schedule).export_refusal):
        return f"torch.distributed.pipelining cannot run {schedule!r} ({why}): use engine='lab'"
    return None
