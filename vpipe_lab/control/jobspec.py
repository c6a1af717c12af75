"""The job description the controller writes for its workers (pure data, JSON on disk next to the pickled callables)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vpipe_lab.control.private import write_private


@dataclass
class JobSpec:
    session_id: str
    key: str
    address: str  # the controller's ZeroMQ endpoint
    master_addr: str
    master_port: int
    stages: int
    microbatches: int
    replicas: int = 1  # data-parallel copies of the pipeline (runtime/replicas.py): stages x replicas ranks
    schedule: str = "1f1b"
    device: str = "auto"
    seed: int = 0
    plan: dict[str, Any] | None = None
    memory_budget: list[int] | None = None
    telemetry: bool = True
    timeout_s: float = 120.0
    threads: int = 1
    callables_path: str | None = None  # cloudpickle of user callables; written by the controller, never a socket
    examples: dict[str, str] = field(default_factory=dict)  # role -> bundled example name
    imports: dict[str, str] = field(default_factory=dict)  # role -> "package.module:attribute" (torchrun jobs)
    start_iteration: int = 0
    resume_path: str | None = None
    clip_grad_norm: float | None = None  # the largest global gradient 2-norm (runtime/step.py)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (runtime/precision.py)
    eval_every: int | None = None  # evaluate on the eval_data role every this many iterations
    eval_batches: int = 1
    iterations: int | None = None  # unattended: train until this iteration without waiting for a client
    save_every: int | None = None  # unattended: checkpoint into run_dir every this many iterations
    run_dir: str | None = None  # unattended: checkpoints, metrics and how to attach
    log: str | None = None  # unattended: "tensorboard:DIR" | "wandb:PROJECT" | "mlflow:URI" (control/sinks.py)

    def save(self, path: Path) -> None:
        write_private(path, json.dumps(asdict(self), indent=1).encode())  # it holds the session key

    @classmethod
    def load(cls, path: Path) -> JobSpec:
        return cls(**json.loads(path.read_text()))
