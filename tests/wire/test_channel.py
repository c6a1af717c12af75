import time

import zmq

from vpipe_lab.wire.channel import Hub, Link
from vpipe_lab.wire.protocol import Message, Sender, encode, new_key


def wait_for(q, timeout: float = 5.0):  # type: ignore[no-untyped-def]
    return q.get(timeout=timeout)


def test_hub_and_link_talk_both_ways() -> None:
    key = new_key()
    hub = Hub(key)
    link = Link(hub.address, key, "rank0")
    try:
        link.send(Message("hello", body={"rank": 0}))
        got = wait_for(hub.inbox)
        assert got.type == "hello" and got.src == "rank0"
        hub.send("rank0", Message("run", body={"iterations": 3}))
        cmd = wait_for(link.inbox)
        assert cmd.type == "run" and cmd.body == {"iterations": 3}
        assert "rank0" in hub.peers
    finally:
        link.close()
        hub.close()


def test_hub_drops_messages_without_the_key() -> None:
    hub = Hub(new_key())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.connect(hub.address)
    try:
        sock.send_multipart(encode(Message("stop"), new_key()))
        deadline = time.monotonic() + 5
        while hub.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hub.rejected == 1 and hub.inbox.empty() and "intruder" not in hub.peers
    finally:
        sock.close(0)
        ctx.term()
        hub.close()


def test_a_captured_message_sent_again_is_refused() -> None:
    """Frames a link sent, captured and sent again by someone else, are rejected by sequence number."""
    key = new_key()
    hub = Hub(key)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"rank0")
    sock.connect(hub.address)
    try:
        sender = Sender()
        frames = encode(sender.stamp(Message("hello", "rank0", {"rank": 0})), key)
        sock.send_multipart(frames)
        assert wait_for(hub.inbox).type == "hello"
        sock.send_multipart(frames)  # the replay
        deadline = time.monotonic() + 5
        while hub.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hub.rejected == 1 and hub.inbox.empty()
    finally:
        sock.close(0)
        ctx.term()
        hub.close()



def test_a_handler_gets_what_arrived_before_it_and_drain_takes_everything_waiting() -> None:
    key = new_key()
    hub = Hub(key)
    link = Link(hub.address, key, "rank0")
    try:
        link.send(Message("hello", body={"rank": 0}))
        wait_deadline = time.monotonic() + 5
        while hub.inbox.empty() and time.monotonic() < wait_deadline:
            time.sleep(0.02)
        seen: list[str] = []
        hub.set_handler(lambda m: seen.append(m.type))
        link.send(Message("ready", body={"rank": 0}))
        while len(seen) < 2 and time.monotonic() < wait_deadline:
            time.sleep(0.02)
        assert seen == ["hello", "ready"]  # the early message first, then the handler on the hub's thread
        t0 = time.monotonic()
        assert link.drain(0.2) == [] and time.monotonic() - t0 >= 0.15  # nothing: waits up to its limit
        for n in range(3):
            hub.send("rank0", Message("run", body={"n": n}))
        got = link.drain(5.0)  # waits for the first, takes whatever else has arrived by then
        assert got and got[0].body["n"] == 0
        while len(got) < 3 and time.monotonic() < wait_deadline + 5:
            got += link.drain(0.5)
        assert [m.body["n"] for m in got] == [0, 1, 2]  # in order, none lost
    finally:
        link.close()
        hub.close()


def test_a_peer_without_the_key_cannot_take_a_worker_s_route_by_its_name() -> None:
    """An intruder connecting under a worker's name (its routing identity) before and after the worker gets none of
    the worker's frames: routes follow signed messages only, and the worker keeps receiving."""
    key = new_key()
    hub = Hub(key)
    ctx = zmq.Context()
    early = ctx.socket(zmq.DEALER)
    early.setsockopt(zmq.IDENTITY, b"rank0")
    early.connect(hub.address)
    early.send_multipart(encode(Message("hello", "rank0"), new_key()))  # no key: it cannot say it is rank0
    link = Link(hub.address, key, "rank0")
    late = ctx.socket(zmq.DEALER)
    late.setsockopt(zmq.IDENTITY, b"rank0")
    late.connect(hub.address)
    try:
        link.send(Message("hello", body={"rank": 0}))
        assert wait_for(hub.inbox).type == "hello"
        late.send_multipart(encode(Message("hello", "rank0"), new_key()))
        time.sleep(0.3)
        for i in range(3):
            hub.send("rank0", Message("run", body={"iterations": i}))
            assert wait_for(link.inbox).body == {"iterations": i}
        for intruder in (early, late):
            assert intruder.poll(200) == 0  # nothing meant for rank0 reached it
        # the early intruder's frames were rejected; the late one's identity was taken (ZeroMQ ignores a duplicate)
        assert hub.rejected >= 1 and set(hub.peers) == {"rank0"}
    finally:
        early.close(0)
        late.close(0)
        ctx.term()
        link.close()
        hub.close()
