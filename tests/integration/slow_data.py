"""Data for the unattended-run tests: the mlp example's batches, slowed down so a test can act while a job runs."""

from __future__ import annotations

import time

import torch

from vpipe_lab.examples import mlp


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(0.15)
    return mlp.data(iteration)
