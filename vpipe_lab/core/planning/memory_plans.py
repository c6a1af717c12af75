"""Per-stage memory plans: which layers to keep, swap or recompute so a stage fits its budget at least cost.

Both solvers minimise the stage's extra backward time ``max(recompute_s, swap_bytes / bandwidth - hide_s)``, or
``recompute_s + 2 swap_bytes / bandwidth`` where copies run on the compute thread (see ``costmodel.policy_overhead``),
subject to the stage's peak memory fitting its budget. ``greedy`` is vPipe's rule (swap the largest activations while
the transfers hide, then recompute by bytes freed per second) on additive savings that never understate the peak
(``CostModel.planned_peak_bytes``; a stage that fits by the estimate's own peak is taken as fitting), then takes back
what the estimate's own peak shows was not needed; ``exact`` is a branch-and-bound on the estimate's own peak
(``StageProblem.fits``: the numbers the user is shown), pruned by a relaxation that never overstates what a
completion can free, and proves its answer optimal unless it runs out of nodes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from vpipe_lab.core.cost.costmodel import CostModel, policy_overhead, swap_buffers
from vpipe_lab.core.plan import Policy

_K, _S, _R = Policy.KEEP, Policy.SWAP, Policy.RECOMPUTE


@dataclass(frozen=True)
class StageProblem:
    """The memory-plan problem of layers ``lo:hi`` on one stage."""

    lo: int
    activation: tuple[int, ...]
    inputs: tuple[int, ...]
    forward_s: tuple[float, ...]
    inflight: int
    need_bytes: int
    hide_s: float
    bandwidth: float
    overlaps: bool = True  # swaps beside the compute (GPU); False: on the compute thread (CPU), nothing hides

    swap_save: tuple[int, ...] = ()
    rec_save: tuple[int, ...] = ()
    rec_most: tuple[int, ...] = ()
    # The estimate's own verdict on policies for lo:hi (None: decide by the additive savings alone), and its peak
    # with every layer kept over the budget (``relaxed_need``). A layer swapped lowers each micro-batch's resident
    # bytes by at most its activations, recomputed by at most what they exceed its input by; each of the ``weight``
    # micro-batches in flight counts them once at most (the one a layer runs in, its rebuild and the gradients' credit
    # included: ``CostModel.stage_cost``) and the swap buffers hold ``swap_buffers(weight)`` of a swapped layer's, so
    # that peak less those savings never overstates a choice's peak
    fits: Callable[[tuple[Policy, ...]], bool] | None = field(default=None, compare=False)
    relaxed_need: int = 0
    weight: int = 0

    def __post_init__(self) -> None:
        n = self.inflight
        # Swapping frees every in-flight micro-batch but the transfer buffers; recompute keeps only the input, and
        # holds the layer's activations again while it is rebuilt, one recomputed layer at a time (the cost model
        # charges the largest, core/cost/costmodel.py). ``rec_save`` charges each layer its own rebuild (additive, never
        # more than it frees: the greedy's), ``rec_most`` none (what it frees when a larger one is rebuilt anyway:
        # the exact search's bound); ``_Search`` tracks the largest rebuild for the exact figure.
        # A swapped layer's save of its input stays on the device where it begins a run of swapped layers (the
        # stage holds the run's input anyway: costmodel.py); taken as staying for every one, so savings add up.
        rate, pairs = n - swap_buffers(n), list(zip(self.activation, self.inputs))
        object.__setattr__(self, "swap_save", tuple([rate * (a - x) if a > x else 0 for a, x in pairs]))
        object.__setattr__(self, "rec_save", tuple([n * (a - x) - a if n * (a - x) > a else 0 for a, x in pairs]))
        object.__setattr__(self, "rec_most", tuple([n * (a - x) if a > x else 0 for a, x in pairs]))

    @classmethod
    def of(cls, cm: CostModel, stage: int, lo: int, hi: int) -> StageProblem:
        def fits(policies: tuple[Policy, ...]) -> bool:
            full[lo:hi] = policies  # one list for the stage's search: only lo:hi is read
            return cm.peak_bytes(stage, lo, hi, full) <= cm.budget(stage)

        keep = (_K,) * cm.num_layers
        full = list(keep)
        kept = cm.stage_cost(stage, lo, hi, keep)
        floor = kept.static_bytes + max(kept.step_bytes, kept.end_bytes)
        held = (kept.activation_bytes + kept.swap_buffer_bytes + kept.rebuild_bytes + kept.comm_bytes
                + kept.whole_bytes)  # the estimate's peak with every layer kept, but the step's and the end's
        relaxed = kept.static_bytes + held - cm.budget(stage) if floor <= cm.budget(stage) else 1 << 62
        return cls(
            fits=fits,
            relaxed_need=relaxed,
            weight=kept.inflight,
            lo=lo,
            activation=tuple(cm.act[lo:hi]),
            inputs=tuple(cm.inp[lo:hi]),
            forward_s=tuple(cm.fwd[lo:hi]),
            inflight=cm.inflight(stage),
            # the optimizer step's scratch comes when no activation is held: no policy lowers it
            need_bytes=(cm.keep_all_bytes(stage, lo, hi) - cm.budget(stage)
                        if cm.step_peak_bytes(stage, lo, hi) <= cm.budget(stage) else 1 << 62),
            hide_s=cm.hide_s(stage, lo, hi),
            bandwidth=cm.cluster.swap_bandwidth,
            overlaps=cm.cluster.swap_overlaps,
        )

    def swap_saving(self, i: int) -> int:
        """Bytes swapping layer i frees."""
        return self.swap_save[i]

    def recompute_saving(self, i: int) -> int:
        """Bytes recomputing layer i frees."""
        return self.rec_save[i]


@dataclass(frozen=True)
class StageSolution:
    """A memory plan for one stage: policies of layers lo:hi in order, and what they cost."""

    policies: tuple[Policy, ...]
    extra_s: float
    recompute_s: float
    swap_bytes: int
    proven: bool = True


def _solution(p: StageProblem, policies: list[Policy], proven: bool = True) -> StageSolution:
    rho = sum(p.forward_s[i] for i, x in enumerate(policies) if x is _R)
    sigma = sum(p.activation[i] for i, x in enumerate(policies) if x is _S)
    extra = policy_overhead(rho, sigma, p.hide_s, p.bandwidth, p.overlaps)
    return StageSolution(tuple(policies), extra, rho, sigma, proven)


def keep_all(p: StageProblem) -> StageSolution:
    return StageSolution((_K,) * len(p.activation), 0.0, 0.0, 0)


class _Tally:
    """Policies with what is still over the budget, kept current as one layer changes (a sum over the stage at every
    change the greedy weighs made it quadratic): every swap frees its in-flight copies but the buffers, every
    recompute its saved activations but the input, and the largest recomputed layer is held again while rebuilt.
    ``rho`` is the forward time recomputed, ``sigma`` the bytes swapped."""

    def __init__(self, p: StageProblem) -> None:
        self.p, self.policies, self.freed, self.rho, self.sigma = p, [_K] * len(p.activation), 0, 0.0, 0
        self.rebuilt: Counter[int] = Counter()
        self.top = 0  # max(rebuilt): the rebuild held, kept current (the greedy asks for it at every layer it weighs)

    def frees(self, i: int, policy: Policy) -> int:
        """Bytes layer i frees under ``policy``."""
        return self.p.swap_save[i] if policy is _S else self.p.rec_most[i] if policy is _R else 0

    def set(self, i: int, policy: Policy) -> None:
        p, old, a = self.p, self.policies[i], self.p.activation[i]
        self.freed += self.frees(i, policy) - self.frees(i, old)
        if old is _R:
            self.rebuilt[a] -= 1
            if not self.rebuilt[a]:
                del self.rebuilt[a]
                self.top = max(self.rebuilt, default=0) if a == self.top else self.top
        if policy is _R:
            self.rebuilt[a] += 1
            self.top = max(self.top, a)
        self.rho += p.forward_s[i] * ((policy is _R) - (old is _R))
        self.sigma += p.activation[i] * ((policy is _S) - (old is _S))
        self.policies[i] = policy

    def excess(self) -> int:
        return self.p.need_bytes - self.freed + self.top

    def excess_with(self, i: int, policy: Policy) -> int:
        """``excess()`` were layer i to take ``policy``; nothing changes."""
        old, a, top = self.policies[i], self.p.activation[i], self.top
        if old is _R and a == top and self.rebuilt[a] == 1:  # its rebuild was the one held: the next largest is
            top = max((x for x in self.rebuilt if x != a), default=0)
        top = max(top, a) if policy is _R else top
        return self.p.need_bytes - (self.freed - self.frees(i, old) + self.frees(i, policy)) + top


def greedy(p: StageProblem) -> StageSolution | None:
    """vPipe's memory plan: swap while hidden, then recompute by bytes freed per second, then exposed swap.

    Returns None when even swapping or recomputing every layer does not fit. What is still over the budget is
    counted exactly after each choice (``excess``: one rebuild held, the largest), so a stage that needs many
    recomputed layers is not refused for charging each its own rebuild.
    """
    n = len(p.activation)
    if p.need_bytes <= 0 or (p.fits is not None and p.fits((_K,) * n)):  # fits as it is, by the count or the estimate
        return keep_all(p)
    tally = _Tally(p)
    policies = tally.policies  # read here, changed only through the tally
    chosen: list[int] = []
    # Largest activations first; on ties the earlier layer, whose forward-to-backward gap is longer.
    by_size = sorted(range(n), key=lambda i: (-p.activation[i], i))

    def swap_hidden() -> None:
        if not p.overlaps:  # nothing hides a copy on the compute thread
            return
        for i in by_size:
            if tally.excess() <= 0:
                return
            saving = p.swap_saving(i)
            if policies[i] is _K and saving > 0 and (tally.sigma + p.activation[i]) / p.bandwidth <= p.hide_s + tally.rho:
                tally.set(i, _S)
                chosen.append(i)

    swap_hidden()
    by_rate = sorted(
        (i for i in range(n) if p.rec_most[i] > 0),
        key=lambda i: (-p.recompute_saving(i) / p.forward_s[i] if p.forward_s[i] > 0 else -math.inf, i),
    )
    for i in by_rate:
        if tally.excess() <= 0:
            break
        if policies[i] is not _K:
            continue
        tally.set(i, _R)
        chosen.append(i)
        swap_hidden()  # recompute lengthens the backward, so more swap may now hide under it
    # Still over: move layers to whichever option frees the most (now at the price of exposed transfers or
    # recompute), biggest gains first.
    def gain(i: int) -> tuple[int, Policy]:
        swapped, recomputed = tally.excess_with(i, _S), tally.excess_with(i, _R)
        return (tally.excess() - swapped, _S) if swapped <= recomputed else (tally.excess() - recomputed, _R)

    for i in sorted(range(n), key=lambda i: -gain(i)[0]):
        if tally.excess() <= 0:
            break
        extra, best = gain(i)
        if extra <= 0:
            continue
        tally.set(i, best)
        chosen.append(i)
    if tally.excess() > 0 and (p.fits is None or not p.fits(tuple(policies))):
        return None  # over the budget by the count, and by the estimate's own peak where the stage has one
    # Undo what turned out unnecessary, latest choice first (the costliest were added last), by the additive count,
    # then by the estimate's own peak (``_taken_back``), which credits what the count cannot.
    for i in reversed(dict.fromkeys(chosen)):
        if policies[i] is not _K and tally.excess_with(i, _K) <= 0:
            tally.set(i, _K)
    return _taken_back(p, _solution(p, policies))


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
            w = p.weight
            # a swapped layer's copies stay in the swap buffers (``swap_buffers``) and free nothing there
            self.swap_rate = w - swap_buffers(w)
            self.swap_gain = [self.swap_rate * a for a in p.activation]
            self.rec_gain = [w * max(0, a - x) for a, x in zip(p.activation, p.inputs)]
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
            start = _taken_back(p, counted)
    incumbent = min(cutoff, start.extra_s if start is not None else math.inf)
    search = _Search(p, incumbent, node_limit)
    search.run(0, 0.0, 0, search.need, 0)
    if search.best_choice is not None:
        policies = [_K] * len(p.activation)
        for j, i in enumerate(search.order):
            policies[i] = search.best_choice[j]
        return _solution(p, policies, proven=not search.aborted)
    if start is not None and start.extra_s < cutoff:
        return StageSolution(start.policies, start.extra_s, start.recompute_s, start.swap_bytes, not search.aborted)
    return None


def _taken_back(p: StageProblem, found: StageSolution) -> StageSolution:
    """``found`` with every choice the estimate's own peak shows was not needed kept instead, costliest first."""
    if p.fits is None:
        return found
    policies = list(found.policies)
    # The relaxation the exact search bounds by (``_Search``: what a choice frees, never understated) answers first:
    # where even it leaves bytes over the budget, the estimate's peak cannot fit, and is not asked.
    w = p.weight
    rate = w - swap_buffers(w)

    def frees(i: int, x: Policy) -> int:
        a = p.activation[i]
        return rate * a if x is _S else w * max(0, a - p.inputs[i]) if x is _R else 0

    freed = sum(frees(i, x) for i, x in enumerate(policies))
    for i in sorted((i for i, x in enumerate(policies) if x is not _K), key=lambda i: -p.forward_s[i]):
        old = policies[i]
        if p.relaxed_need > freed - frees(i, old):
            continue
        policies[i] = _K
        if p.fits(tuple(policies)):
            freed -= frees(i, old)
        else:
            policies[i] = old
    return _solution(p, policies, found.proven)
