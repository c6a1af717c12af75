"""torchrun's elastic membership: a node of a two-node ``vpipe-lab worker`` job dies, torchrun (``--nnodes 1:2``,
c10d rendezvous, ``--max-restarts``) restarts the job on the node that is left, and the lab re-plans the same layers
onto one stage from the newest checkpoint and trains on, saying so, to the losses and weights of a job that lost
nothing. Two torchrun agents on this machine stand for the two nodes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import kill_tree
from vpipe_lab.examples import mlp
from vpipe_lab.telemetry import runlog

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
KEY = "0123456789abcdef" * 4
ROOT = Path(__file__).resolve().parents[2]
ITERATIONS = 16


def worker_args(run_dir: Path, *saves: str) -> list[str]:
    return ["-m", "vpipe_lab.cli", "worker", "--model", "mlp", "--data", "tests.integration.slow_data:data",
            "--microbatches", "4", "--device", "cpu", "--control-port", "0", "--iterations", str(ITERATIONS),
            *(saves or ("--save-every", "4")), "--run-dir", str(run_dir), "--timeout", "20"]


def torchrun(args: list[str], log: Path, **env_: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "VPIPE_LAB_KEY": KEY, "PYTHONPATH": str(ROOT), **env_}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], env=env, cwd=ROOT,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def node(run_dir: Path, port: int, host: bool, log: Path) -> subprocess.Popen[bytes]:
    """One node's torchrun agent; ``host`` serves the c10d rendezvous store (the node that must stay)."""
    return torchrun(["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test",
                     # a node that died is dropped from the rendezvous after 2 missed heartbeats of 1 s (the default,
                     # 3 of 5 s, held the restart 15 s on a node everyone knew was gone)
                     "--rdzv-conf", f"is_host={int(host)},last_call_timeout=2,join_timeout=120,keep_alive_interval=1,"
                                    "keep_alive_max_attempt=2",
                     "--max-restarts", "2", "--monitor-interval", "0.5", *worker_args(run_dir)], log)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def latest(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().split("-")[1]) if pointer.exists() else -1


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint read by DCP itself into a plain model (the checkpoint holds the model's own names)."""
    state = mlp.model().state_dict()
    dcp.load(state, checkpoint_id=str(run_dir / "checkpoints" / f"ckpt-{ITERATIONS:08d}-0-0"), no_dist=True)
    return state


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job that loses nothing, which both tests compare with: checkpoints every 4 iterations and snapshots every
    3 (background copies: the same arithmetic either way), run once for the file."""
    run_dir = tmp_path_factory.mktemp("elastic") / "whole"
    log = run_dir.parent / "whole.log"
    proc = torchrun(["--standalone", "--nproc-per-node", "2",
                     *worker_args(run_dir, "--save-every", "4", "--snapshot-every", "3")], log)
    try:
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        kill_tree(proc)
    return run_dir


def test_a_node_that_leaves_is_planned_away_and_training_ends_equal(whole: Path, tmp_path: Path) -> None:
    elastic = tmp_path / "elastic"
    port = free_port()
    first = node(elastic, port, True, tmp_path / "first.log")
    second = None
    try:
        time.sleep(1.0)  # the host's store is up before the other node joins it
        second = node(elastic, port, False, tmp_path / "second.log")
        deadline = time.monotonic() + 240
        while latest(elastic) < 4:
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.05)
        kill_tree(second)  # the node is gone: torchrun restarts the job with the one that is left
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        kill_tree(first)
        if second is not None:
            kill_tree(second)
    starts = runlog.read(elastic, "start")
    assert list(starts["stages"]) == [2, 1] and starts["iteration"].iloc[1] >= 4
    note = starts["note"].iloc[1]
    # from the newest of its checkpoints and snapshots (each stage's snapshot, read by whichever stage now holds a unit)
    assert re.search(r"torchrun started 1 stage\(s\) where the (checkpoint|snapshot) of iteration \d+ was taken on 2",
                     note), note
    assert "1f1b on 1 stage" in note
    got, expected = runlog.read(elastic), runlog.read(whole)
    assert list(got["iteration"]) == list(range(ITERATIONS))  # each iteration once: the replay replaced the lost ones
    assert list(got["loss"]) == pytest.approx(list(expected["loss"]), abs=1e-6)
    reference = final_weights(whole)
    for key, value in final_weights(elastic).items():
        assert torch.allclose(value, reference[key], atol=1e-6), key


def test_a_worker_that_dies_is_restarted_by_torchrun_from_the_newest_snapshot(whole: Path, tmp_path: Path) -> None:
    """No checkpoint but the final one: stage 1 dies at iteration 10 (its first attempt only), torchrun
    (``--max-restarts 1``) restarts the job, and it goes on from the snapshot of iteration 9, not from the start,
    to the losses and weights of a job that lost nothing, every iteration recorded once."""
    restarted = tmp_path / "restarted"
    proc = torchrun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.5",
                     *worker_args(restarted, "--snapshot-every", "3")], tmp_path / "restarted.log",
                    VPIPE_LAB_FAULT="forward:1@10")
    try:
        assert proc.wait(timeout=300) == 0, (tmp_path / "restarted.log").read_text()[-3000:]
    finally:
        kill_tree(proc)
    assert "fault injection: exit at forward on rank 1, iteration 10" in (tmp_path / "restarted.log").read_text()
    starts = runlog.read(restarted, "start")
    assert list(starts["iteration"]) == [0, 9] and list(starts["stages"]) == [2, 2]
    assert starts["note"].iloc[1] == "resumed from the snapshot of iteration 9"
    assert len(runlog.read(whole, "start")) == 1
    got, expected = runlog.read(restarted), runlog.read(whole)
    assert list(got["iteration"]) == list(range(ITERATIONS))  # each once: the replay replaced the lost iteration
    assert list(got["loss"]) == pytest.approx(list(expected["loss"]), abs=1e-6)
    reference = final_weights(whole)
    for key, value in final_weights(restarted).items():
        assert torch.equal(value, reference[key]), key  # the same arithmetic on the same batches
