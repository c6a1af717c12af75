"""What one stage (or chunk) of a plan costs: its times per micro-batch and the bytes it holds (with what its memory
plan and its transfers add), and a stage's peak from its chunks' costs along a chunked schedule's order
(``core/cost/costmodel.py`` computes them)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from vpipe_lab.core.plan import Estimate, Policy
from vpipe_lab.core.schedules.orders.held import Transfers


def policy_overhead(recompute_s: float, swap_bytes: int, hide_s: float, bandwidth: float,
                    overlaps: bool = True) -> float:
    """Extra backward time of a stage's memory plan: recompute plus the swap transfer time not hidden by compute;
    without ``overlaps`` (copies on the compute thread, ``Cluster.swap_overlaps``) every byte is copied out and back
    in on the stage's own time."""
    if not overlaps:
        return recompute_s + 2 * swap_bytes / bandwidth
    if swap_bytes <= 0:
        return recompute_s
    return max(recompute_s, swap_bytes / bandwidth - hide_s)


def swap_buffers(inflight: int) -> int:
    """Micro-batches of a swapped layer resident at once: one being computed, one prefetched for its backward."""
    return min(inflight, 2)


class Held(NamedTuple):
    """What one micro-batch of a stage holds under its policies, walked layer by layer (``walk``)."""

    resident: int  # per micro-batch, from forward to backward: kept layers, recomputed layers' inputs, a run's input
    swapped: int  # per micro-batch, copied off to the host (what the swap buffers hold a share of)
    moved: int  # per micro-batch, charged as copied (the planners' count: every swapped layer whole)
    recompute_s: float
    rebuilt: int  # the most on top of the micro-batches in flight whole (``StageCost.rebuild_bytes``)


def walk(lo: int, hi: int, policies: Sequence[Policy], act: Sequence[int], inp: Sequence[int], trans: Sequence[int],
         fwd: Sequence[float], made: Callable[[int], int] | None = None) -> Held:
    """Layers lo:hi under ``policies`` (indexed by global layer). While layer i runs (forward, rebuild or backward)
    the other micro-batches in flight are held whole, and its own micro-batch holds what layers lo..i keep: the later
    ones have not run yet, or their backward is done. On top comes layer i's working set and, recomputed, its rebuilt
    activations. ``made``: where every forward comes before the first backward, the gradients' bytes (counted static)
    of layers lo..i, which are not made until i's first backward: the peak may credit them (below 0 then)."""
    resident = swapped = moved = 0
    recompute = 0.0
    top = first = 0
    for i in range(lo, hi):
        policy = policies[i]
        if policy is Policy.KEEP:
            resident += act[i]
            here = resident + trans[i]
        elif policy is Policy.RECOMPUTE:
            resident += inp[i]
            recompute += fwd[i]
            here = resident + act[i] + trans[i]
        else:  # a run of swapped layers is one segment; its input stays (see costmodel's docstring)
            held = min(inp[i], act[i]) if i == lo or policies[i - 1] is not Policy.SWAP else 0
            resident, swapped, moved = resident + held, swapped + act[i] - held, moved + act[i]
            here = resident + trans[i]
        if here > top:  # (not max(): this loop runs for every choice the memory planners weigh)
            top = here
        if made is not None and here - made(i) > first:  # measured on the zoo's stage 0 of 4: within 1% but
            first = here - made(i)  # gpt-tiny's, 4 to 10% over without
    # all micro-batches whole with its top, or (``made``) one fewer with a later one's
    rebuilt = max(0, top - resident) if made is None else max(first, top - resident) - resident
    return Held(resident, swapped, moved, recompute, rebuilt)


def stage_peak(static: int, activations: int, swap_buffer: int, rebuild: int, comm: int, whole: int, step: int,
               end: int) -> int:
    """A stage's peak: the static tensors plus, at their most, the held activations with the largest working set
    and what the transfers hold on top, or the optimizer step's scratch (the step runs once the iteration's
    activations are gone and its sends done), or a sharded stage's end of iteration."""
    return static + max(activations + swap_buffer + rebuild + comm + whole, step, end)


@dataclass(frozen=True)
class StageCost:
    """Time per micro-batch and memory of one stage under one set of policies."""

    forward_s: float
    backward_s: float
    recompute_s: float
    swap_exposed_s: float
    comm_s: float
    static_bytes: int
    activation_bytes: int
    swap_buffer_bytes: int
    host_bytes: int
    inflight: int
    # the most a layer adds on top of what is held: a recomputed layer's activations, rebuilt right before its
    # backward, plus that layer's own working set (LayerCost.transient_bytes); for a kept layer its working set
    # (below 0 where the weights' gradients, counted static, are not all made yet at the peak: costmodel.py)
    rebuild_bytes: int = 0
    wgrad_s: float = 0.0  # the weights' gradients' part of backward_s (a zero-bubble schedule's W step)
    resident_bytes: int = 0  # per micro-batch held from forward to backward (kept layers, recomputed layers' inputs)
    wait_bytes: int = 0  # per micro-batch held from B to W under a split backward (the GEMMs' inputs, out-gradients)
    transient_bytes: int = 0  # the largest working set of one of its layers (LayerCost.transient_bytes)
    step_bytes: int = 0  # the optimizer step's scratch, when no activation is held (LayerCost.step_bytes)
    # What the stage's transfers hold along its order (``orders/held.py``: ``transfers``; a schedule without chunks):
    # its points, and the bytes of one input gradient sent back and of one output sent on (of a gradient received)
    transfers: tuple[Transfers, ...] = ()
    sent_in_bytes: int = 0
    sent_out_bytes: int = 0
    # A sharded stage (``sharded.py``): whole parameters and gradients held on top of the activations while it
    # computes, and at the iteration's end (the activations gone); the collectives run once per iteration
    whole_bytes: int = 0
    end_bytes: int = 0
    once_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def peak_bytes(self) -> int:
        """``stage_peak`` of this stage's bytes."""
        return stage_peak(self.static_bytes, self.activation_bytes, self.swap_buffer_bytes, self.rebuild_bytes,
                          self.comm_bytes, self.whole_bytes, self.step_bytes, self.end_bytes)

    @property
    def comm_bytes(self) -> int:
        """The most the stage's transfers hold at once along its order: the tensors sent so far (held until the
        iteration's sends are done), the receives posted ahead and a backward's received gradient. No activation
        policy changes it; it is taken whole beside the activations' peak, which can come at another point of the
        order (an upper bound)."""
        return transfers_peak(self.transfers, self.sent_in_bytes, self.sent_out_bytes)


def transfers_peak(points: Sequence[Transfers], sent_in_bytes: int, sent_out_bytes: int) -> int:
    """The most ``points`` (``orders/held.py``: ``transfers``) hold, for one input gradient of ``sent_in_bytes`` and
    one output (or received gradient) of ``sent_out_bytes``."""
    return max(((sent_in + ahead_in) * sent_in_bytes + (sent_out + ahead_grad + in_backward) * sent_out_bytes
                for sent_in, sent_out, ahead_in, ahead_grad, in_backward in points), default=0)


class RangeMax:
    """The largest of ``values[lo:hi]`` in O(1) after O(n log n) preparation (a sparse table): the planners ask it
    for every stage they try."""

    def __init__(self, values: Sequence[int]) -> None:
        self.table = [list(values)]
        width = 1
        while 2 * width <= len(values):
            row = self.table[-1]
            self.table.append(list(map(max, row, row[width:])))  # pairwise, in C: built for every cost model
            width *= 2

    def __call__(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        level = (hi - lo).bit_length() - 1
        row = self.table[level]
        return max(row[lo], row[hi - (1 << level)])


def chunks_peak(costs: Sequence[StageCost], held: Sequence[tuple[int, ...]]) -> int:
    """A stage's peak bytes from its chunks' costs and ``held``, each state of (forwards awaiting B per chunk,
    backwards awaiting W per chunk, the chunk whose B comes next or -1) along the stage's order (``orders/held.py``):
    the chunks' statics, the largest of those states weighted by the chunks' bytes per micro-batch, a state before a
    B with that chunk's rebuild on top, and every chunk's swap buffers."""
    n = len(costs)
    scratch = max(c.transient_bytes for c in costs)  # a forward's working set, in a state before no B
    acts = max(sum(h[i] * costs[i].resident_bytes + h[n + i] * costs[i].wait_bytes for i in range(n))
               + (costs[h[-1]].rebuild_bytes if h[-1] >= 0 else scratch) for h in held)
    whole = sum(c.whole_bytes for c in costs)  # a sharded stage's chunks: what each holds whole while it runs
    return sum(c.static_bytes for c in costs) + max(acts + sum(c.swap_buffer_bytes for c in costs) + whole,
                                                    max(c.step_bytes for c in costs), sum(c.end_bytes for c in costs))


def estimate_of(costs: Sequence[StageCost], iteration_s: float, budgets: Sequence[int], microbatches: int) -> Estimate:
    """A pipeline's estimate from one cost per stage and its iteration time."""
    busy = sum(c.total_s for c in costs) * microbatches
    peaks = tuple(c.peak_bytes for c in costs)
    return Estimate(
        iteration_s=iteration_s,
        stage_s=tuple(c.total_s for c in costs),
        peak_bytes=peaks,
        budget_bytes=tuple(budgets),
        bubble_fraction=(1.0 - busy / (len(costs) * iteration_s)) if iteration_s > 0 else 0.0,
        feasible=all(p <= b for p, b in zip(peaks, budgets)),
        forward_s=tuple(c.forward_s for c in costs),
        backward_s=tuple(c.backward_s for c in costs),
        recompute_s=tuple(c.recompute_s for c in costs),
        swap_exposed_s=tuple(c.swap_exposed_s for c in costs),
        comm_s=tuple(c.comm_s for c in costs),
        static_bytes=tuple(c.static_bytes for c in costs),
        activation_bytes=tuple(c.activation_bytes + c.swap_buffer_bytes for c in costs),
        host_bytes=tuple(c.host_bytes for c in costs),
        inflight=tuple(c.inflight for c in costs),
    )
