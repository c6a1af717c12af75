import json

import pytest

from vpipe_lab.wire.protocol import (
    VERSION,
    Message,
    ProtocolError,
    RateLimitedLog,
    ReplayGuard,
    Sender,
    decode,
    encode,
    new_key,
)


def test_round_trip_with_buffers() -> None:
    key = new_key()
    frames = encode(Message("iteration", "rank1", {"loss": 1.5, "nan": float("nan")}, [b"abc", b"\x00\x01"], 7), key)
    msg = decode([bytes(f) for f in frames], key)
    assert msg.type == "iteration" and msg.src == "rank1" and msg.seq == 7 and msg.body["loss"] == 1.5
    assert msg.buffers == [b"abc", b"\x00\x01"]


def test_wrong_key_tampering_and_versions_are_rejected() -> None:
    key = new_key()
    frames = [bytes(f) for f in encode(Message("run", body={"iterations": 1}), key)]
    with pytest.raises(ProtocolError, match="bad signature"):
        decode(frames, new_key())
    tampered = [frames[0], frames[1].replace(b"1", b"9")]
    with pytest.raises(ProtocolError, match="bad signature"):
        decode(tampered, key)
    header = json.dumps({"v": VERSION + 1, "type": "x", "body": {}}).encode()
    from vpipe_lab.wire.protocol import _sign

    with pytest.raises(ProtocolError, match="different vpipe_lab versions"):
        decode([_sign(key.encode(), header, []), header], key)
    with pytest.raises(ProtocolError, match="needs a signature and a header"):
        decode([b"x"], key)


def test_keys_are_fresh() -> None:
    assert new_key() != new_key() and len(new_key()) == 64


def test_a_replayed_or_reordered_message_is_refused() -> None:
    key = new_key()
    sender, guard = Sender(), ReplayGuard()
    first = [bytes(f) for f in encode(sender.stamp(Message("stop", "client")), key)]
    second = [bytes(f) for f in encode(sender.stamp(Message("run", "client")), key)]
    guard.check(decode(first, key))
    guard.check(decode(second, key))
    with pytest.raises(ProtocolError, match=r"replayed or reordered message: 'stop' from 'client' has sequence "
                                            r"number 1, not newer than 2"):
        guard.check(decode(first, key))
    other = Sender()  # another endpoint with the same name keeps its own count
    guard.check(decode([bytes(f) for f in encode(other.stamp(Message("stop", "client")), key)], key))
    assert sender.sid != other.sid


def test_rejections_are_logged_at_a_bounded_rate(caplog: pytest.LogCaptureFixture) -> None:
    import logging

    log = RateLimitedLog(logging.getLogger("vpipe_lab.test"), period_s=60)
    with caplog.at_level(logging.WARNING, logger="vpipe_lab.test"):
        for i in range(2000):
            log.warning("rejected junk %d", i)
    assert len(caplog.records) == 1


def test_a_message_from_another_session_with_the_same_key_is_refused() -> None:
    key = new_key()
    guard = ReplayGuard("job-b", exempt=frozenset({"attach"}))
    captured = decode([bytes(f) for f in encode(Sender("job-a").stamp(Message("stop", "client")), key)], key)
    with pytest.raises(ProtocolError, match="for session 'job-a' reached session 'job-b'"):
        guard.check(captured)
    guard.check(decode([bytes(f) for f in encode(Sender().stamp(Message("attach", "client")), key)], key))
    guard.check(decode([bytes(f) for f in encode(Sender("job-b").stamp(Message("stop", "client")), key)], key))
