"""Soak: minutes of training with a live change every 15 s and a worker SIGKILLed every few minutes, the dashboard
open, ends equal to an undisturbed run, with the controller's memory flat and nothing left running.

    VPIPE_LAB_SOAK_MINUTES=20 .ci/venv/bin/python -m pytest -m soak tests/integration/test_soak.py -s

(``VPIPE_LAB_SOAK_KILL_S``: seconds between kills, default 180.) Skipped unless the minutes are given: the suite's
CI job has no room for it; benchmarks/RESULTS.md records the runs made by hand.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import time

import psutil
import pytest
import torch

import vpipe_lab
from tests.conftest import worker_processes
from vpipe_lab.jupyter.dashboard import Dashboard

MINUTES = float(os.environ.get("VPIPE_LAB_SOAK_MINUTES", "0"))
KILL_EVERY_S = float(os.environ.get("VPIPE_LAB_SOAK_KILL_S", "180"))
CHANGE_EVERY_S = 15.0
PARTITIONS = [(0, 3, 10), (0, 5, 10), (0, 7, 10), (0, 4, 10)]
pytestmark = [pytest.mark.soak, pytest.mark.slow,
              pytest.mark.skipif(not MINUTES, reason="a soak runs for minutes: set VPIPE_LAB_SOAK_MINUTES")]


def launch(**kw: object) -> vpipe_lab.Session:
    return vpipe_lab.launch("mlp", stages=2, microbatches=4, device="cpu", timeout=30, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(int(MINUTES * 60 * 2 + 300))
def test_faults_and_changes_change_nothing_but_time() -> None:
    rng = random.Random(0)
    kills = int(MINUTES * 60 // KILL_EVERY_S)
    me = psutil.Process()
    samples: list[tuple[int, int, int]] = []  # iteration, controller RSS, the workers' RSS
    changes = refused = killed = 0
    with launch(max_restarts=kills + 1) as s:
        board = Dashboard(s)
        s.run(None)
        start = time.monotonic()
        next_change, next_kill, next_sample = start + CHANGE_EVERY_S, start + KILL_EVERY_S, start + 10
        while (now := time.monotonic()) - start < MINUTES * 60:
            time.sleep(0.5)
            if s.status == "restarting":
                continue
            if now >= next_change:
                next_change = now + CHANGE_EVERY_S
                try:
                    s.set_partition(PARTITIONS[changes % len(PARTITIONS)])
                    changes += 1
                except Exception as exc:  # a change under way when a worker died: the session says so; go on
                    refused += 1
                    print(f"change refused: {exc}")
            if now >= next_kill and len(s.processes.restarts) < kills:
                next_kill = now + KILL_EVERY_S
                os.kill(s.processes.pids()[rng.randrange(2)], signal.SIGKILL)
                killed += 1
            if now >= next_sample:
                next_sample = now + 10
                workers = sum(psutil.Process(p).memory_info().rss for p in s.processes.pids().values() if psutil.pid_exists(p))
                samples.append((s.iteration, me.memory_info().rss, workers))
        at = s.pause()
        assert s.failure is None and len(s.processes.restarts) == killed > 0
        frame = s.metrics.iterations
        assert list(frame["iteration"]) == list(range(at))  # every iteration recorded once
        got, losses = s.state_dict(), list(frame["loss"])
        assert all(r["loss_diff"] in (None, 0.0) for r in s.processes.restarts)
        assert f"restarts: {killed} (last: stage" in board.header()["text"]
        board.close()
    assert worker_processes() == []
    with launch() as reference:
        reference.run(at)
        reference.wait(timeout=MINUTES * 60 * 2)
        expected, expected_losses = reference.state_dict(), list(reference.metrics.iterations["loss"])
    assert losses == expected_losses
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    warm = samples[len(samples) // 4:]
    grown = statistics.linear_regression([float(i) for i, _, _ in warm], [float(c) for _, c, _ in warm]).slope
    print(f"soak: {MINUTES:g} min, {at} iterations, {changes} changes ({refused} refused), {killed} restarts; "
          f"controller RSS {warm[0][1] / 2**20:.1f} -> {warm[-1][1] / 2**20:.1f} MiB ({grown:.0f} B/iteration), "
          f"workers {warm[0][2] / 2**20:.1f} -> {warm[-1][2] / 2**20:.1f} MiB")
    # The iteration table's rows (~430 B) plus what a short run's allocator noise adds (3 minutes: 1.1 KB)
    assert grown < 2048
