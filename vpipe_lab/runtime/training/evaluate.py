"""Evaluation on the running pipeline: ``batches`` batches forward through every stage, the mean loss back.

Every rank runs it at the same iteration boundary (an EVAL command, or every ``eval_every`` iterations). Rank 0 reads
the evaluation data from its start (``data(0) ... data(batches - 1)``, or the first batches of a fresh iterator, so
every evaluation sees the same batches) and sends the targets to the last stage; the stages run
``Executor.evaluate``. Nothing that training holds changes: no gradient, no optimizer or scheduler state, no buffer,
no RNG stream of training (dropout is off in eval mode), and the iteration count stays.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vpipe_lab.core import checks
from vpipe_lab.runtime.engine.comm import TAG_EVAL_TARGET
from vpipe_lab.runtime.model.batches import Source

if TYPE_CHECKING:
    from vpipe_lab.core.plan import Plan
    from vpipe_lab.runtime.engine.comm import Peer
    from vpipe_lab.runtime.engine.executor import Executor


def evaluate(executor: Executor, peer: Peer, plan: Plan, data: Any, batches: int,
             agree: Callable[[Any], list[int] | None] | None = None) -> dict[str, Any] | None:
    """Run the pass; the stage that computes the loss returns {loss, losses (per batch), batches, seconds}, the others None.
    ``agree(inputs)`` (every rank, rank 0 with the batch's inputs) makes the ranks agree on its micro-batches'
    shapes and returns their sizes: evaluation data may come in other shapes than training's."""
    checks.count(batches, "batches")
    rank = executor.rank
    last = rank == plan.loss_stage  # the stage that computes the loss (0 under ZBV) needs the targets
    start = time.perf_counter()
    source = Source(data, 0) if rank == 0 else None
    means: list[float] = []
    for b in range(batches):
        batch: tuple[Any, Any] | None = None
        inputs = targets = None
        if source is not None:
            inputs, targets = source.get(b)
        sizes = agree(inputs) if agree is not None else None
        if source is not None:
            if not last:
                peer.post_send(targets, plan.loss_stage, TAG_EVAL_TARGET, exact=True)
                peer.issue()
            batch = (inputs, targets)
        elif last:
            batch = (None, peer.wait(peer.post_recv(0, TAG_EVAL_TARGET)))
        losses = executor.evaluate(plan, batch)
        if last:  # the batch's mean: each micro-batch's mean counts by its samples
            weights = sizes if sizes is not None and len(sizes) == len(losses) else [1] * len(losses)
            means.append(sum(w * v for w, v in zip(weights, losses)) / sum(weights))
    peer.flush()
    if not last:
        return None
    return {"loss": sum(means) / len(means) if means else math.nan, "losses": means, "batches": batches,
            "seconds": time.perf_counter() - start}
