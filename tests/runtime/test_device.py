import pytest
import torch

from vpipe_lab.runtime.device import Clock, select


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
    from vpipe_lab.runtime.device import Stopwatch

    watch = Stopwatch(select("cpu", 0, 1), Clock(50.0))
    start = watch.begin()
    a = watch.mark()
    b = watch.mark()
    end = watch.end()
    assert 50.0 <= start <= watch.seconds(a) <= watch.seconds(b) <= end
    assert watch.exact() >= end
