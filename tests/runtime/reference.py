"""Plain single-process PyTorch training, the yardstick every pipelined run is compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vpipe_lab.runtime.stage import layer_seed


def train(model_fn: Callable[[], torch.nn.Sequential], data_fn: Callable[[int], tuple[Any, Any]],
          loss_fn: Callable[[Any, Any], torch.Tensor], optimizer_fn: Callable[[Any], torch.optim.Optimizer],
          *, iterations: int, microbatches: int, seed: int = 0, start: int = 0,
          model: torch.nn.Sequential | None = None) -> tuple[torch.nn.Sequential, list[float]]:
    """Gradient accumulation over ``torch.chunk`` micro-batches of mean-reduced losses, one optimizer per layer.

    Each layer's forward is seeded as the pipeline seeds it, so models with dropout compare too.
    """
    if model is None:
        torch.manual_seed(seed)
        model = model_fn()
    optimizers = [optimizer_fn([p for p in layer.parameters()]) if list(layer.parameters()) else None
                  for layer in model]
    losses = []
    for it in range(start, start + iterations):
        x, y = data_fn(it)
        xs, ys = torch.chunk(x, microbatches), torch.chunk(y, microbatches)
        total = 0.0
        for mb, (xm, ym) in enumerate(zip(xs, ys)):
            h = xm
            for i, layer in enumerate(model):
                torch.manual_seed(layer_seed(seed, it, mb, i))
                h = layer(h)
            loss = loss_fn(h, ym)
            (loss / microbatches).backward()
            total += float(loss.detach())
        losses.append(total / microbatches)
        for opt in optimizers:
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    return model, losses
