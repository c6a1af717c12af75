"""Iteration time of the 1F1B-shaped schedules, GPipe, ZB-H1 and the chunked schedules (interleaved 1F1B, ZBV) from
times per micro-batch: the closed forms their schedule kinds give the cost model (``core/schedules/``).

The iteration takes ``sum(T) + 2 (K - 1) L + (M - 1) * P`` for 1F1B and eager 1F1B, with ``P`` the slowest stage or,
when latency is long, a round trip over the micro-batches in flight (``period``: what eager 1F1B's extra micro-batch
hides), and ``sum(T) + 2 (K - 1) L + (M - 1) * (max(F) + max(B))`` for GPipe, which both reduce to ``(M + K - 1) *
T`` for equal stages and free communication. ZB-H1 takes ``M * T_b + sum over the other stages of max(0, T - 2 W)``
(``P`` for ``T_b`` when latency makes it longer) with ``b`` the slowest stage and ``W`` a stage's weight-gradient
time: the fill and drain pass each stage without its weight step (the paper's ``(K - 1)(F + B - W)`` bubble for
equal stages).
"""

from __future__ import annotations

from collections.abc import Sequence


def gpipe_time(forward: Sequence[float], backward: Sequence[float], microbatches: int, latency_s: float = 0.0
               ) -> float:
    """GPipe's iteration from per-stage forward and backward time per micro-batch, each transfer arriving
    ``latency_s`` after its send: the forwards' pipeline, then the backwards'."""
    total = [f + b for f, b in zip(forward, backward)]
    return sum(total) + _fill(len(total), latency_s) + (microbatches - 1) * (max(forward) + max(backward))


def one_f_one_b_time(forward: Sequence[float], backward: Sequence[float], microbatches: int, latency_s: float = 0.0,
                     inflight: Sequence[int] = ()) -> float:
    """A 1F1B-shaped iteration, with ``inflight[s]`` micro-batches between stage s's forward and backward (see
    ``period``)."""
    total = [f + b for f, b in zip(forward, backward)]
    return sum(total) + _fill(len(total), latency_s) + (microbatches - 1) * period(total, latency_s, inflight)


def zb_h1_time(forward: Sequence[float], backward: Sequence[float], microbatches: int, wgrad: Sequence[float] = (),
               latency_s: float = 0.0, inflight: Sequence[int] = ()) -> float:
    """ZB-H1's iteration (``wgrad``: the weight-gradient part of each stage's backward): a stage's own weight steps
    wait for its gradients; later stages' may delay them."""
    total = [f + b for f, b in zip(forward, backward)]
    weights = list(wgrad) or [0.0] * len(total)
    step = period(total, latency_s, inflight, [t - w for t, w in zip(total, weights)])
    slowest = max(range(len(total)), key=lambda s: total[s])
    return microbatches * step + _fill(len(total), latency_s) + sum(
        max(0.0, t - 2 * w) for s, (t, w) in enumerate(zip(total, weights)) if s != slowest)


def _fill(stages: int, latency_s: float) -> float:
    return 2 * (stages - 1) * latency_s  # the first forward and the last backward cross every link


def period(total: Sequence[float], latency_s: float, inflight: Sequence[int] = (),
           own: Sequence[float] | None = None) -> float:
    """The steady state's time per micro-batch of a 1F1B-shaped schedule: the slowest stage, or, when transfers take
    long, a round trip over the micro-batches in flight. Stage ``s`` holds ``inflight[s]`` micro-batches between a
    forward and its backward, and each makes a round trip of ``sum(T[s:]) + 2 (K - 1 - s) latency`` (its own and the
    later stages' work, and a transfer each way per link), so by Little's law a micro-batch leaves it no faster than
    every round trip over ``inflight[s]``. That is what eager 1F1B's extra micro-batch in flight buys: the latency
    that 1F1B's ``K - s`` leave on the critical path. ``own`` is a stage's part of its own round trips where it is
    not all of its ``total`` (ZB-H1: without its weight steps, which fill its wait for the gradient)."""
    k = len(total)
    step = max(total)
    if latency_s > 0 and inflight:
        for s in range(k):
            mine = total[s] if own is None else own[s]
            step = max(step, (mine + sum(total[s + 1:]) + 2 * (k - 1 - s) * latency_s) / max(1, inflight[s]))
    return step


def chunks_iteration_time(chunk_s: Sequence[float], wgrad_s: Sequence[float], placement: Sequence[int], stages: int,
                          microbatches: int, hop_s: float, zbv: bool) -> float:
    """The iteration of a chunked schedule from each chunk's time per micro-batch (``wgrad_s``: its W step's).

    Interleaved 1F1B (chunk ``c`` on stage ``c % K``): ``M * max(T_stage) + (K - 1) * max(T_chunk)``, plus the
    latency of the ``K V - 1`` links, each crossed once by the first forward and once by the last backward.
    ZBV: ``M * max(T_stage) + (K - 1) * mean(T_chunk - 2 W_chunk)`` plus one latency per link of the ``2 K - 2``
    (the turn is local): the up chunks' forwards fill the warm-up and the W steps the drain, so what is left of
    the bubble is K - 1 chunk-steps without their weight step (the paper's unit costs: ``6 M + K - 1`` units for
    ``6 M`` of work). Against the replay (``core/cost/simulator.py``) over 300 random pipelines of 2-8 stages, chunk
    times +-50% and latency up to a third of a step: median +1.6%, 95% within -3/+8%."""
    chunks = len(chunk_s)
    stage_s = [0.0] * stages
    for c, t in enumerate(chunk_s):
        stage_s[placement[c]] += t
    if zbv:
        w = list(wgrad_s) or [0.0] * chunks
        fill = sum(t - 2 * x for t, x in zip(chunk_s, w)) / chunks
        return microbatches * max(stage_s) + (stages - 1) * fill + (chunks - 2) * hop_s
    return microbatches * max(stage_s) + (stages - 1) * max(chunk_s) + 2 * (chunks - 1) * hop_s
