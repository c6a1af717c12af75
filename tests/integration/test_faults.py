"""Faults: what the user sees, that no process survives, and that no saved state is lost."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

import vpipe_lab
from tests.conftest import worker_processes
from vpipe_lab.control.errors import WorkerError
from vpipe_lab.core.errors import ProfileError
from vpipe_lab.wire.checkpoint_format import resolve

pytestmark = pytest.mark.slow


def launch(**kw):  # type: ignore[no-untyped-def]
    return vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", **{"timeout": 30, **kw})


def assert_resumes_to(path: Path, iteration: int, state: dict[str, torch.Tensor]) -> None:
    with launch(resume=path) as again:
        assert again.iteration == iteration
        got = again.state_dict()
    for key, value in state.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("stage", [0, 1])
def test_sigkill_of_a_stage_during_forward(stage: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VPIPE_LAB_FAULT", f"forward:{stage}:kill@3")
    s = launch()
    try:
        s.run(2)
        s.wait(timeout=60)
        s.save(tmp_path / "ckpt")
        saved = s.state_dict()
        s.run()
        with pytest.raises(WorkerError) as err:
            s.wait(10**6, timeout=60)
        assert err.value.stage == stage and "signal 9" in str(err.value)
    finally:
        s.stop()
    monkeypatch.delenv("VPIPE_LAB_FAULT")
    assert_resumes_to(tmp_path / "ckpt", 2, saved)


@pytest.mark.parametrize("stage", [0, 1])
def test_sigkill_during_a_save_keeps_the_previous_version(stage: int, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VPIPE_LAB_FAULT", f"save:{stage}:kill@3")  # dies after writing its layers, before completion
    s = launch()
    try:
        s.run(2)
        s.wait(timeout=60)
        s.save(tmp_path / "ckpt")
        first = resolve(tmp_path / "ckpt")
        saved = s.state_dict()
        s.run(1)
        s.wait(timeout=60)
        with pytest.raises(WorkerError) as err:
            s.save(tmp_path / "ckpt")
        assert err.value.stage == stage and "signal 9" in str(err.value)
    finally:
        s.stop()
    monkeypatch.delenv("VPIPE_LAB_FAULT")
    assert resolve(tmp_path / "ckpt") == first
    assert_resumes_to(tmp_path / "ckpt", 2, saved)


CONTROLLER = """
import sys, time, vpipe_lab
s = vpipe_lab.launch("mlp", stages=2, microbatches=2, device="cpu", timeout=30)
s.run(2); s.wait(timeout=60)
s.save(sys.argv[1])
print(" ".join(str(pid) for pid in s.processes.pids().values()), flush=True)
s.run(1); s.wait(timeout=60)
s.save(sys.argv[1])  # rank 0 is slowed down inside this save; the test kills this process meanwhile
"""


def test_sigkill_of_the_controller_during_a_save(tmp_path: Path) -> None:
    env = {**__import__("os").environ, "VPIPE_LAB_FAULT": "save:0:slow@3"}
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 2
        first = resolve(tmp_path / "ckpt")
        deadline = time.monotonic() + 30
        while len([p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("ckpt-")]) < 2 and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        proc.kill()
        proc.wait(10)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in worker_processes() if p.pid in pids]
    finally:
        proc.kill()
    assert resolve(tmp_path / "ckpt") == first  # the interrupted version never became the checkpoint
    with launch(resume=tmp_path / "ckpt") as again:
        assert again.iteration == 2


def test_an_unwritable_checkpoint_path_is_an_error_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint's parent should be")
    with launch() as s:
        s.run(2)
        s.wait(timeout=60)
        s.save(tmp_path / "ckpt")
        first = resolve(tmp_path / "ckpt")
        with pytest.raises(OSError, match=r"the checkpoint was not saved: stage 0 cannot write .*not-a-directory"):
            s.save(blocker / "ckpt")
        s.run(1)
        assert s.wait(timeout=60) == 3  # still training
    assert resolve(tmp_path / "ckpt") == first


def test_a_full_disk_during_a_save_is_one_line_and_the_session_trains_on(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/security.md: a disk that fills during ``session.save``: one line saying no space was left and where, the
    partial version removed, the previous one still ``latest``, training going on (a real full tmpfs where this
    machine can mount one, else ENOSPC injected where stage 1 writes its files)."""
    from tests.full_disk import fill, small_filesystem

    with small_filesystem(tmp_path, 512 * 1024) as disk:  # the mlp example: about 70 MiB a stage
        root = (disk if disk is not None else tmp_path) / "ckpt"
        if disk is None:
            monkeypatch.setenv("VPIPE_LAB_FAULT", "write:1:enospc@3")
        with launch() as s:
            s.run(2)
            s.wait(timeout=60)
            first = s.save(root)
            if disk is not None:
                fill(disk, leave=4096)
            s.run(1)
            s.wait(timeout=60)
            with pytest.raises(OSError) as info:
                s.save(root)
            said = str(info.value)
            assert "\n" not in said and "no space left" in said and str(root) in said, said
            assert sorted(p.name for p in root.iterdir() if p.is_dir()) == [first.name]  # nothing half-written stays
            assert resolve(root) == first
            s.run(2)
            assert s.wait(timeout=60) == 5 and s.failure is None  # the session trains on
            if disk is not None:
                (disk / "ballast").unlink()
                assert s.save(root) != first  # space again: the next save is whole
        with launch(resume=root) as again:
            assert again.iteration == (5 if disk is not None else 2)


def test_a_periodic_snapshot_on_a_full_disk_leaves_training_going(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restartable job's background snapshot meets ENOSPC on stage 0 from iteration 2 on: training goes on."""
    monkeypatch.setenv("VPIPE_LAB_FAULT", "snapshot:0:enospc@2")
    with launch(max_restarts=1) as s:
        s.run(6)
        assert s.wait(timeout=90) == 6 and s.failure is None


def test_a_corrupted_checkpoint_file_or_a_forged_manifest_is_named_at_resume(tmp_path: Path) -> None:
    with launch() as s:
        s.run(1)
        s.wait(timeout=60)
        s.save(tmp_path / "ckpt")
    version = resolve(tmp_path / "ckpt")
    data = (version / "__1_0.distcp").read_bytes()  # stage 1's tensors, as torch.distributed.checkpoint wrote them
    (version / "__1_0.distcp").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(WorkerError, match=r"__1_0\.distcp does not match its checksum"):
        launch(resume=tmp_path / "ckpt")
    (tmp_path / "ckpt" / "latest").write_text("../../etc")
    with pytest.raises(ProfileError, match="not a checkpoint version"):
        launch(resume=tmp_path / "ckpt")


def test_a_stage_that_hangs_is_found_within_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VPIPE_LAB_FAULT", "forward:1:hang@2")
    s = launch(timeout=5)
    try:
        s.run()
        s.wait(2, timeout=60)
        start = time.monotonic()
        with pytest.raises(WorkerError) as err:
            s.wait(10**6, timeout=60)
        assert time.monotonic() - start < 5 + 10
        assert err.value.stage == 1 and "stage 1 stopped responding" in str(err.value)
    finally:
        s.stop()
