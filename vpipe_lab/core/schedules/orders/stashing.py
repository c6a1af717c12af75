"""PipeDream's weight stashing on 1F1B's order: which weight version each forward uses, and how many a stage holds.

The paper's PipeDream (Narayanan et al., SOSP 2019) updates a stage's weights after every micro-batch's backward, so
a stage running 1F1B has up to ``K - s`` micro-batches in flight, each of which must find in its backward the
weights its forward used ("weight stashing"). vpipe_lab's ``"pipedream"`` schedule does exactly that inside an
iteration of ``M`` micro-batches and drains at the iteration's end, so that plan changes, checkpoints and evaluation
see one weight version (``M`` updates per iteration; the drain costs what 1F1B's flush costs). The live weights are
the newest version; a version still in flight when the stage updates is kept as a copy (the runtime moves the live
weights to fresh memory before the optimizer writes them in place), so a stage holds ``stashed_versions`` copies of
its parameters on top of them. Stdlib only: the cost model charges these copies, the runtime holds them.
"""

from __future__ import annotations

import functools

from vpipe_lab.core.schedules.actions import Op, one_f_one_b_order


def warmup(stages: int, stage: int, microbatches: int) -> int:
    """Forwards ``stage`` runs before its first backward under 1F1B."""
    return min(stages - stage - 1, microbatches)


def version_of(stages: int, stage: int, microbatch: int, microbatches: int) -> int:
    """How many of this iteration's updates ``stage`` has applied when it runs ``microbatch``'s forward: each backward
    before it in 1F1B's order is one update (so micro-batch ``m`` trains on weights ``m - (K - s - 1)`` updates on)."""
    return max(0, microbatch - warmup(stages, stage, microbatches))


@functools.cache  # the cost model asks per stage range, inside the planners' searches
def _walk(stages: int, stage: int, microbatches: int) -> tuple[int, int]:
    """Along ``stage``'s 1F1B order: the most stashed versions held at once, and how many updates moved the live
    weights (a forward in flight still read them)."""
    in_flight: dict[int, int] = {}  # micro-batch -> the version its forward used
    version = peak = moves = 0
    for op, mb in one_f_one_b_order(warmup(stages, stage, microbatches), microbatches):
        if op is Op.F:
            in_flight[mb] = version
            continue
        in_flight.pop(mb)
        moves += version in in_flight.values()
        version += 1  # the update after this backward: versions still in flight are now copies
        peak = max(peak, len(set(in_flight.values())))
    return peak, moves


def stashed_versions(stages: int, stage: int, microbatches: int) -> int:
    """The most copies of its weights ``stage`` holds besides the live ones: old versions that forwards in flight still
    need when the stage updates (``K - s - 1`` in the steady state, 0 on the last stage)."""
    return _walk(stages, stage, microbatches)[0]


def copies(stages: int, stage: int, microbatches: int) -> int:
    """How many of an iteration's ``M`` updates on ``stage`` first copy its weights to fresh memory."""
    return _walk(stages, stage, microbatches)[1]


def refusal(clip_grad_norm: float | None, precision: str, replicas: int) -> str | None:
    """Why the ``pipedream`` schedule cannot train with these options, if it cannot (each needs one agreed step of
    the whole model, which per-stage updates after every micro-batch never take)."""
    if clip_grad_norm is not None:
        return (f"clip_grad_norm={clip_grad_norm} clips by the whole model's gradient norm, which PipeDream's per-stage, "
                "per-micro-batch updates never have at once: leave it out or use a synchronous schedule ('1f1b')")
    if precision == "fp16":
        return ("precision='fp16' needs one loss scale that every stage agrees on per step; PipeDream's stages update "
                "on their own: use precision='bf16' or a synchronous schedule ('1f1b')")
    if replicas > 1:
        return (f"replicas={replicas} average gradients once per iteration; PipeDream updates after every "
                "micro-batch: use replicas=1 or a synchronous schedule ('1f1b')")
    return None
