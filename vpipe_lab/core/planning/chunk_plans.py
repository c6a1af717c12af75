"""Memory plans over virtual stages: which layers of a rank's chunks (interleaved 1F1B, ZBV) to keep, swap or recompute.

A rank holding several chunks peaks at the worst point of its order, where some chunks hold more micro-batches than
others (``CostModel.rank_peak``, ``orders/held.py``), so freeing memory in one chunk may lower the peak or not, and what
one layer's policy costs in time depends on the rank's other chunks (``CostModel.chunks_iteration_s``). The per-stage
solvers (``memory_plans.py``) assume one contiguous range whose memory is a sum over its layers; here the search is
vPipe's greedy rule made to score each step against the cost model itself: while a rank is over its budget, take the
change (keep -> swap, keep -> recompute, swap -> recompute) in any of its chunks that lowers its peak by the most bytes
per second it adds to the iteration, a change that adds nothing (a swap whose transfers hide under compute) first and
the largest of those first; when no change lowers the peak at once (two states tie), the one that frees the most of
its own chunk's bytes. The pipeline's last chunk is never swapped (its backward follows its forward at once). Each
step re-costs one chunk, so a plan of ``n`` layers takes at most ``2 n`` steps of ``O(n)`` work each.
"""

from __future__ import annotations

from collections.abc import Sequence

from vpipe_lab.core.cost.costmodel import CostModel, StageCost
from vpipe_lab.core.plan import Policy

_K, _S, _R = Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE
_NEXT = {_K: (_S, _R), _S: (_R,), _R: ()}  # each change frees more of the layer's activations than the one before


class _Rank:
    """One rank's chunks and their costs under the current policies, re-costed one chunk at a time."""

    def __init__(self, cm: CostModel, bounds: Sequence[int], index: int) -> None:
        self.cm, self.bounds, self.index = cm, bounds, index
        self.chunks = tuple(c for c in range(cm.chunks) if cm.placement[c] == index)

    def cost(self, chunk: int, policies: Sequence[Policy]) -> StageCost:
        return self.cm.stage_cost(chunk, self.bounds[chunk], self.bounds[chunk + 1], policies)


def fit_chunks(cm: CostModel, bounds: Sequence[int], policies: Sequence[Policy] | None = None) -> tuple[Policy, ...]:
    """Per-layer policies that fit every rank of the interleaved plan with ``bounds`` into its budget, starting from
    ``policies`` (everything kept by default) and adding as little time as the greedy rule finds. A rank that no
    change brings under its budget is left as close to it as the rule got (the plan's estimate then says by how much
    it is over)."""
    current = list(policies) if policies is not None else [_K] * cm.num_layers
    chunk_costs = [cm.stage_cost(c, bounds[c], bounds[c + 1], current) for c in range(cm.chunks)]
    for rank in range(cm.stages):
        mine = _Rank(cm, bounds, rank)
        budget = cm.budget(rank)
        while cm.rank_peak(rank, [chunk_costs[c] for c in mine.chunks]) > budget:
            best = _best_change(cm, mine, current, chunk_costs)
            if best is None:
                break
            layer, policy, chunk, cost = best
            current[layer] = policy
            chunk_costs[chunk] = cost
    return tuple(current)


def _held(cost: StageCost) -> int:
    return cost.activation_bytes + cost.swap_buffer_bytes


def _best_change(cm: CostModel, rank: _Rank, policies: list[Policy], chunk_costs: list[StageCost]
                 ) -> tuple[int, Policy, int, StageCost] | None:
    """The change on ``rank``'s chunks with the most bytes freed per second added (see the module docstring): bytes
    by which it lowers the rank's peak, or, when no change does, the chunk's own held activations less any growth of
    the rank's largest rebuild."""
    now_s = cm.chunks_time_s(chunk_costs)
    rebuild = max(chunk_costs[c].rebuild_bytes for c in rank.chunks)
    peak = cm.rank_peak(rank.index, [chunk_costs[c] for c in rank.chunks])
    best: tuple[bool, float, int, tuple[int, Policy, int, StageCost]] | None = None
    for chunk in rank.chunks:
        others = max((chunk_costs[c].rebuild_bytes for c in rank.chunks if c != chunk), default=0)
        # The pipeline's last chunk runs each micro-batch's backward right after its forward: a swap there is a
        # transfer out and straight back in on the critical path, freeing nothing while it waits (the simulator's
        # replay of Transformer-12-12 on 8 stages, V = 4, ran such a plan 1.9x slower than the cost model's
        # per-chunk formula said: 3.77 s against 1.95 s).
        last = chunk == cm.chunks - 1
        for layer in range(rank.bounds[chunk], rank.bounds[chunk + 1]):
            was = policies[layer]
            for policy in _NEXT[was]:
                if last and policy is _S:
                    continue
                policies[layer] = policy
                cost = rank.cost(chunk, policies)
                policies[layer] = was
                own = _held(chunk_costs[chunk]) - _held(cost) - (max(others, cost.rebuild_bytes) - rebuild)
                lowered = peak - cm.rank_peak(rank.index, [cost if c == chunk else chunk_costs[c] for c in rank.chunks])
                lowers = lowered > 0
                freed = lowered if lowers else own
                if freed <= 0:
                    continue
                added = max(0.0, cm.chunks_time_s([cost if c == chunk else x for c, x in enumerate(chunk_costs)])
                            - now_s)
                # changes that lower the peak first; free ones first, the largest first; then bytes per second
                score = float(freed) * 1e30 if added <= 1e-15 else freed / added
                if best is None or (lowers, score, freed) > best[:3]:
                    best = (lowers, score, freed, (layer, policy, chunk, cost))
    return None if best is None else best[3]
