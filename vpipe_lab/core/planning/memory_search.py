"""The exact memory plan of one stage: a branch-and-bound over keep, swap and recompute per layer on the estimate's own
peak (``StageProblem.fits``: the numbers the user is shown), pruned by a relaxation that never overstates what a
completion can free, started from vPipe's rule (``memory_plans.greedy``); it proves its answer optimal unless it runs
out of nodes."""

from __future__ import annotations

import math
from dataclasses import replace

from vpipe_lab.core.cost.costmodel import policy_overhead, swap_buffers
from vpipe_lab.core.plan import Policy
from vpipe_lab.core.planning.memory_plans import StageProblem, StageSolution, greedy, keep_all, solution, taken_back

_K, _S, _R = Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE


class _Search:
    """Depth-first branch-and-bound over layers; identical layers are interchangeable, so their choices are sorted.

    Each layer frees at most ``swap_gain`` bytes swapped and ``rec_gain`` recomputed, and what is still over the
    budget starts at ``need``. Without ``fits`` the gains are exact (additive) and a choice fits once nothing is over
    (``rebuild``: the largest recomputed layer is held again); with ``fits`` they are a relaxation that never
    understates what a choice frees, and ``fits`` decides each choice whose relaxation fits, the layers not chosen
    yet kept. Either way adding a swap or a recompute never makes a plan faster, so the first fit on a path ends it."""

    def __init__(self, p: StageProblem, incumbent: float, node_limit: int) -> None:
        self.p = p
        n = len(p.activation)
        if p.fits is None:
            self.swap_gain, self.rec_gain, self.swap_rate = list(p.swap_save), list(p.rec_most), \
                p.inflight - swap_buffers(p.inflight)
            self.need, self.rebuild = p.need_bytes, True
        else:
            self.swap_rate, self.swap_gain, self.rec_gain = p.relaxed_frees()
            self.need, self.rebuild = p.relaxed_need, False
        key = [(p.activation[i], p.inputs[i], p.forward_s[i]) for i in range(n)]
        value = [max(self.swap_gain[i], self.rec_gain[i]) for i in range(n)]  # at most what each can free
        # Most bytes freed per second of recompute first (then by size): finds good plans early, so the bound prunes more.
        self.order = sorted((i for i in range(n) if value[i] > 0),
                            key=lambda i: (-(self.rec_gain[i] / p.forward_s[i]) if p.forward_s[i] > 0 else -math.inf,
                                           -value[i], key[i], i))
        order = self.order
        # (interchangeable by the additive count only: where a layer sits matters to the estimate's peak)
        self.same_as_prev = [p.fits is None and j > 0 and key[order[j]] == key[order[j - 1]] for j in range(len(order))]
        m = len(order)
        self.rest_value = [0] * (m + 1)
        self.rest_act = [0] * (m + 1)
        self.best_rate = [0.0] * (m + 1)
        self.free_rec = [0] * (m + 1)
        for j in range(m - 1, -1, -1):
            i = order[j]
            self.rest_value[j] = self.rest_value[j + 1] + value[i]
            self.rest_act[j] = self.rest_act[j + 1] + (p.activation[i] if self.swap_gain[i] > 0 else 0)
            saving, f = self.rec_gain[i], p.forward_s[i]
            self.free_rec[j] = self.free_rec[j + 1] + (saving if f == 0 else 0)
            rate = saving / f if f > 0 else 0.0
            self.best_rate[j] = max(self.best_rate[j + 1], rate)
        self.best = incumbent
        self.best_choice: list[Policy] | None = None
        self.choice = [_K] * m
        self.nodes = 0
        self.node_limit = node_limit
        self.aborted = False

    def bound(self, j: int, rho: float, sigma: int, remaining: int) -> float:
        """A lower bound on the extra time of any completion: the remaining bytes freed at the best rate recompute
        or swap can offer (a layer may count for both, which only loosens the bound)."""
        p = self.p
        cur = policy_overhead(rho, sigma, p.hide_s, p.bandwidth, p.overlaps)
        swap_rate = self.swap_rate
        if not p.overlaps:  # additive: every byte swapped costs 2 / bandwidth, no recompute hides anything
            left = remaining - self.free_rec[j]
            if left <= 0:
                return cur
            fastest = self.best_rate[j] + (swap_rate * p.bandwidth / 2 if self.rest_act[j] > 0 else 0.0)
            return cur + left / fastest if fastest > 0 else math.inf
        free_swap = max(0.0, p.bandwidth * (p.hide_s + cur) - sigma)
        remaining_f = remaining - swap_rate * min(self.rest_act[j], free_swap) - self.free_rec[j]
        remaining_f -= self.best_rate[j] * (cur - rho)
        if remaining_f <= 0:
            return cur
        rate = self.best_rate[j] + (swap_rate * p.bandwidth if self.rest_act[j] > free_swap else 0.0)
        return cur + remaining_f / rate if rate > 0 else math.inf

    def _fits(self, j: int) -> bool:
        """Whether the choices for ``order[:j]``, the rest kept, fit by the estimate's peak."""
        assert self.p.fits is not None
        policies = [_K] * len(self.p.activation)
        for k in range(j):
            policies[self.order[k]] = self.choice[k]
        return self.p.fits(tuple(policies))

    def run(self, j: int, rho: float, sigma: int, remaining: int, floor: int, top: int = 0,
            checked: bool = False) -> None:
        """Choose for ``order[j:]``; ``top`` is the largest activation of a layer recomputed so far (its rebuild is
        the one held); ``checked``: this very choice (the parent's, the layer just kept) did not fit already."""
        self.nodes += 1
        if self.nodes > self.node_limit:
            self.aborted = True
            return
        p = self.p
        if remaining <= 0:
            cost = policy_overhead(rho, sigma, p.hide_s, p.bandwidth, p.overlaps)
            if cost >= self.best:
                return
            if p.fits is None or (not checked and self._fits(j)):
                self.best = cost
                self.best_choice = list(self.choice[:j]) + [_K] * (len(self.order) - j)
                return
            checked = True
        if j == len(self.order) or remaining > self.rest_value[j]:
            return
        if self.bound(j, rho, sigma, max(0, remaining)) >= self.best:
            return
        i = self.order[j]
        start = floor if self.same_as_prev[j] else 0
        # Options ranked recompute < swap < keep; identical neighbours take non-decreasing ranks (symmetry breaking).
        for rank in range(start, 3):
            if rank == 0:
                if self.rec_gain[i] <= 0:
                    continue
                # may free nothing yet: a rebuild at least as large, chosen later, makes this one free
                saving = self.rec_gain[i] - (max(0, p.activation[i] - top) if self.rebuild else 0)
                self.choice[j] = _R
                self.run(j + 1, rho + p.forward_s[i], sigma, remaining - saving, 0, max(top, p.activation[i]))
            elif rank == 1:
                saving = self.swap_gain[i]
                if saving <= 0:
                    continue
                self.choice[j] = _S
                self.run(j + 1, rho, sigma + p.activation[i], remaining - saving, 1, top)
            else:
                self.choice[j] = _K
                self.run(j + 1, rho, sigma, remaining, 2, top, checked)
            if self.aborted:
                return
        self.choice[j] = _K


def exact(p: StageProblem, *, cutoff: float = math.inf, node_limit: int = 200_000) -> StageSolution | None:
    """The cheapest memory plan that fits, or None if none fits with extra time below ``cutoff``.

    The answer carries ``proven=False`` when the node limit stopped the search (it is then the best found).
    """
    if p.need_bytes <= 0:
        return keep_all(p)
    start = greedy(p)
    if p.fits is not None:
        # first the exact plan by the additive count (fast: its savings add up, identical layers interchangeable),
        # which fits by the estimate too: the bound the search by the estimate's own peak has to beat
        node_limit //= 2  # the node budget shared by the two searches
        counted = exact(replace(p, fits=None), cutoff=cutoff, node_limit=node_limit)
        if counted is not None and (start is None or counted.extra_s < start.extra_s):
            start = taken_back(p, counted)
    incumbent = min(cutoff, start.extra_s if start is not None else math.inf)
    search = _Search(p, incumbent, node_limit)
    search.run(0, 0.0, 0, search.need, 0)
    if search.best_choice is not None:
        policies = [_K] * len(p.activation)
        for j, i in enumerate(search.order):
            policies[i] = search.best_choice[j]
        return solution(p, policies, proven=not search.aborted)
    if start is not None and start.extra_s < cutoff:
        return StageSolution(start.policies, start.extra_s, start.recompute_s, start.swap_bytes, not search.aborted)
    return None
