"""Typed bodies: what is sent is what is read, and a malformed body is refused naming the message and the field."""

from __future__ import annotations

import json

import pytest

from vpipe_lab.wire.codec import REGISTRY, decode, from_doc
from vpipe_lab.wire.commands import Apply, Run, SetModel
from vpipe_lab.wire.events import Ack, Evaluated, IterationReport, Refusal, Tensors, Welcome
from vpipe_lab.wire.protocol import Message, ProtocolError, encode, new_key
from vpipe_lab.wire.protocol import decode as decode_frames


def through_the_wire(msg: Message) -> Message:
    key = new_key()
    return decode_frames([bytes(f) for f in encode(msg, key)], key)


def test_a_body_survives_signing_and_json() -> None:
    sent = Ack(3, "apply", 7, ok=False, error="no", refused=Refusal(1, 10, 5))
    got = decode(through_the_wire(sent.message("rank0")))
    assert got == sent and isinstance(got, Ack) and isinstance(got.refused, Refusal)


def test_ints_are_accepted_for_floats_and_tuples_come_back_as_tuples() -> None:
    doc = {"iteration": 1, "stage": 0, "start": 1, "end": 2, "losses": [1, 2.5], "memory": {}, "microbatches": 2,
           "spans": [[0, 1, -1, 0, 1, 1]]}
    got = decode(Message("iteration", body=doc))
    assert isinstance(got, IterationReport) and got.start == 1.0 and isinstance(got.start, float)
    assert got.spans == [(0, 1, -1, 0.0, 1.0, 1)] and isinstance(got.spans[0][0], int)


@pytest.mark.parametrize(("body", "message"), [
    ({"id": 1, "iterations": "3"}, r"run\.iterations must be a whole number, got '3'"),
    ({"id": True}, r"run\.id must be a whole number, got True"),
    ({"id": 1, "iteration": 3}, r"unknown field\(s\) \['iteration'\]"),
])
def test_malformed_commands_are_refused_naming_the_field(body: dict[str, object], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(Message("run", body=body))


def test_missing_fields_and_unknown_types_are_named() -> None:
    with pytest.raises(ProtocolError, match=r"apply\.plan is missing \(an object\)"):
        decode(Message("apply", body={"id": 1}))
    with pytest.raises(ProtocolError, match="unknown message type 'teleport'"):
        decode(Message("teleport", body={}))
    with pytest.raises(ProtocolError, match=r"model\.mapping\['3'\] must be a whole number, got 'x'"):
        decode(Message("model", body={"path": "p", "mapping": {"3": "x"}}))
    with pytest.raises(ProtocolError, match=r"welcome\.job\.session_id is missing"):
        decode(Message("welcome", body={"job": {}, "ready": [], "current": None, "replay": 0}))


def test_raw_buffers_travel_as_frames_not_json() -> None:
    msg = Tensors(1, 0, [], [b"abc", b"de"]).message()
    assert msg.buffers == [b"abc", b"de"] and "buffers" not in msg.body
    got = decode(through_the_wire(msg))
    assert isinstance(got, Tensors) and got.buffers == [b"abc", b"de"]


def test_commands_broadcast_as_documents_come_back_as_the_same_commands() -> None:
    sent = [Run(id=1, iterations=None), Apply({"kind": "plan"}, id=2, version=3), SetModel("f", mapping={"0": None})]
    docs = json.loads(json.dumps([c.to_doc() for c in sent]))
    assert [from_doc(d) for d in docs] == sent
    with pytest.raises(ProtocolError, match="needs a string 'type'"):
        from_doc({"id": 1})


def test_every_message_type_has_one_body_class() -> None:
    from vpipe_lab.wire import protocol as P

    names = {v for k, v in vars(P).items() if k.isupper() and isinstance(v, str) and k not in ("VERSION",)}
    assert names <= set(REGISTRY), f"message types without a body class: {sorted(names - set(REGISTRY))}"
    assert REGISTRY["evaluated"] is Evaluated and REGISTRY["welcome"] is Welcome


def test_a_core_value_type_travels_as_its_fields_and_is_checked_by_its_own_rules() -> None:
    from vpipe_lab.core.profile import LayerCost
    from vpipe_lab.wire.events import LayerMeasure

    cost = LayerCost("h.0", 0.1, 0.2, 64, 8, 8, 32, 16, ((2, 0.05, 0.1),), 0.07)
    body = LayerMeasure(3, cost, 5)
    doc = body.to_dict()
    assert doc["cost"]["times"] == [[2, 0.05, 0.1]] and LayerMeasure.from_dict(doc) == body
    with pytest.raises(ProtocolError, match=r"LayerMeasure\.cost\.forward_s must be a number, got 'fast'"):
        LayerMeasure.from_dict({**doc, "cost": {**doc["cost"], "forward_s": "fast"}})
    with pytest.raises(ProtocolError, match=r"LayerMeasure\.cost has unknown field\(s\) \['speed'\] for a LayerCost"):
        LayerMeasure.from_dict({**doc, "cost": {**doc["cost"], "speed": 1}})
    with pytest.raises(ProtocolError, match=r"LayerMeasure\.cost\.name is missing \(a string\)"):
        LayerMeasure.from_dict({**doc, "cost": {k: v for k, v in doc["cost"].items() if k != "name"}})
    with pytest.raises(ProtocolError, match=r"LayerMeasure\.cost: layer 'h\.0': times entries are"):
        LayerMeasure.from_dict({**doc, "cost": {**doc["cost"], "times": [[0, 0.1, 0.1]]}})
