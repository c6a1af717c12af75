"""Point-to-point transfers and boundary collectives between two real gloo ranks on 127.0.0.1."""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vpipe_lab.runtime.engine.comm import (
    TAG_BACKWARD,
    TAG_FORWARD,
    CommError,
    Peer,
    as_tensors,
    shares_core_with_transport,
)
from vpipe_lab.runtime.engine.loop_thread import QuietLoop


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> Peer:
    """Rank ``rank`` of a 2-rank gloo group on 127.0.0.1, one thread, and its peer."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    return Peer(rank, 2, torch.device("cpu"), 30)


def _ranks(rank: int, port: int, out: dict, pinned: bool = False) -> None:  # type: ignore[type-arg]
    if pinned:  # as a pinned worker runs (device.pin_cores): its posts keep gloo's loop thread quiet
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, [cores[rank % len(cores)]])
    peer = _join(rank, port)
    assert isinstance(peer._quiet, QuietLoop) or not pinned
    if rank == 0:
        # Both neighbours send before either receives: the 1F1B pattern that deadlocks with blocking sends.
        peer.send((torch.arange(6.0).reshape(2, 3).requires_grad_(), torch.tensor([1, 2], dtype=torch.int64)), 1,
                  TAG_FORWARD)
        got = peer.recv(1, TAG_BACKWARD)
        peer.send({"hidden": torch.ones(2), "cache": None, "step": 3, "pair": (torch.zeros(1), "x")}, 1, TAG_FORWARD)
        peer.flush()
        out[0] = [t.tolist() for t in got] + [peer.broadcast_json({"cmds": ["go"]})] + [peer.all_max([1.0, 5.0])]
    else:
        peer.send(torch.full((2,), 7.0, dtype=torch.bfloat16), 0, TAG_BACKWARD)
        got = peer.recv(0, TAG_FORWARD)
        tree = peer.recv(0, TAG_FORWARD)
        peer.flush()
        out[1] = [t.tolist() for t in got] + [got[0].dtype == torch.float32, got[1].dtype == torch.int64] + \
            [peer.broadcast_json(None)] + [peer.all_max([3.0, 2.0])] + \
            [[tree["hidden"].tolist(), tree["cache"], tree["step"], tree["pair"][0].tolist(), tree["pair"][1]]]
    dist.destroy_process_group()


def two_ranks(target: Any) -> Any:
    """Run ``target(rank, port, out)`` on two spawned ranks, each with a deadline; what they put in ``out``."""
    ctx = mp.get_context("spawn")
    out = ctx.Manager().dict()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    assert all(p.exitcode == 0 for p in procs)
    return out


@pytest.mark.parametrize("pinned", [False, True], ids=["unpinned", "pinned"])
def test_two_ranks_exchange_tuples_dtypes_json_and_maxima(pinned: bool) -> None:
    out = two_ranks(functools.partial(_ranks, pinned=pinned))
    assert out[0][0] == [7.0, 7.0] and out[0][1] == {"cmds": ["go"]} and out[0][2] == [3.0, 5.0]
    assert out[1][0] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and out[1][1] == [1, 2]
    assert out[1][2] and out[1][3] and out[1][4] == {"cmds": ["go"]} and out[1][5] == [3.0, 5.0]
    assert out[1][6] == [[1.0, 1.0], None, 3, [0.0], "x"]  # a structure arrives as it was sent


def test_only_a_cpu_worker_on_one_core_yields_before_posting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    assert shares_core_with_transport(torch.device("cpu"))
    assert not shares_core_with_transport(torch.device("cuda", 0))  # NCCL: no gloo loop thread on its core
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert not shares_core_with_transport(torch.device("cpu"))  # the loop thread can run beside it


def test_as_tensors_rejects_other_values() -> None:
    assert len(as_tensors((torch.zeros(1), torch.ones(2)))) == 2
    with pytest.raises(CommError, match="tensor or a tuple of tensors"):
        as_tensors({"x": torch.zeros(1)})


def test_unsupported_tensor_is_refused_before_sending() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    peer = Peer(0, 2, torch.device("cpu"), 5)
    with pytest.raises(CommError, match="9-d"):
        peer.send(torch.zeros([1] * 9), 1, TAG_FORWARD)


def _agreed(rank: int, port: int, out: dict) -> None:  # type: ignore[type-arg]
    peer = _join(rank, port)
    if rank == 0:
        counts = []
        for i in range(3):
            before = peer.messages
            peer.post_send((torch.full((2, 3), float(i)), torch.tensor([i])), 1, TAG_FORWARD, agreed=True)
            peer.post_send({"h": torch.ones(2) * i, "mask": None}, 1, TAG_BACKWARD, agreed=True)
            peer.issue()
            counts.append(peer.messages - before)
        try:  # another shape in the same epoch is refused before anything is sent
            peer.post_send((torch.zeros(4, 3), torch.tensor([0])), 1, TAG_FORWARD, agreed=True)
            counts.append("sent")
        except CommError as exc:
            counts.append("refused" if "changed within" in str(exc) else str(exc))
        peer.reset_shapes()  # both ranks start a new epoch: a new shape goes with its header again
        peer.post_send((torch.zeros(4, 3), torch.tensor([7])), 1, TAG_FORWARD, agreed=True)
        peer.flush()
        out[0] = counts
    else:
        got = []
        first = peer.post_recv(0, TAG_FORWARD, agreed=True)
        got.append(peer.wait(first))
        ahead = [peer.post_recv(0, TAG_FORWARD, agreed=True) for _ in range(2)]  # posted before they are sent
        trees = [peer.wait(peer.post_recv(0, TAG_BACKWARD, agreed=True)) for _ in range(3)]
        got += [peer.wait(inc) for inc in ahead]
        peer.reset_shapes()
        last = peer.wait(peer.post_recv(0, TAG_FORWARD, agreed=True))
        out[1] = ([[float(a[0, 0]), int(b[0])] for a, b in got], [[float(t["h"][0]), t["mask"]] for t in trees],
                  [list(last[0].shape), int(last[1][0])], ahead[0].header is None)
    dist.destroy_process_group()


def test_agreed_shapes_send_headers_once_per_epoch_and_receives_post_ahead() -> None:
    out = two_ranks(_agreed)
    # First epoch transfer: header + tensors (+ the structure for the dict); later ones: one message per tensor.
    assert out[0] == [3 + 3, 2 + 1, 2 + 1, "refused"]
    values, trees, last, preposted = out[1]
    assert values == [[0.0, 0], [1.0, 1], [2.0, 2]]
    assert trees == [[0.0, None], [1.0, None], [2.0, None]]
    assert last == [[4, 3], 7] and preposted
