import time

import zmq

from tests.wire.peers import transport_peer
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


def test_a_peer_without_the_key_is_not_heard_and_a_wrong_signature_is_dropped() -> None:
    """Without the key a peer cannot complete the CURVE handshake: nothing it sends is read (not even rejected);
    past the handshake, a message signed with another key is dropped."""
    key = new_key()
    hub = Hub(key)
    ctx = zmq.Context()
    keyless = ctx.socket(zmq.DEALER)
    keyless.setsockopt(zmq.IDENTITY, b"intruder")
    keyless.connect(hub.address)
    inside = transport_peer(ctx, hub.address, key, b"forger")
    try:
        keyless.send_multipart(encode(Message("stop", "intruder"), key))  # even correctly signed: never read
        inside.send_multipart(encode(Message("stop", "forger"), new_key()))
        deadline = time.monotonic() + 5
        while hub.rejected == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        assert hub.rejected == 1 and hub.inbox.empty() and not hub.peers
    finally:
        keyless.close(0)
        inside.close(0)
        ctx.term()
        hub.close()


def test_a_captured_message_sent_again_is_refused() -> None:
    """Frames a link sent, captured and sent again by someone else, are rejected by sequence number."""
    key = new_key()
    hub = Hub(key)
    ctx = zmq.Context()
    sock = transport_peer(ctx, hub.address, key, b"rank0")
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


def test_a_peer_that_cannot_sign_cannot_take_a_worker_s_route_by_its_name() -> None:
    """An intruder connecting under a worker's name (its routing identity) before and after the worker gets none of
    the worker's frames: routes follow signed messages only, and the worker keeps receiving."""
    key = new_key()
    hub = Hub(key)
    ctx = zmq.Context()
    early = transport_peer(ctx, hub.address, key, b"rank0")  # past the handshake (a keyless one is not heard)
    early.send_multipart(encode(Message("hello", "rank0"), new_key()))  # no key: it cannot say it is rank0
    link = Link(hub.address, key, "rank0")
    late = transport_peer(ctx, hub.address, key, b"rank0")
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


FLOOD = """
import sys, time, zmq
ctx = zmq.Context()
socks = []
for _ in range(2):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    sock.connect(sys.argv[1])
    socks.append(sock)
frame = b"x" * (256 << 20)
for sock in socks:
    try:
        sock.send_multipart([frame, b"{}"], copy=False)
    except zmq.Again:
        pass
print("sent", flush=True)
time.sleep(6)
"""


def test_keyless_peers_sending_huge_frames_make_the_controller_hold_nothing() -> None:
    """Two connections without the key each send a 256 MiB frame (under the controller's per-frame limit): the
    handshake they cannot complete comes first, so the controller's memory does not grow by them, and a worker with
    the key is heard meanwhile."""
    import subprocess
    import sys

    import psutil

    key = new_key()
    hub = Hub(key)
    me = psutil.Process()
    before = me.memory_info().rss
    attacker = subprocess.Popen([sys.executable, "-c", FLOOD, hub.address], stdout=subprocess.PIPE, text=True)
    link = Link(hub.address, key, "rank0")
    try:
        assert attacker.stdout is not None and attacker.stdout.readline().strip() == "sent"
        most = before
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            most = max(most, me.memory_info().rss)
            time.sleep(0.05)
        assert most - before < 64 << 20, f"the controller grew by {(most - before) >> 20} MiB"
        link.send(Message("hello", body={"rank": 0}))
        assert wait_for(hub.inbox).src == "rank0" and hub.rejected == 0
    finally:
        attacker.kill()
        attacker.wait(10)
        link.close()
        hub.close()
