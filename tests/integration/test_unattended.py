"""Unattended torchrun jobs (``vpipe-lab worker --iterations N --save-every K --run-dir DIR``): they train without a
client, write metrics and checkpoints into the run directory, say where to attach, and a job that is killed and
restarted continues from its last checkpoint with the same losses as a run that was never interrupted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import vpipe_lab
from tests.conftest import kill_tree
from vpipe_lab.telemetry import runlog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KEY = "fedcba9876543210" * 4
ROOT = Path(__file__).resolve().parents[2]


def start(run_dir: Path, iterations: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "0", "-m", "vpipe_lab.cli", "worker", "--model", "mlp",
           "--data", "tests.integration.slow_data:data", "--microbatches", "4", "--device", "cpu",
           "--control-port", "0", "--iterations", str(iterations), "--save-every", "4",
           "--run-dir", str(run_dir), "--clip-grad-norm", "1.0",
           "--lr-scheduler", "tests.integration.slow_data:warmup"]
    env = {**os.environ, "VPIPE_LAB_KEY": KEY, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def latest_iteration(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().split("-")[1]) if pointer.exists() else -1


def test_killed_job_resumes_with_the_same_losses_and_can_be_attached(tmp_path: Path) -> None:
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    # the job that is never interrupted trains beside the one that will be (their batches wait on a sleep, not the CPU)
    uninterrupted = start(whole, 12, tmp_path / "whole.log")
    proc = start(broken, 12, tmp_path / "broken.log")
    try:
        deadline = time.monotonic() + 240
        while latest_iteration(broken) < 4:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "broken.log").read_text()[-3000:]
            time.sleep(0.05)
        where = json.loads((broken / "attach.json").read_text())
        assert where["key_file"] is None  # the key came from VPIPE_LAB_KEY
        session = vpipe_lab.attach(where["address"], key=KEY, timeout=10)  # a client comes and goes
        assert session.plan.stages == 2
        session.detach()
        kill_tree(proc)  # mid-run, after the checkpoint at 4 (and maybe 8)
        assert uninterrupted.wait(timeout=300) == 0, (tmp_path / "whole.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
        kill_tree(uninterrupted)
    expected = runlog.read(whole)
    assert list(expected["iteration"]) == list(range(12))
    assert expected["grad_norm"].notna().all()
    assert latest_iteration(whole) == 12  # --save-every 4 ends on a checkpoint
    resumed_from = latest_iteration(broken)
    assert 4 <= resumed_from < 12
    proc = start(broken, 12, tmp_path / "broken.log")
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "broken.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    got = runlog.read(broken)
    assert list(got["iteration"]) == list(range(12))  # the restart replaced what the kill cut off
    assert list(got["loss"]) == list(expected["loss"])
    assert list(got["grad_norm"]) == list(expected["grad_norm"])
    assert list(got["lr"]) == list(expected["lr"]) == pytest.approx([0.05 * min(1.0, (s + 1) / 10) for s in range(12)])
    assert list(runlog.read(broken, "start")["iteration"]) == [0, resumed_from]  # it did resume


def test_a_torchrun_job_takes_every_schedule_launch_takes_and_is_refused_before_the_rendezvous(tmp_path: Path) -> None:
    """`--schedule zbv` was accepted at the command line and failed on the workers after the rendezvous; now a torchrun
    job runs it with launch()'s two chunks per stage, to the same losses, and one it cannot run is refused at once."""
    def worker(*flags: str, log: Path) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "0", "-m", "vpipe_lab.cli", "worker", "--model", "mlp", "--microbatches", "4",
               "--device", "cpu", "--control-port", "0", *flags]
        env = {**os.environ, "VPIPE_LAB_KEY": KEY, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)

    proc = worker("--schedule", "zbv", "--iterations", "4", "--run-dir", str(tmp_path / "zbv"), log=tmp_path / "zbv.log")
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "zbv.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    got = list(runlog.read(tmp_path / "zbv")["loss"])
    with vpipe_lab.launch("mlp", stages=2, microbatches=4, schedule="zbv", device="cpu") as s:
        assert s.settings.virtual_stages == 2
        s.run(4)
        s.wait(timeout=120)
        expected = list(s.metrics.iterations["loss"])
    assert got == pytest.approx(expected, rel=1e-6) and len(got) == 4

    proc = worker("--schedule", "zbv", "--virtual-stages", "3", log=tmp_path / "bad.log")
    try:
        assert proc.wait(timeout=120) != 0
    finally:
        kill_tree(proc)
    said = (tmp_path / "bad.log").read_text()
    assert "zbv runs 2 chunks per stage, not virtual_stages=3" in said
    assert "joining the process group" not in said  # refused before the rendezvous


def test_a_torchrun_job_trains_your_own_parts_cut_where_split_says(tmp_path: Path) -> None:
    """`vpipe-lab worker --model/--data/--loss/--optimizer package.module:attribute --split ...`: the units begin where
    the split says (the checkpoint's manifest names them) and the losses equal plain training of the same model."""
    from tests.integration import user_parts
    from tests.runtime.reference import train
    from vpipe_lab.wire.checkpoint_format import Manifest

    parts = [f"--{role}=tests.integration.user_parts:{attr}"
             for role, attr in (("model", "build"), ("data", "data"), ("loss", "loss"), ("optimizer", "sgd"))]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "0", "-m", "vpipe_lab.cli", "worker", *parts, "--split", "blocks.1,blocks.3", "--microbatches", "2",
           "--device", "cpu", "--control-port", "0", "--iterations", "3", "--run-dir", str(tmp_path / "run")]
    log = tmp_path / "own.log"
    proc = subprocess.Popen(cmd, env={**os.environ, "VPIPE_LAB_KEY": KEY, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill_tree(proc)
    names = [u["name"] for u in Manifest.read(tmp_path / "run" / "checkpoints").units]
    assert names == ["embed+blocks.0", "blocks.1+blocks.2", "blocks.3", "head"]
    _, expected = train(user_parts.build, user_parts.data, user_parts.loss, user_parts.sgd, iterations=3,
                        microbatches=2)
    assert list(runlog.read(tmp_path / "run")["loss"]) == pytest.approx(expected, rel=1e-5)
