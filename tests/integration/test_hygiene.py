"""Nothing outlives a Session, a failed worker, or the process that started the workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import vpipe_lab
from vpipe_lab.control.errors import WorkerError

pytestmark = pytest.mark.slow


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_stop_leaves_no_process() -> None:
    s = vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30)
    pids = list(s.processes.pids().values())
    job_dir = s._job_dir
    assert job_dir is not None and (job_dir / "job.json").exists()
    s.run()
    s.wait(2, timeout=60)
    s.stop()
    assert gone(pids)
    assert not job_dir.exists()  # nor its job.json, which holds the job's key
    s.stop()  # idempotent


def test_stop_returns_only_when_every_worker_is_gone_under_load() -> None:
    """stop() (and %vpipe stop, which says so) returns once the workers have exited and been reaped, with the CPU
    busy with other work: no process of theirs is left the moment it returns, not even a zombie."""
    import torch

    from tests.integration.lab import cpu_load
    from vpipe_lab.examples import mlp

    batches = [mlp.data(i) for i in range(64)]
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, persistent_workers=True)
    with cpu_load(4):
        for _ in range(3):  # a DataLoader's own worker processes are the workers' to stop too
            s = vpipe_lab.launch(mlp.model, loader, stages=2, microbatches=2, device="cpu", timeout=60)
            s.run()
            s.wait(2, timeout=120)
            started = [c.pid for p in s.processes.pids().values() for c in psutil.Process(p).children(recursive=True)]
            pids = list(s.processes.pids().values()) + started
            assert len(started) >= 2  # rank 0's DataLoader workers
            s.stop()
            assert s.processes.remaining() == [] and not [p for p in pids if psutil.pid_exists(p)]


def test_a_killed_worker_is_reported_and_the_others_stopped() -> None:
    s = vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30)
    pids = list(s.processes.pids().values())
    job_dir = s._job_dir
    try:
        s.run()
        s.wait(2, timeout=60)
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError) as err:
            s.wait(10**6, timeout=30)
        assert time.monotonic() - t0 < 5  # reported within seconds
        assert err.value.stage == 1 and "signal 9" in str(err.value)
        assert gone(pids)
        with pytest.raises(WorkerError):  # and it stays failed
            s.run(1)
    finally:
        s.stop()
    assert job_dir is not None and not job_dir.exists()  # a failed session's key goes too (no checkpoint to keep)


def test_an_interpreter_that_exits_without_stop_leaves_no_job_directory() -> None:
    script = ("import vpipe_lab\n"
              "s = vpipe_lab.launch('mlp', stages=2, microbatches=2, device='cpu', timeout=30)\n"
              "s.run(2); s.wait(2, timeout=60)\n"
              "print(s._job_dir, flush=True)\n")  # and exit: no stop()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert done.returncode == 0, done.stderr[-2000:]
    job_dir = Path(done.stdout.strip().splitlines()[-1])
    assert job_dir.name.startswith("vpipe-lab-") and not job_dir.exists()


SCRIPT = """
import sys, time, vpipe_lab
s = vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30)
s.run()
print(" ".join(str(pid) for pid in s.processes.pids().values()), flush=True)
time.sleep(300)
"""


def test_workers_exit_when_their_parent_is_killed() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.send_signal(signal.SIGKILL)  # no atexit, no cleanup: only the pipe tells the workers
        proc.wait(timeout=10)
        assert gone(pids, timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
