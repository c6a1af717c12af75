"""The allocator's peak, measured apart from the cost model's counts: a known sequence of allocations gives its known
peak, and each marked region what it allocated beyond what it leaves behind (a forward) or found held (a backward)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vpipe_lab.runtime.engine import allocator
from vpipe_lab.runtime.engine.allocator import PeakMeter, extras, region

MB = 2**20


def floats(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes // 4, dtype=torch.float32)


def test_a_known_pattern_gives_its_peak_and_each_region_its_working_set() -> None:
    meter = PeakMeter(torch.device("cpu"))
    assert meter.start(iteration=7, held=10 * MB, profiling=True)
    kept = []
    with region("f/3"):  # a forward: 2 MB of scratch, 1 MB left behind (saved for backward)
        scratch = floats(2 * MB)
        kept.append(floats(MB))
        del scratch
    with region("b/3"):  # a backward: 3 MB more at its most, then it frees the saved 1 MB
        grads = floats(3 * MB)
        kept.clear()
        del grads
    with region("step"):  # the optimizer's scratch: 512 KB
        floats(MB // 2)  # made and dropped at once
    peak = meter.stop()
    assert peak == 10 * MB + 4 * MB  # what was held, plus the saved 1 MB with the backward's 3 MB on top
    assert meter.report() == {"allocated_peak": 14 * MB, "allocated_at": 7}
    assert meter.layer_extras == {3: 3 * MB} and meter.step_extra == MB // 2  # the forward's scratch was 2 MB
    assert allocator._WATCHING is None  # nothing marks once it stopped


def test_regions_cost_nothing_when_no_meter_watches_and_a_non_profiling_iteration_is_not_measured_on_cpu() -> None:
    meter = PeakMeter(torch.device("cpu"))
    assert not meter.start(iteration=3, held=0, profiling=False)  # CPU measures only profiling iterations
    with region("f/0"):
        floats(MB)
    assert meter.stop() is None and meter.last is None
    meter.start(iteration=5, held=0, profiling=True)
    with region("b/0"):
        floats(MB)
    meter.stop()
    assert not meter.due(6, True) and meter.due(5 + allocator.EVERY, True)  # measured: again in EVERY iterations
    meter.soon()  # a plan change: the next profiling iteration
    assert meter.due(6, True) and not meter.due(6, False)


def test_extras_take_each_layer_s_largest_working_set_and_note_gives_the_step_s_share_by_parameters() -> None:
    found = {"f/0": (0, 5, 4), "b/0": (4, 7, 1), "l/1": (2, 9, 3), "r/1": (3, 4, 4), "step": (1, 9, 0)}
    per, step = extras(found)
    assert per == {0: 3, 1: 6} and step == 8
    layers = {0: torch.nn.Linear(4, 4, bias=False), 1: torch.nn.Linear(8, 4, bias=False)}  # 64 and 128 bytes
    stage = SimpleNamespace(owned=[0, 1], layers={i: SimpleNamespace(module=m, stats=SimpleNamespace(
        transient_bytes=0, step_bytes=0)) for i, m in layers.items()})
    allocator.note(stage, per, step)
    assert [stage.layers[i].stats.transient_bytes for i in (0, 1)] == [3, 6]
    assert [stage.layers[i].stats.step_bytes for i in (0, 1)] == [4, 8]  # 8 for the largest layer, by size


def test_held_counts_each_tensor_once() -> None:
    shared = torch.nn.BatchNorm1d(4)
    layers = {0: SimpleNamespace(module=torch.nn.Sequential(shared)), 1: SimpleNamespace(module=shared)}
    stage = SimpleNamespace(owned=[0, 1], layers=layers, static_bytes=lambda: {"params": 100, "optimizer": 50})
    assert allocator.held(stage) == 150 + 2 * 4 * 4 + 8  # its running mean and variance, and its counter, once


def test_a_layer_s_first_backward_which_allocates_the_gradients_is_not_its_working_set_when_others_follow() -> None:
    """The optimizer step set the gradients to None, so a layer's first backward of the iteration allocates them
    (counted with the static tensors already); its working set comes from the later micro-batches' backwards."""
    meter = PeakMeter(torch.device("cpu"))
    assert meter.start(iteration=3, held=0, profiling=True)
    grads = []
    for mb in range(2):
        with region("b/0"):
            scratch = floats(MB)
            if mb == 0:
                grads.append(floats(2 * MB))  # the gradients, once
            del scratch
    with region("b/1"):  # a single backward: its own figure stands
        scratch = floats(MB)
        grads.append(floats(MB))
        del scratch
    meter.stop()
    assert meter.layer_extras == {0: MB, 1: 2 * MB}


def test_the_batch_a_stage_holds_before_its_iteration_counts_once_each_tensor() -> None:
    """Read before the profiler's window opens, the batch is counted by the bytes its tensors cover: a slice of a
    larger dataset its slice, a tensor named twice or with a view of it once."""
    dataset = torch.zeros(100, 8)
    inputs = dataset[10:14]
    targets = torch.zeros(3, dtype=torch.int64)
    batch = (inputs, {"targets": targets, "again": inputs, "first_row": inputs[0]}, None, 3)
    assert allocator.data_bytes(batch) == 4 * 8 * 4 + 3 * 8
    assert allocator.data_bytes(None) == 0


def test_a_free_the_profiler_did_not_see_is_supplied_where_it_must_have_happened() -> None:
    """Known answers: an address allocated again without a free was freed by then; a collective's buffer never seen
    freed is freed where its collective ended, unless the stage still holds it (a reduce-scatter's sharded
    gradient); a free that was seen stands, and nothing else is invented."""
    A = allocator.Allocation
    events = [
        A(10, ptr=1, nbytes=4 * MB),  # made by a layer, its free on another thread: its address comes back at 40
        A(20, ptr=2, nbytes=2 * MB, owner_end=25),  # an all-gather's output, freed unseen once the gather ended
        A(30, ptr=3, nbytes=MB, owner_end=35),  # a reduce-scatter's sharded gradient: the stage keeps it
        A(40, ptr=1, nbytes=4 * MB),
        A(50, ptr=1, nbytes=-4 * MB),  # the second one's free, seen
        A(60, ptr=4, nbytes=MB),  # still held when the window closes, by nobody said: left as it is
    ]
    changes = allocator.deltas(events, kept={3})
    assert sorted(changes) == [(10, 4 * MB), (20, 2 * MB), (25, -2 * MB), (30, MB), (40, -4 * MB), (40, 4 * MB),
                               (50, -4 * MB), (60, MB)]
    _, sums = allocator.timeline(changes)
    assert max(sums) == 6 * MB  # 4 + 2 at 20; without the supplied frees, 4 + 2 + 1 + 4 = 11 at 40
    assert (25, -2 * MB) not in allocator.deltas(events, kept={2, 3})  # what the stage holds is never freed


def test_a_buffer_a_collective_hands_to_another_thread_is_not_counted_past_its_collective() -> None:
    """A real profiler: a buffer made inside a collective op whose last reference goes on a thread the profiler does
    not watch (as gloo's worker drops a work's tensors) leaves the peak the collective's, not the sum of everything
    made after it."""
    import threading

    meter = PeakMeter(torch.device("cpu"))
    assert meter.start(iteration=1, held=0, profiling=True)
    with region("b/0"):
        with torch.profiler.record_function("c10d::allgather_"):
            handed = [floats(4 * MB)]
        worker = threading.Thread(target=handed.clear)  # the last reference, dropped where the profiler is blind
        worker.start()
        worker.join(timeout=10)
        after = floats(2 * MB)  # made once the collective's buffer is gone
        del after
    sharded = SimpleNamespace(shards=SimpleNamespace(inside={}), params=lambda: [], optimizer=None, owned=[], layers={})
    assert meter.stop(sharded) == 4 * MB  # not 6 (a sharded stage's: a whole stage's thread frees what it made)
