import os
import subprocess
import sys

import pytest
import torch

from vpipe_lab.runtime.engine.device import Clock, pin_cores, select


def test_cpu_and_auto_without_gpus() -> None:
    assert select("cpu", 0, 2).backend == "gloo"
    if not torch.cuda.is_available():
        assert select("auto", 0, 2).device.type == "cpu"
        with pytest.raises(RuntimeError, match="no CUDA device"):
            select("cuda", 0, 2)
    with pytest.raises(ValueError, match="unknown device"):
        select("tpu", 0, 1)


def test_clock_offset() -> None:
    assert Clock(100.0).now() - Clock(0.0).now() == pytest.approx(100.0, abs=0.01)


def test_stopwatch_marks_are_clock_seconds_on_cpu() -> None:
    from vpipe_lab.runtime.engine.device import Stopwatch

    watch = Stopwatch(select("cpu", 0, 1), Clock(50.0))
    start = watch.begin()
    a = watch.mark()
    b = watch.mark()
    end = watch.end()
    assert 50.0 <= start <= watch.seconds(a) <= watch.seconds(b) <= end
    assert watch.exact() >= end


def test_pin_cores_gives_each_cpu_worker_its_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    masks: list[set[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: masks.append(set(cores)))
    assert pin_cores("cpu", 1, 2, 2) == [2, 3] and masks == [{2, 3}]
    assert pin_cores("cpu", 0, 4, 1) == [0]
    assert pin_cores("cpu", 0, 3, 2) is None  # 6 cores wanted, 4 there: the OS schedules
    assert pin_cores("cpu", 0, 1, 1) is None  # one worker has nothing to keep apart from
    assert pin_cores("cuda", 0, 2, 1) is None
    assert len(masks) == 2


def test_pin_cores_really_sets_this_threads_mask() -> None:
    """In a child process (the mask must not stick to the test runner): rank 1 of 2 keeps to the second core."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs CPU affinity and 2 cores")
    code = ("import os; from vpipe_lab.runtime.engine.device import pin_cores; "
            "print(pin_cores('cpu', 1, 2, 1), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    second = sorted(os.sched_getaffinity(0))[1]
    assert out.stdout.split() == [f"[{second}]", f"[{second}]"]


def test_a_job_that_lost_a_gpu_gives_its_ranks_the_gpus_named_in_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: torch.cuda's count and set_device stand in, so only the index choice is checked."""
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert select("auto", 1, 2, [0, 2]).device == torch.device("cuda", 2)  # rank 1 of 2 skips the lost GPU 1
    assert select("cuda", 1, 2).device == torch.device("cuda", 1)
    assert chosen == [2, 1]
