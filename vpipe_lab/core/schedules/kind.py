"""A schedule as one object: its name, placement, what it changes about training, its order, its checks, its costs.

Each schedule the lab runs is a subclass of ``ScheduleKind`` in a module of its own (``core/schedules/``), registered
by name (``registry.py``). What the rest of the lab asks of a schedule it asks here: the planners and the cost model
(how many micro-batches a stage holds, the iteration's time, PipeDream's weight copies), the simulator and the
executor (the IR order, whether the backward is split, whether weights update per micro-batch), launch and live
changes (the checks of a plan and of the training settings), and the export (torch's class for it). A new schedule
writes ``orders``; everything else has a default worked out from that order (the memory a stage holds along it, the
iteration by replaying it), which a schedule with a closed form overrides.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from vpipe_lab.core.schedules.actions import Action, Op, Schedule, run_schedule
from vpipe_lab.core.schedules.expand import expand
from vpipe_lab.core.schedules.orders import held as held_states

if TYPE_CHECKING:
    from vpipe_lab.core.schedules.plan_view import PlanView as Plan

TRANSFERS_LIMIT = 1 << 16  # stages x micro-batches beyond which the transfers' bytes are not walked along the order
Step = tuple[Op, int, int]  # (F | B | W, chunk, micro-batch): one compute step of a row's order
# How stage times combine into an iteration in the partition search (``planning/partition.Objective``): GPipe's shape
# (every forward, then every backward), 1F1B's (the slowest stage's step M - 1 times, plus one pass), or the slowest
# stage alone (PipeDream's planner, which plans throughput).
GPIPE_SHAPED, ONE_F_ONE_B_SHAPED, BOTTLENECK = "gpipe", "1f1b", "bottleneck"


@dataclass(frozen=True)
class TorchSchedule:
    """The torch.distributed.pipelining class that can run a schedule: its ``get_schedule_class`` name, its placement
    style and when its order is exactly the lab's (stages, chunks per stage, micro-batches)."""

    name: str
    style: str  # "loop" | "v": torch.distributed.pipelining._utils.generate_stage_to_rank_mapping's style
    exact: Callable[[int, int, int], bool]
    note: str


class ScheduleKind:
    """One schedule: subclass it, set ``name`` (and the flags that differ), write ``orders``, register an instance."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    chunked: ClassVar[bool] = False  # several chunks (virtual stages) per stage
    virtual_choices: ClassVar[tuple[int, ...]] = ()  # the chunks per stage it runs (empty: any, when chunked)
    split_backward: ClassVar[bool] = False  # B (input gradient) and W (weights' gradients) as separate steps
    asynchronous: ClassVar[bool] = False  # weights update after every micro-batch: other training semantics
    flush: ClassVar[str] = ONE_F_ONE_B_SHAPED  # how stage times combine in the partition search (or GPIPE_SHAPED)
    megatron: ClassVar[str] = ""  # Megatron-LM's name for this very order ("": Megatron-LM runs another one)
    torch: ClassVar[TorchSchedule | None] = None  # the torch class that runs it, if one can
    export_refusal: ClassVar[str] = ""  # why torch cannot run it at all ("" when it can, by class or CSV)

    # --- the order ------------------------------------------------------------------------------------------------
    def orders(self, stages: int, virtual: int, microbatches: int, plan: Plan | None = None) -> list[list[Step]]:
        """Each stage's (row's) compute steps in order; ``plan`` (when there is one) may refine it (its policies)."""
        raise NotImplementedError(f"schedule {self.name!r} does not say its order: write its orders()")

    @property
    def default_virtual(self) -> int:
        """Chunks per stage when none is given."""
        return (self.virtual_choices[0] if self.virtual_choices else 2) if self.chunked else 1

    def placement(self, stages: int, chunks: int) -> tuple[int, ...]:
        """The stage of each chunk: looped (chunk ``c`` on stage ``c % stages``) unless the schedule says otherwise."""
        return tuple(c % stages for c in range(chunks))

    def build(self, stages: int, microbatches: int, plan: Plan | None = None, virtual: int | None = None) -> Schedule:
        """The schedule IR: the order of every row with its receives, sends, swaps and recomputes (``expand``)."""
        v = virtual if virtual is not None else plan.virtual_stages if plan is not None else self.default_virtual
        chunks = stages * v
        where = self.placement(stages, chunks)
        rows = [expand(order, chunks, plan, where if self.chunked else ())
                for order in self.orders(stages, v, microbatches, plan)]
        return Schedule(tuple(rows), microbatches, self.name, where if self.chunked else ())

    def full_backwards(self, stages: int, microbatches: int) -> frozenset[tuple[int, int]]:
        """Under a split backward, the (chunk, micro-batch) whose B is followed at once by its W as one whole
        backward (torch's ``B`` rather than ``I`` then ``W``); none by default."""
        return frozenset()

    # --- checks ---------------------------------------------------------------------------------------------------
    def check_virtual(self, virtual: int) -> str | None:
        """Why it cannot run ``virtual`` chunks per stage, if it cannot."""
        if virtual > 1 and not self.chunked:
            return f"virtual_stages={virtual} needs a chunked schedule, not {self.name!r}"
        if self.chunked and self.virtual_choices and virtual not in self.virtual_choices:
            return (f"{self.name} runs {' or '.join(map(str, self.virtual_choices))} chunks per stage, not "
                    f"virtual_stages={virtual}")
        return None

    def check(self, stages: int, microbatches: int) -> str | None:
        """Why a plan of ``stages`` stages and ``microbatches`` micro-batches cannot run, if it cannot."""
        return None

    def training_refusal(self, clip_grad_norm: float | None, precision: str, replicas: int) -> str | None:
        """Why it cannot train with these settings, if it cannot (said once here for every caller)."""
        return None

    def auto_virtuals(self, stages: int, layers: int, microbatches: int | None) -> tuple[int, ...]:
        """The chunks per stage the planner's ``schedule="auto"`` tries with it (empty: never chosen by "auto")."""
        if self.asynchronous:
            return ()  # other training semantics: a user asks for it by name
        if self.chunked:
            v = self.default_virtual
            return (v,) if microbatches is not None and stages * v <= layers else ()
        return (1,)

    # --- costs (defaults from the order; built-in schedules override with their closed forms) -------------------
    def inflight(self, stages: int, chunk: int, microbatches: int, virtual: int) -> int:
        """Micro-batches whose activations chunk ``chunk`` holds at its peak (forwards run, backwards not yet)."""
        return _peaks(self, stages, virtual, microbatches)[chunk]

    def held(self, stages: int, virtual: int, microbatches: int, rank: int) -> tuple[tuple[int, ...], ...]:
        """A chunked schedule's states along ``rank``'s order (``core/schedules/orders/held.py``); empty for the others."""
        if not self.chunked:
            return ()
        order = self.orders(stages, virtual, microbatches)[rank]
        where = self.placement(stages, stages * virtual)
        mine = [c for c in range(stages * virtual) if where[c] == rank]
        return held_states.states([(op.value, c, mb) for op, c, mb in order], mine)

    def transfers(self, stages: int, microbatches: int, rank: int) -> tuple[held_states.Transfers, ...]:
        """What a stage's transfers hold along its order (``orders/held.py``: ``transfers``); empty for chunked
        schedules, and for pipelines so long (over ``TRANSFERS_LIMIT`` stages x micro-batches) that walking every
        stage's order would slow the planners down."""
        if self.chunked or stages * microbatches > TRANSFERS_LIMIT:
            return ()
        return _transfers_cache(self, stages, microbatches)[rank]

    def waiting_w(self, stages: int, stage: int, microbatches: int) -> int:
        """Micro-batches of a split backward that wait only for their W on ``stage`` at its peak (0: none beyond the
        in-flight ones)."""
        return 0

    def stashed_versions(self, stages: int, stage: int, microbatches: int) -> int:
        """Copies of its weights ``stage`` keeps besides the live ones (weight stashing)."""
        return 0

    def weight_copies(self, stages: int, stage: int, microbatches: int) -> int:
        """How many of an iteration's updates on ``stage`` first copy its weights (weight stashing)."""
        return 0

    def iteration_time(self, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                       wgrad: Sequence[float] = (), latency_s: float = 0.0, inflight: Sequence[int] = ()) -> float:
        """The iteration from each stage's forward and backward time per micro-batch (``wgrad``: the W part of a
        split backward), a transfer arriving ``latency_s`` after its send: by default the order replayed with them."""
        stages = len(forward)
        weights = list(wgrad) or [0.0] * stages
        split = self.split_backward

        def duration(a: Action) -> float:
            s = a.stage % stages
            if a.op is Op.F:
                return forward[s]
            if a.op is Op.B:
                return backward[s] - (weights[s] if split else 0.0)
            if a.op is Op.W:
                return weights[s]
            return 0.0

        return run_schedule(self.build(stages, microbatches, virtual=1), duration, latency_s=latency_s).iteration_s

    def chunks_iteration_time(self, chunk_s: Sequence[float], wgrad_s: Sequence[float], stages: int,
                              microbatches: int, latency_s: float = 0.0) -> float:
        """A chunked schedule's iteration from each chunk's time per micro-batch (``wgrad_s``: its W step's): by
        default the order replayed with each chunk's time split evenly between its forward and its backward."""
        chunks = len(chunk_s)
        weights = list(wgrad_s) or [0.0] * chunks
        split = self.split_backward

        def duration(a: Action) -> float:
            half = chunk_s[a.stage] / 2
            if a.op is Op.F:
                return half
            if a.op is Op.B:
                return half - (weights[a.stage] if split else 0.0)
            if a.op is Op.W:
                return weights[a.stage]
            return 0.0

        built = self.build(stages, microbatches, virtual=chunks // stages)
        return run_schedule(built, duration, latency_s=latency_s).iteration_s


@functools.cache
def _peak_cache(kind: ScheduleKind, stages: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    held: dict[int, int] = {}
    peak: dict[int, int] = {}
    for row in kind.orders(stages, virtual, microbatches):
        for op, c, _ in row:
            held[c] = held.get(c, 0) + (1 if op is Op.F else -1 if op is Op.B else 0)
            peak[c] = max(peak.get(c, 0), held[c])
    return tuple(peak.get(c, 0) for c in range(stages * virtual))


@functools.cache
def _transfers_cache(kind: ScheduleKind, stages: int, microbatches: int) -> tuple[tuple[held_states.Transfers, ...], ...]:
    rows = kind.orders(stages, 1, microbatches)
    return tuple(held_states.transfers([(op.value, c, mb) for op, c, mb in row], rank > 0, rank < stages - 1)
                 for rank, row in enumerate(rows))


def _peaks(kind: ScheduleKind, stages: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    """Each chunk's most micro-batches between forward and backward along the order (cached per shape)."""
    return _peak_cache(kind, stages, virtual, microbatches)

