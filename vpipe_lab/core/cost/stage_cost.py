"""What one stage (or chunk) of a plan costs: its times per micro-batch and the bytes it holds (with what its memory
plan and its transfers add), and a stage's peak from its chunks' costs along a chunked schedule's order
(``core/cost/costmodel.py`` computes them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
        """The static tensors plus, at their most, the held activations with the largest working set and what the
        transfers hold on top, or the optimizer step's scratch (the step runs once the iteration's activations are
        gone and its sends done)."""
        return self.static_bytes + max(self.activation_bytes + self.swap_buffer_bytes + self.rebuild_bytes
                                       + self.comm_bytes + self.whole_bytes, self.step_bytes, self.end_bytes)

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
            self.table.append([max(row[i], row[i + width]) for i in range(len(row) - width)])
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
