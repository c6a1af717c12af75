"""For the unattended-run tests: the mlp example's batches, slowed down so a test can act while a job runs, and a
warm-up schedule (importable by name, as a torchrun job needs)."""

from __future__ import annotations

import time
from typing import Any

import torch

from vpipe_lab.examples import mlp


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(0.15)
    return mlp.data(iteration)


def warmup(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
