"""Plain single-process PyTorch training, the yardstick every pipelined run is compared with."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch

from vpipe_lab.runtime.model.batches import Source, batch_size, split
from vpipe_lab.runtime.model.capture import args_kwargs
from vpipe_lab.runtime.model.units import layer_seed

_RUNS: dict[tuple[Any, ...], tuple[torch.nn.Module, list[float]]] = {}  # train()'s answers this process has computed


def train(model_fn: Callable[[], torch.nn.Module] | None, data: Callable[[int], tuple[Any, Any]] | Iterable[Any],
          loss_fn: Callable[[Any, Any], torch.Tensor], optimizer_fn: Callable[[Any], torch.optim.Optimizer],
          *, iterations: int, microbatches: int | Callable[[int], int], seed: int = 0, start: int = 0,
          model: torch.nn.Module | None = None, scheduler_fn: Callable[[Any], Any] | None = None,
          clip: float | None = None, precision: torch.dtype | None = None,
          norms: list[float] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """``plain_training``, computed once per process for the same arguments: a test parametrized over schedules or
    policies compares every case with one reference (the parity tests spent 17% of their time recomputing it). Only a
    run that is a function of its arguments is kept: a model built here from a factory, a count of micro-batches,
    data from a function of the iteration (not an iterator it would consume), no norms to report; the caller gets a
    copy, free to change."""
    def run() -> tuple[torch.nn.Module, list[float]]:
        return plain_training(model_fn, data, loss_fn, optimizer_fn, iterations=iterations, microbatches=microbatches,
                              seed=seed, start=start, model=model, scheduler_fn=scheduler_fn, clip=clip,
                              precision=precision, norms=norms)

    key = (model_fn, data, loss_fn, optimizer_fn, iterations, microbatches, seed, start, scheduler_fn, clip, precision)
    if model is not None or norms is not None or callable(microbatches) or not callable(data) or not _hashable(key):
        return run()
    if key not in _RUNS:
        _RUNS[key] = run()
    trained, losses = _RUNS[key]
    return copy.deepcopy(trained), list(losses)


def _hashable(key: tuple[Any, ...]) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def plain_training(model_fn: Callable[[], torch.nn.Module] | None,
                   data: Callable[[int], tuple[Any, Any]] | Iterable[Any], loss_fn: Callable[[Any, Any], torch.Tensor],
                   optimizer_fn: Callable[[Any], torch.optim.Optimizer], *, iterations: int,
                   microbatches: int | Callable[[int], int], seed: int = 0, start: int = 0,
                   model: torch.nn.Module | None = None, scheduler_fn: Callable[[Any], Any] | None = None,
                   clip: float | None = None, precision: torch.dtype | None = None,
                   norms: list[float] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """Gradient accumulation over micro-batches of mean-reduced losses, one optimizer over the model's parameters
    (a tied weight once), as an ML engineer writes it. A batch that does not divide splits into sizes one apart
    (``torch.tensor_split``), each micro-batch's loss weighted by its share of the samples, so the step is the full
    batch's mean; ``microbatches`` may be a function of the iteration (a count changed while training).

    An nn.Sequential's layers are seeded as the pipeline seeds them, so models with dropout compare too (the CPU's
    generator only, as the stages do on CPU: ``torch.manual_seed`` also queues every other device's seeding and formats
    a stack trace each time, 4% of the parity tests' time); any other model is called as the data gives its inputs (a
    tensor, positional tuple or keyword dict).
    """
    if model is None:
        assert model_fn is not None
        torch.manual_seed(seed)
        model = model_fn()
    model.train()
    optimizer = optimizer_fn(list(model.parameters()))
    scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
    autocast = (lambda: torch.autocast("cpu", dtype=precision)) if precision is not None else contextlib.nullcontext
    source = Source(data, start)
    losses = []
    for it in range(start, start + iterations):
        x, y = source.get(it)
        m = microbatches(it) if callable(microbatches) else microbatches
        xs = split(x, m, "inputs")
        ys = split(y, m, "targets") if y is not None else [None] * m
        sizes = [batch_size(p) or 1 for p in xs]
        weights = [n / sum(sizes) for n in sizes] if len(set(sizes)) > 1 else [1 / m] * m
        total = 0.0
        for mb, (xm, ym) in enumerate(zip(xs, ys)):
            with autocast():
                if isinstance(model, torch.nn.Sequential):
                    h = xm
                    for i, layer in enumerate(model):
                        torch.default_generator.manual_seed(layer_seed(seed, it, mb, i))
                        h = layer(h)
                else:
                    args, kwargs = args_kwargs(xm)
                    h = model(*args, **kwargs)
                loss = loss_fn(h, ym)
            (loss / m if len(set(sizes)) == 1 else loss * weights[mb]).backward()
            total += float(loss.detach()) * weights[mb]
        losses.append(total)
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return model, losses


def train_pipedream(model_fn: Callable[[], torch.nn.Sequential], data: Callable[[int], tuple[Any, Any]],
                    loss_fn: Callable[[Any, Any], torch.Tensor], optimizer_fn: Callable[[Any], torch.optim.Optimizer],
                    *, iterations: int, microbatches: int,
                    boundaries: tuple[int, ...] | Callable[[int], tuple[int, ...]], seed: int = 0,
                    scheduler_fn: Callable[[Any], Any] | None = None) -> tuple[torch.nn.Module, list[float]]:
    """The paper's PipeDream, written out in one process: stage ``s`` (layers ``boundaries[s]:boundaries[s+1]``)
    runs micro-batch ``m`` forward and backward with its weights as they were after ``m - (K - s - 1)`` of this
    iteration's updates (its backwards before that forward in 1F1B's order), and updates after every micro-batch with
    that micro-batch's gradient of its own mean loss. Each parameter's update sequence is its stage's, so one
    optimizer over all parameters stepping once per micro-batch is the same training; the learning-rate schedule
    steps once per iteration of ``microbatches`` updates. Layers are seeded as the pipeline seeds them."""
    torch.manual_seed(seed)
    model = model_fn()
    model.train()
    optimizer = optimizer_fn(list(model.parameters()))
    scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
    params = [dict(layer.named_parameters()) for layer in model]
    losses = []
    for it in range(iterations):
        bounds = boundaries(it) if callable(boundaries) else boundaries  # a plan applied at an iteration boundary
        k = len(bounds) - 1
        stage_of = [s for s in range(k) for _ in range(bounds[s], bounds[s + 1])]
        x, y = data(it)
        xs, ys = split(x, microbatches, "inputs"), split(y, microbatches, "targets")

        def snapshot(s: int, bounds: tuple[int, ...] = bounds) -> dict[int, dict[str, torch.Tensor]]:
            return {i: {n: p.detach().clone() for n, p in params[i].items()} for i in range(bounds[s], bounds[s + 1])}

        history = [[snapshot(s)] for s in range(k)]  # history[s][u]: stage s after u of this iteration's updates
        total = 0.0
        for mb in range(microbatches):
            h, leaves = xs[mb], []
            for i, layer in enumerate(model):
                s = stage_of[i]
                version = history[s][max(0, mb - min(k - s - 1, microbatches))][i]
                values = {n: t.clone().requires_grad_() for n, t in version.items()}
                leaves += [(params[i][n], v) for n, v in values.items()]
                torch.default_generator.manual_seed(layer_seed(seed, it, mb, i))
                h = torch.func.functional_call(layer, values, (h,))
            loss = loss_fn(h, ys[mb])
            loss.backward()
            total += float(loss.detach()) / microbatches
            for p, leaf in leaves:  # a weight two layers share gets both gradients
                p.grad = leaf.grad if p.grad is None else p.grad + leaf.grad
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for s in range(k):
                history[s].append(snapshot(s))
        losses.append(total)
        if scheduler is not None:
            scheduler.step()
    return model, losses


def expected_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``model.state_dict()`` holds (a tied weight under each name), as ``Session.state_dict()`` gives it."""
    return dict(model.state_dict(keep_vars=True))


def assert_state_matches(state: dict[str, torch.Tensor], model: torch.nn.Module, exact: bool = False,
                         atol: float | None = None) -> None:
    """Every parameter and buffer equal (``exact``) or within float32 tolerances; ``atol`` widens the absolute one for
    models whose plain training differs by more than float32's default under a mere reordering of the same sums."""
    expected = expected_state(model)
    assert list(state) == list(expected)  # the same keys, in the model's own order
    for key, value in expected.items():
        if exact:
            assert torch.equal(state[key], value.detach()), key
        else:
            torch.testing.assert_close(state[key], value.detach(), atol=atol, rtol=None if atol is None else 1.3e-6,
                                       msg=lambda m, key=key: f"{key}: {m}")
