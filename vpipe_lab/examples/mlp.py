"""An MLP with deliberately uneven layer widths, so a uniform partition is unbalanced, and its data.

The wide layers sit in the first half: split evenly by layer count over 2 stages, stage 0 gets ~20x the work of
stage 1, which is what vPipe's replanning should notice and fix.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

WIDTHS = (64, 256, 1024, 2048, 2048, 1024, 256, 256, 128, 64, 16)
BATCH = 32


def model() -> nn.Sequential:
    """Ten Linear+ReLU blocks (the last one plain Linear): partition units of very different cost."""
    blocks: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(WIDTHS)):
        last = i == len(WIDTHS) - 2
        blocks.append(nn.Linear(a, b) if last else nn.Sequential(nn.Linear(a, b), nn.ReLU()))
    return nn.Sequential(*blocks)


def _teacher() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(WIDTHS[0], WIDTHS[-1], generator=g) / WIDTHS[0] ** 0.5


def data(iteration: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per iteration: random inputs, targets from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(10_000 + iteration)
    x = torch.randn(BATCH, WIDTHS[0], generator=g)
    return x, x @ _teacher()


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def optimizer(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]
