"""Two "nodes" on one machine: two torchrun invocations (--nnodes 2, one process each, c10d rendezvous on
127.0.0.1). Attach, run, apply a partition change (a live migration across the nodes), detach, re-attach, stop;
nothing survives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch

import vpipe_lab
from tests.conftest import kill_tree
from vpipe_lab.control.errors import SessionClosed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KEY = "0123456789abcdef" * 4


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    yield from _start(tmp_path, [])


@pytest.fixture
def torch_job(tmp_path: Path) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    yield from _start(tmp_path, ["--engine", "torch"])


def _start(tmp_path: Path, extra: list[str]) -> Iterator[tuple[str, list[subprocess.Popen[bytes]]]]:
    rdzv, control = _port(), _port()
    env = {**os.environ, "VPIPE_LAB_KEY": KEY}
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv}",
               "--max-restarts", "0", "-m", "vpipe_lab.cli", "worker", "--model", "mlp", "--microbatches", "4",
               "--device", "cpu", "--control-port", str(control), *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(tmp_path / f"node{node}.log", "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
    try:
        yield f"127.0.0.1:{control}", procs
    finally:
        for p in procs:
            kill_tree(p)


def attach_when_up(address: str, deadline_s: float = 120) -> vpipe_lab.Session:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return vpipe_lab.attach(address, key=KEY, timeout=5)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def test_two_nodes_attach_migrate_detach_reattach_stop(job: tuple[str, list[subprocess.Popen[bytes]]]) -> None:
    address, procs = job
    session = attach_when_up(address)
    assert session.plan.stages == 2 and session.plan.boundaries == (0, 5, 10)
    session.run()
    session.wait(3, timeout=120)
    before = session.state_dict()
    at = session.set_partition((0, 3, 10))  # layers 3 and 4 cross from node 0 to node 1, with optimizer state
    assert session.last_migration["moves"] == 2 and session.last_migration["moved_bytes"] > 0
    session.wait(at + 2, timeout=120)
    frame = session.metrics.iterations
    assert set(frame[frame.iteration >= at].plan_version) == {1}
    seen = session.iteration
    session.detach()
    with pytest.raises(SessionClosed):
        session.run()
    time.sleep(2)  # training goes on without anyone attached
    again = vpipe_lab.attach(address, key=KEY)
    assert again.iteration > seen and again.plan.boundaries == (0, 3, 10) and again.plan_version == 1
    assert len(again.metrics.records()) >= 3  # recent history comes with the re-attach
    again.pause()
    state = again.state_dict()
    assert set(state) == set(before) and not torch.equal(state["3.0.weight"], before["3.0.weight"])  # it trained
    again.stop()
    for p in procs:
        assert p.wait(timeout=60) == 0
    assert not [c for p in procs for c in (psutil.Process(p.pid).children(recursive=True) if psutil.pid_exists(
        p.pid) else [])]


def test_clients_without_the_key_are_refused(job: tuple[str, list[subprocess.Popen[bytes]]]) -> None:
    address, procs = job
    session = attach_when_up(address)
    try:
        with pytest.raises(TimeoutError, match="is the key right"):
            vpipe_lab.attach(address, key="f" * 64, timeout=3)
        session.run(2)
        session.wait(timeout=120)  # the job is unaffected
    finally:
        session.stop()
    for p in procs:
        assert p.wait(timeout=60) == 0


def test_a_torchrun_job_on_the_torch_engine_reshards_and_exports(torch_job: tuple[str, list[subprocess.Popen[bytes]]],
                                                                  tmp_path: Path) -> None:
    """``vpipe-lab worker --engine torch`` under torchrun: attached, it trains on torch's runtime, a partition change
    reshards across the two nodes, and ``vpipe-lab export --attach`` writes the plan in force as a bundle."""
    from vpipe_lab.cli import main
    from vpipe_lab.wire import bundle_files

    address, procs = torch_job
    session = attach_when_up(address)
    try:
        session.run()
        session.wait(3, timeout=120)
        at = session.set_partition((0, 3, 10))
        session.wait(at + 2, timeout=120)
        frame = session.metrics.iterations
        assert set(frame[frame.iteration >= at].plan_version) == {1} and frame["loss"].notna().all()
        key_file = tmp_path / "key"
        key_file.write_text(KEY)
        key_file.chmod(0o600)
        assert main(["export", str(tmp_path / "b"), "--attach", address, "--key-file", str(key_file)]) == 0
        assert bundle_files.read(tmp_path / "b").plan.boundaries == (0, 3, 10)
    finally:
        session.stop()
    for p in procs:
        assert p.wait(timeout=60) == 0
