"""Per-stage memory plans: which layers to keep, swap or recompute so a stage fits its budget at least cost.

Both solvers minimise the stage's extra backward time ``max(recompute_s, swap_bytes / bandwidth - hide_s)``, or
``recompute_s + 2 swap_bytes / bandwidth`` where copies run on the compute thread (see ``costmodel.policy_overhead``),
subject to the stage's peak memory fitting its budget. ``greedy`` is vPipe's rule (swap the largest activations while
the transfers hide, then recompute by bytes freed per second) on additive savings that never understate the peak
(``CostModel.planned_peak_bytes``; a stage that fits by the estimate's own peak is taken as fitting), then takes back
what the estimate's own peak shows was not needed; ``memory_search.exact`` is a branch-and-bound on the estimate's own
peak (``StageProblem.fits``: the numbers the user is shown) that proves its answer optimal unless it runs out of nodes.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

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

    def relaxed_frees(self) -> tuple[int, list[int], list[int]]:
        """What each layer frees at most by the estimate's own peak (the relaxation ``relaxed_need`` is weighed
        against): the bytes per swapped activation byte, and per layer swapped and recomputed. Each of the ``weight``
        micro-batches in flight counts a layer once; a swapped layer's copies stay in the swap buffers
        (``swap_buffers``) and free nothing there."""
        w = self.weight
        rate = w - swap_buffers(w)
        return (rate, [rate * a for a in self.activation],
                [w * max(0, a - x) for a, x in zip(self.activation, self.inputs)])


@dataclass(frozen=True)
class StageSolution:
    """A memory plan for one stage: policies of layers lo:hi in order, and what they cost."""

    policies: tuple[Policy, ...]
    extra_s: float
    recompute_s: float
    swap_bytes: int
    proven: bool = True


def solution(p: StageProblem, policies: list[Policy], proven: bool = True) -> StageSolution:
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
    # then by the estimate's own peak (``taken_back``), which credits what the count cannot.
    for i in reversed(dict.fromkeys(chosen)):
        if policies[i] is not _K and tally.excess_with(i, _K) <= 0:
            tally.set(i, _K)
    return taken_back(p, solution(p, policies))


def taken_back(p: StageProblem, found: StageSolution) -> StageSolution:
    """``found`` with every choice the estimate's own peak shows was not needed kept instead, costliest first."""
    if p.fits is None:
        return found
    policies = list(found.policies)
    # The relaxation the exact search bounds by (what a choice frees, never understated) answers first: where even it
    # leaves bytes over the budget, the estimate's peak cannot fit, and is not asked.
    _, swapped, recomputed = p.relaxed_frees()

    def frees(i: int, x: Policy) -> int:
        return swapped[i] if x is _S else recomputed[i] if x is _R else 0

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
    return solution(p, policies, found.proven)
