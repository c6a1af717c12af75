import json

import pytest

from vpipe_lab.control.protocol import VERSION, Message, ProtocolError, decode, encode, new_key


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
    from vpipe_lab.control.protocol import _sign

    with pytest.raises(ProtocolError, match="different vpipe_lab versions"):
        decode([_sign(key.encode(), header, []), header], key)
    with pytest.raises(ProtocolError, match="needs a signature and a header"):
        decode([b"x"], key)


def test_keys_are_fresh() -> None:
    assert new_key() != new_key() and len(new_key()) == 64
