"""The job description the controller writes for its workers (pure data, JSON on disk next to the pickled callables)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.core import checks
from vpipe_lab.core.report import parse_bytes
from vpipe_lab.wire.private import write_private

DEVICES = ("auto", "cpu", "cuda")  # the one list of device choices: launch(), the CLI and the magics read it
ENGINES = ("lab", "torch")  # who runs the pipeline: vpipe_lab's runtime, or torch.distributed.pipelining's
PRECISIONS = ("fp32", "bf16", "fp16")
# What a non-finite (NaN, inf) loss does: pause before the optimizer step with nothing changed (the default), skip
# the iteration's step on every stage and go on, or train on as if nothing happened (runtime/iteration_end.py).
NONFINITE = ("pause", "skip", "continue")
NONFINITE_HELP = ("a NaN or infinite loss: pause before the optimizer step, nothing changed (default); skip that "
                  "iteration's step on every stage; or continue training on it")


def check_training(clip_grad_norm: Any, precision: str, eval_every: Any, eval_batches: Any,
                   nonfinite: Any = "pause") -> None:
    """Refuse training options that cannot work, naming the value (shared by launch and the CLI)."""
    checks.positive(clip_grad_norm, "clip_grad_norm", optional=True, what="the largest global gradient 2-norm")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    check_nonfinite(nonfinite)
    checks.count(eval_every, "eval_every", optional=True)
    checks.count(eval_batches, "eval_batches", optional=True)


def check_nonfinite(nonfinite: Any) -> None:
    """Refuse a ``nonfinite`` that is not one of ``NONFINITE``, naming the choices."""
    if nonfinite not in NONFINITE:
        raise ValueError(f"unknown nonfinite {nonfinite!r}: use one of {', '.join(NONFINITE)} ({NONFINITE_HELP})")


def engine_refusal(engine: str, replicas: int, precision: str, schedule: str) -> str | None:
    """What the chosen engine cannot run, said as the fix (None: it can); launch(), the CLI, the magics and torchrun
    workers all ask here."""
    if engine not in ENGINES:
        return f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}"
    if engine == "lab":
        return None
    if replicas != 1:
        return "engine='torch' runs one pipeline: data-parallel replicas need engine='lab'"
    if precision != "fp32":
        return f"engine='torch' trains in fp32; precision={precision!r} needs engine='lab'"
    from vpipe_lab.core import schedules

    if schedule in schedules.names() and (why := schedules.get(schedule).export_refusal):
        return f"torch.distributed.pipelining cannot run {schedule!r} ({why}): use engine='lab'"
    return None


def byte_size(text: str) -> int:
    """An argparse type for a memory size ("8GiB", "512MiB", bytes): ``core.report.parse_bytes`` with argparse's
    error, so the CLI and the magics report a bad size alike."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_training_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, names: str) -> None:
    """The training options of ``launch()`` as command-line flags, for ``vpipe-lab worker`` and ``%vpipe start``
    alike; ``names`` says how a function is named where they are parsed ("package.module:attr", "a notebook
    variable")."""
    parser.add_argument("--lr-scheduler", help=f"optimizer -> scheduler factory: {names}")
    parser.add_argument("--clip-grad-norm", type=float, help="clip by the global gradient 2-norm over every stage")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")
    parser.add_argument("--nonfinite", choices=NONFINITE, default="pause", help=NONFINITE_HELP)
    parser.add_argument("--eval-data", help=f"evaluation data: a bundled example or {names}")
    parser.add_argument("--eval-every", type=int, help="evaluate every this many iterations")
    parser.add_argument("--eval-batches", type=int, default=1)
    parser.add_argument("--no-fused-wgrad", dest="fused_wgrad", action="store_false",
                        help="Linear layers' weight gradients through plain autograd (see runtime/engine/wgrad.py)")
    parser.add_argument("--log", help="tensorboard:DIR, wandb:PROJECT, mlflow:URI" +
                        ("" if names.startswith("package") else f" or a logging function ({names})"))


@dataclass
class JobSpec:
    session_id: str
    key: str
    address: str  # the controller's ZeroMQ endpoint
    master_addr: str
    master_port: int
    stages: int
    microbatches: int
    replicas: int = 1  # data-parallel copies of the pipeline (runtime/training/replicas.py): stages x replicas ranks
    schedule: str = "1f1b"
    device: str = "auto"
    seed: int = 0
    plan: dict[str, Any] | None = None
    memory_budget: list[int] | None = None
    telemetry: bool = True
    timeout_s: float = 120.0
    threads: int = 1
    callables_path: str | None = None  # cloudpickle of user callables; written by the controller, never a socket
    job_dir: str | None = None  # where the controller writes the job's files: the only place a worker unpickles from
    examples: dict[str, str] = field(default_factory=dict)  # role -> bundled example name
    imports: dict[str, str] = field(default_factory=dict)  # role -> "package.module:attribute" (torchrun jobs)
    start_iteration: int = 0
    resume_path: str | None = None
    clip_grad_norm: float | None = None  # the largest global gradient 2-norm (runtime/training/step.py)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (runtime/training/precision.py)
    nonfinite: str = "pause"  # a NaN/inf loss: pause | skip | continue (runtime/iteration_end.py)
    fused_wgrad: bool | int = True  # Linear weight gradients accumulate inside the GEMM (runtime/engine/wgrad.py)
    virtual_stages: int = 1  # chunks per stage under interleaved-1f1b (core/schedules/orders/interleaved.py)
    eval_every: int | None = None  # evaluate on the eval_data role every this many iterations
    eval_batches: int = 1
    iterations: int | None = None  # unattended: train until this iteration without waiting for a client
    save_every: int | None = None  # unattended: checkpoint into run_dir every this many iterations
    run_dir: str | None = None  # unattended: checkpoints, metrics and how to attach
    log: str | None = None  # unattended: "tensorboard:DIR" | "wandb:PROJECT" | "mlflow:URI" (telemetry/sinks.py)
    scout: bool = False  # rank 0 starts alone and reports the model's units (protocol UNITS) before the others start
    engine: str = "lab"  # "lab": vpipe_lab's runtime; "torch": torch.distributed.pipelining's (runtime/torch_engine.py)
    snapshot_dir: str | None = None  # restart snapshots and buffered batches (wire/snapshot.py); None: none taken
    snapshot_every: int | None = None  # iterations between snapshots (None: chosen to cost at most ~5%)
    restore_snapshot: str | None = None  # a restarted job: the snapshot directory every rank starts from
    devices: list[int] | None = None  # each rank's GPU index (None: rank r takes GPU r); a job that lost one skips it

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=1).encode())  # it holds the session key

    @classmethod
    def load(cls, path: Path) -> JobSpec:
        return cls(**json.loads(path.read_text()))
