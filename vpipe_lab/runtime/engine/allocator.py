"""What the allocator really held at its most over an iteration and its optimizer step, measured apart from the cost
model's counts.

The memory a stage reports (``Executor.memory``) is its static tensors plus the saved activations the ledger counts:
the very quantities the profile feeds the planner, so it agrees with the prediction by construction and cannot show a
temporary, a workspace, an optimizer step's scratch or anything the count misses. This meter reads the allocator
instead. On CUDA: ``torch.cuda.max_memory_allocated`` (every iteration; it costs nothing). On CPU, whose allocator
keeps no statistics: torch.profiler's memory events (every allocation and free through torch's CPU allocator) over a
measured iteration, whose running sum peaks at what the iteration added at its most, on top of what the stage held when
it began (its parameters, gradients, optimizer state and buffers, read off the tensors). The profiler sees no free made
on a thread it does not watch (gloo's workers drop FSDP's collective buffers there): a sharded stage's are supplied
(``deltas``). The profiler slows the iterations it watches, so on CPU only profiling iterations are measured: the
first (warm) one after start-up or a plan change, then one in ``every``; their figure is carried until the next.

A measured iteration also says what each layer allocates beyond what the cost model holds for it (``regions``: the
stage marks each layer's forward, loss, rebuild and backward, and the optimizer step): a forward's or a rebuild's peak
above what it leaves behind, a backward's peak above what was held when it began (not the layer's first backward of the
iteration where others follow: that one also allocates the weights' gradients), and the step's scratch above the static
tensors.
The online profiler reports them per layer (``LayerCost.transient_bytes`` and ``step_bytes``), so the planner's peak
includes the working sets that counting saved tensors cannot see.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Container, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch._C._profiler import _ExtraFields_Allocation
from torch.utils import _pytree as pytree

from vpipe_lab.runtime.memory.ledger import local_tensor, module_param_bytes, tensor_bytes

log = logging.getLogger(__name__)
EVERY = 200  # CPU: besides the first profiling iteration after a trigger, one in this many is measured
PREFIX = "vpipe/"
_WATCHING: PeakMeter | None = None  # the meter measuring now: ``region`` marks what it should tell apart


@contextmanager
def region(name: str) -> Iterator[None]:
    """Mark a stretch of work (``f/3``: layer 3's forward; ``b``, ``r``, ``l``: its backward, rebuild and loss;
    ``step``) for the measuring meter; nothing at all when none measures."""
    meter = _WATCHING
    if meter is None:
        yield
        return
    with meter.mark(name):
        yield


def held(stage: Any) -> int:
    """The bytes a ``Stage``'s own tensors hold now: parameters, gradients, optimizer state and its layers' buffers
    (each tensor once)."""
    seen: set[int] = set()
    total = sum(stage.static_bytes().values())
    for index in stage.owned:
        for b in stage.layers[index].module.buffers():
            if id(b) not in seen and not b.is_meta:
                seen.add(id(b))
                total += tensor_bytes(b)
    return total


def data_bytes(batch: Any) -> int:
    """The bytes of the tensors in ``batch`` (any nesting of tuples, lists and dicts): the batch a stage holds before
    its iteration begins (stage 0's inputs and targets, the loss stage's targets), which the allocator counts but the
    profiler's window, opened after it was read, never sees allocated. Per storage the span its tensors cover: a
    batch sliced out of an in-memory dataset counts its slice, a tensor named twice (or with a view of it) once."""
    spans: dict[int, tuple[int, int]] = {}
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta and leaf.nbytes:
            start, storage = leaf.data_ptr(), leaf.untyped_storage().data_ptr()
            lo, hi = spans.get(storage, (start, start))
            spans[storage] = (min(lo, start), max(hi, start + leaf.nbytes))
    return sum(hi - lo for lo, hi in spans.values())


COLLECTIVES = ("FSDP::", "c10d::", "gloo:", "nccl:", "record_param_comms")  # ops that hand buffers to a comm thread


class Allocation(NamedTuple):
    """One memory event the profiler saw: ``nbytes`` made (a free: negative) at ``at`` (ns) at address ``ptr``;
    ``owner_end``: where it was made inside a collective, the end of the outermost such op (the last moment its
    caller holds it), else None."""

    at: int
    ptr: int
    nbytes: int
    owner_end: int | None = None


def deltas(allocations: Iterable[Allocation], kept: Container[int] = ()) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation and free, with the frees the profiler did not see supplied.

    The profiler records an allocator event only on a thread it watches. A collective's buffers (FSDP's all-gather
    output, gloo's temporaries) are also held by the backend's work object, on gloo's own threads; when that thread
    drops the last reference the free goes unrecorded, and a running sum would hold the buffer to the end of the
    window (measured: mlp 2 x 2 under ``regather``, one 16 MiB all-gather output in two of four backwards, the two
    shards of a stage 8-17% apart). So an allocation that is never seen freed is freed: at its address's next
    allocation (it must have been freed before), and where it was made inside a collective, at the end of that op,
    unless the stage still holds it when the window closes (``kept``: the storages of its parameters, gradients and
    optimizer state, such as the sharded gradient a reduce-scatter made)."""
    out: list[tuple[int, int]] = []
    live: dict[int, Allocation] = {}
    for event in sorted(allocations, key=lambda a: a.at):
        if event.nbytes > 0:
            lost = live.pop(event.ptr, None)
            if lost is not None:  # the address came back without a free: freed unseen, at the latest now
                out.append((min(event.at, lost.owner_end or event.at), -lost.nbytes))
            live[event.ptr] = event
        else:
            live.pop(event.ptr, None)
        out.append((event.at, event.nbytes))
    for event in live.values():
        if event.owner_end is not None and event.ptr not in kept:
            out.append((event.owner_end, -event.nbytes))
    return out


def timeline(changes: Iterable[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """The running sum of byte counts (allocations positive, frees negative) in time order: times and the sum after
    each."""
    times, sums, total = [], [], 0
    for t, nbytes in sorted(changes):
        total += nbytes
        times.append(t)
        sums.append(total)
    return times, sums


def listed(events: Any) -> tuple[list[tuple[int, int]], list[tuple[str, int, int]]]:
    """(time, bytes) of the allocator events and the marked regions (name, start, end) as the profiler's event list
    has them: no addresses, so a free made on an unwatched thread stays unseen (``read`` supplies those)."""
    changes: list[tuple[int, int]] = []
    marks: list[tuple[str, int, int]] = []
    for e in events:
        name = e.name()
        if name == "[memory]":
            changes.append((e.start_ns(), e.nbytes()))
        elif name.startswith(PREFIX):
            marks.append((name, e.start_ns(), e.end_ns()))
    return changes, marks


def read(result: Any) -> tuple[list[Allocation], list[tuple[str, int, int]]]:
    """A profiler's CPU allocations (each with its collective owner's end) and its marked regions (name, start,
    end), from its event tree."""
    allocations: list[Allocation] = []
    marks: list[tuple[str, int, int]] = []
    # each attribute read builds a Python object: read the fewest (the measured iteration waits for this walk). The
    # meter reads CPU jobs only, so every allocation is the CPU allocator's
    stack: list[tuple[Any, int | None]] = [(event, None) for event in result.experimental_event_tree()]
    while stack:
        event, owner_end = stack.pop()
        fields = event.extra_fields
        if isinstance(fields, _ExtraFields_Allocation):
            allocations.append(Allocation(event.start_time_ns, fields.ptr, fields.alloc_size, owner_end))
            continue
        name = event.name
        if name.startswith(PREFIX):
            marks.append((name, event.start_time_ns, event.end_time_ns))
        if owner_end is None and name.startswith(COLLECTIVES):
            owner_end = event.end_time_ns  # the outermost collective op: what is made below it is the collective's
        children = event.children
        if children:
            stack.extend([(child, owner_end) for child in children])
    return allocations, marks


def held_storages(stage: Any) -> set[int]:
    """The addresses of the storages a stage's parameters, gradients, optimizer state and buffers hold now."""
    tensors: list[torch.Tensor] = []
    for _, p in stage.params():
        tensors += [p, *([p.grad] if p.grad is not None else [])]
    if stage.optimizer is not None:
        tensors += [v for state in stage.optimizer.state.values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
    for index in stage.owned:
        tensors += list(stage.layers[index].module.buffers())
    return {local_tensor(t).untyped_storage().data_ptr() for t in tensors if not t.is_meta}


def ranges(marks: Iterable[tuple[str, int, int]], times: list[int],
           sums: list[int]) -> dict[str, tuple[int, int, int]]:
    """Each marked region's (bytes at its start, its peak, at its end), relative to the iteration's start; a region
    seen several times (micro-batches) keeps its largest transient."""
    out = Largest()
    for name, begin, end in sorted(marks, key=lambda m: m[1]):  # in time order: a layer's first backward comes first
        lo = bisect.bisect_left(times, begin)
        hi = bisect.bisect_right(times, end)
        start = sums[lo - 1] if lo > 0 else 0
        inside = sums[lo:hi]
        out.add(name[len(PREFIX):], (start, max([start, *inside]), inside[-1] if inside else start))
    return out.regions()


class Largest:
    """Each region's largest transient over its occurrences, a layer's first backward of the iteration aside when
    it has others: that one also allocates the weights' gradients (the optimizer step set them to None), which the
    cost model counts with the static tensors already."""

    def __init__(self) -> None:
        self.found: dict[str, tuple[int, int, int]] = {}
        self.first: dict[str, tuple[int, int, int]] = {}

    def add(self, key: str, found: tuple[int, int, int]) -> None:
        if key.startswith("b/") and key not in self.first:
            self.first[key] = found
            return
        old = self.found.get(key)
        if old is None or found[1] - min(found[0], found[2]) > old[1] - min(old[0], old[2]):
            self.found[key] = found

    def regions(self) -> dict[str, tuple[int, int, int]]:
        return {**{k: v for k, v in self.first.items() if k not in self.found}, **self.found}


def extras(found: dict[str, tuple[int, int, int]]) -> tuple[dict[int, int], int]:
    """Per layer, what it allocates beyond what the cost model holds for it (a forward, loss or rebuild: its peak
    above what it leaves behind; a backward: its peak above what was held when it began), and the optimizer step's
    scratch."""
    per: dict[int, int] = {}
    step = 0
    for key, (start, peak, end) in found.items():
        kind, _, index = key.partition("/")
        if kind == "step":
            step = max(step, peak - start)
        elif index.isdigit() and kind in ("f", "l", "r", "b"):  # not a sharded stage's gathers and reduces
            # what a forward, loss or rebuild leaves behind the cost model holds already (a rebuild: the layer's
            # activations, rebuilt), so only its peak above that is the layer's own
            extra = peak - end if kind in ("f", "l", "r") else peak - start
            per[int(index)] = max(per.get(int(index), 0), extra)
    return per, step


def note(stage: Any, per_layer: dict[int, int], step: int) -> None:
    """Each owned layer's working set beyond what is held for it, and its share of the optimizer step's scratch:
    the step runs per parameter group (one per layer), so its scratch is taken as proportional to the largest
    layer's parameters and charged to every layer by its own."""
    params = {i: module_param_bytes(stage.layers[i].module) for i in stage.owned}
    largest = max(params.values(), default=0)
    # a sharded stage: what FSDP's own hooks made whole inside a layer is priced by the cost model apart
    inside = stage.shards.inside if getattr(stage, "shards", None) is not None else {}
    for i in stage.owned:
        stats = stage.layers[i].stats
        stats.transient_bytes = max(stats.transient_bytes, per_layer.get(i, 0) - inside.get(i, 0))
        if largest:
            stats.step_bytes = max(stats.step_bytes, step * params[i] // largest)


class PeakMeter:
    """``start`` before an iteration, ``stop`` after its step: the bytes allocated at the peak, or None when this
    iteration was not measured; what its regions allocated beyond what is held (``layer_extras``, ``step_extra``)."""

    def __init__(self, device: torch.device, every: int = EVERY) -> None:
        self.device, self.every = device, every
        self._profiler: Any = None
        self._base = 0
        self._iteration = 0
        self._cuda = Largest()
        self._cuda_peak = 0
        self.pending = True  # measure the next profiling iteration (start-up, a plan change: ``soon``)
        self.last: int | None = None  # the newest measurement
        self.measured_at: int | None = None  # the iteration it was measured in
        self.layer_extras: dict[int, int] = {}  # the newest measured iteration's, per layer
        self.step_extra = 0

    def soon(self) -> None:
        """The plan or the model changed: measure the next profiling iteration."""
        self.pending = True

    def due(self, iteration: int, profiling: bool) -> bool:
        if self.device.type == "cuda":
            return True
        last = self.measured_at
        return profiling and (self.pending or last is None or iteration - last >= self.every)

    def start(self, iteration: int, held: int, profiling: bool = False) -> bool:
        """``held``: the bytes of the stage's tensors now (CPU: the base the profiled allocations add to);
        ``profiling``: a profiling iteration (one layer per segment, what CPU measurements ride on). Whether its
        regions are measured (the stage then skips its micro-batch-size probes, whose allocations are no layer's)."""
        global _WATCHING
        self.stop(discard=True)
        if not self.due(iteration, profiling):
            return False
        self._iteration, self._cuda, self._cuda_peak = iteration, Largest(), 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._profiler = "cuda"
        else:
            try:
                profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                profiler.__enter__()
            except Exception as exc:  # another profiler is running (a user's own): not measured this time
                log.info("the allocator's peak is not measured in iteration %d: %s", iteration, exc)
                return False
            self._profiler, self._base = profiler, held
        _WATCHING = self if profiling else None
        return profiling

    @contextmanager
    def mark(self, name: str) -> Iterator[None]:
        if self._profiler is None:
            yield
        elif self._profiler == "cuda":  # the allocator's own counters, around the region
            before = torch.cuda.memory_allocated(self.device)
            self._cuda_peak = max(self._cuda_peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            try:
                yield
            finally:
                peak, after = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
                self._cuda_peak = max(self._cuda_peak, peak)
                self._cuda.add(name, (before, peak, after))
        else:
            with torch.profiler.record_function(PREFIX + name):
                yield

    def stop(self, stage: Any = None, discard: bool = False) -> int | None:
        """End a measurement; its peak (also kept in ``last``), None if none was running or ``discard``. What its
        regions allocated goes to ``stage``'s layer stats (``LayerStats.transient_bytes``, ``step_bytes``), for the
        profiler."""
        global _WATCHING
        profiler, self._profiler = self._profiler, None
        if _WATCHING is self:
            _WATCHING = None
        if profiler is None:
            return None
        if profiler == "cuda":
            peak = max(self._cuda_peak, int(torch.cuda.max_memory_allocated(self.device)))
            found = self._cuda.regions()
        else:
            profiler.__exit__(None, None, None)
            if discard:
                return None
            kineto = profiler.profiler.kineto_results
            if stage is not None and getattr(stage, "shards", None) is not None:
                # FSDP's collective buffers are dropped on gloo's threads: the frees the profiler misses, supplied
                allocations, marks = read(kineto)
                changes = deltas(allocations, held_storages(stage))
            else:  # a whole stage's own thread frees what it made: the event list (a third of the walk's time)
                changes, marks = listed(kineto.events())
            times, sums = timeline(changes)
            peak = self._base + max(sums, default=0)
            found = ranges(marks, times, sums)
        if discard:
            return None
        if found:
            self.layer_extras, self.step_extra = extras(found)
            self.pending = False
            if stage is not None:
                note(stage, self.layer_extras, self.step_extra)
        self.last, self.measured_at = peak, self._iteration
        return peak

    def report(self) -> dict[str, Any]:
        """The newest measurement for the memory report: ``allocated_peak`` and the iteration it was measured in."""
        return {} if self.last is None else {"allocated_peak": self.last, "allocated_at": self.measured_at}
