import time

import pytest
import zmq

from tests.messages import ready, report
from tests.wire.peers import transport_peer
from vpipe_lab.core.settings import Settings
from vpipe_lab.runtime.broker import Broker
from vpipe_lab.wire import protocol as P
from vpipe_lab.wire.channel import Client, Link
from vpipe_lab.wire.commands import Run, Stop
from vpipe_lab.wire.events import JobInfo

KEY = P.new_key()
JOB = JobInfo("s", Settings(stages=1, microbatches=2, device="cpu", timeout=30.0).to_json())


def wait_for(cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cond()


def test_clients_get_the_job_state_and_events_and_reach_rank0() -> None:
    broker = Broker(KEY, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", JOB)
    rank0 = Link(broker.backend, KEY, "rank0", session=JOB.session_id)
    try:
        rank0.send(ready(0).message())
        for it in range(3):
            rank0.send(report(it, 0).message())
        wait_for(lambda: broker.current is not None and broker.current.iteration == 3)
        client = Client(broker.frontend, KEY)
        got: list[P.Message] = []
        assert client.wait_replay(5)
        client.set_handler(got.append)
        assert client.welcome and client.welcome.job == JOB and client.welcome.current is not None
        assert client.welcome.current.iteration == 3 and client.welcome.ready == [ready(0)]
        assert [m.body["iteration"] for m in got] == [0, 1, 2]  # recent history, replayed
        client.send("rank0", Run(id=1).message())
        cmd = rank0.inbox.get(timeout=5)
        assert cmd.type == P.RUN and cmd.body == {"id": 1, "iterations": None}
        rank0.send(report(3, 0).message())
        wait_for(lambda: len(got) == 4)
        client.close()
        wait_for(lambda: not broker.clients)
    finally:
        rank0.close()
        broker.close()


def test_messages_without_the_key_are_dropped_on_both_sides() -> None:
    broker = Broker(KEY, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", JOB)
    ctx = zmq.Context()
    try:
        with pytest.raises(TimeoutError, match="is the key right"):
            Client(broker.frontend, P.new_key(), timeout=1.5)
        keyless = ctx.socket(zmq.DEALER)  # cannot complete the CURVE handshake: not heard at all
        keyless.connect(broker.backend)
        keyless.send_multipart(P.encode(ready(0).message(), KEY))
        rogue = transport_peer(ctx, broker.backend, KEY, b"rank0")  # past the handshake, signing with another key
        rogue.send_multipart(P.encode(ready(0).message(), P.new_key()))
        wait_for(lambda: broker.rejected >= 1)
        time.sleep(0.3)
        assert broker.rejected == 1
        keyless.close(0)
        assert not broker.ready
        rogue.close(0)
    finally:
        ctx.term()
        broker.close()


def test_replays_and_oversized_frames_from_the_network_are_dropped() -> None:
    """A captured 'stop' sent again reaches rank 0 once; a frame over the command limit is dropped unread, and the
    broker goes on serving (the sender is past the CURVE handshake: a keyless one is not heard at all)."""
    broker = Broker(KEY, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", JOB)
    rank0 = Link(broker.backend, KEY, "rank0", session=JOB.session_id)
    ctx = zmq.Context()
    try:
        rank0.send(ready(0).message())
        wait_for(lambda: 0 in broker.ready)
        sniffed = P.encode(P.Sender("s").stamp(Stop(id=9).message("client")), KEY)  # as a client sent it
        attacker = transport_peer(ctx, broker.frontend, KEY)
        attacker.send_multipart(sniffed)
        assert rank0.inbox.get(timeout=5).type == P.STOP
        attacker.send_multipart(sniffed)  # the replay
        wait_for(lambda: broker.rejected == 1)
        attacker.send_multipart([b"x" * (P.MAX_COMMAND + 1), b"{}"])
        time.sleep(0.5)
        assert rank0.inbox.empty() and broker.rejected == 1  # never buffered, so never even checked
        client = Client(broker.frontend, KEY)
        client.send("rank0", Run(id=10).message())
        assert rank0.inbox.get(timeout=5).body == {"id": 10, "iterations": None}
        client.close()
        attacker.close(0)
    finally:
        rank0.close()
        ctx.term()
        broker.close()


def test_a_peer_without_the_key_connecting_as_rank0_gets_no_command() -> None:
    """Under torchrun the broker forwards clients' commands to rank 0 by the name its signed messages carry: an
    intruder that cannot sign, connecting to the ranks' side under the identity ``rank0`` receives none of them."""
    broker = Broker(KEY, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", JOB)
    ctx = zmq.Context()
    intruder = transport_peer(ctx, broker.backend, KEY, b"rank0")
    intruder.send_multipart(P.encode(P.Message(P.HEARTBEAT, "rank0"), P.new_key()))
    wait_for(lambda: broker.rejected == 1)
    rank0 = Link(broker.backend, KEY, "rank0", session=JOB.session_id)
    client = Client(broker.frontend, KEY)
    try:
        rank0.send(ready(0).message())
        wait_for(lambda: broker.current is not None)
        assert client.wait_replay(5)
        for i in (1, 2):
            client.send("rank0", Run(id=i).message())
            assert rank0.inbox.get(timeout=5).body["id"] == i
        assert intruder.poll(300) == 0
    finally:
        intruder.close(0)
        ctx.term()
        client.close()
        rank0.close()
        broker.close()
