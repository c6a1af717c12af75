"""Fuzzing: the wire decoder, the plan/policy/schedule parsers and the magic's argument parser, given arbitrary input,
raise only their documented errors (never a crash, never another exception)."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vpipe_lab.core.errors import PlanError, ProfileError, ScheduleError
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.schedule import Action, Schedule
from vpipe_lab.wire.protocol import ProtocolError, ReplayGuard, decode, encode, new_key

KEY = new_key()
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=25)


@FUZZ
@given(st.lists(st.binary(max_size=200), max_size=5))
def test_the_decoder_refuses_junk_frames(frames: list[bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(frames, KEY)


@FUZZ
@given(json_values)
def test_signed_headers_of_any_shape_decode_or_raise_protocol_errors(doc: object) -> None:
    """Even a holder of the key cannot crash a receiver with a strange header."""
    from vpipe_lab.wire.protocol import _sign

    header = json.dumps(doc).encode()
    try:
        msg = decode([_sign(KEY.encode(), header, []), header], KEY)
        ReplayGuard().check(msg)  # a first message: accepted only with a positive sequence number
    except ProtocolError:
        return
    assert isinstance(msg.body, dict) and isinstance(msg.type, str) and msg.seq > 0


@FUZZ
@given(json_values)
def test_plan_from_dict_raises_only_plan_or_profile_errors(doc: object) -> None:
    for candidate in (doc, {"kind": "plan", "version": 1, **doc} if isinstance(doc, dict) else doc):
        try:
            Plan.from_dict(candidate)
        except (PlanError, ProfileError):
            pass


@FUZZ
@given(st.lists(st.integers(-3, 12), max_size=6), st.lists(st.sampled_from(["keep", "swap", "recompute", "k", "x"]),
                                                           max_size=12), st.integers(-2, 9), st.text(max_size=6))
def test_plans_of_any_numbers_validate_or_raise_plan_errors(bounds: list[int], policies: list[str], m: int,
                                                           schedule: str) -> None:
    doc = {"kind": "plan", "version": 1, "boundaries": bounds, "policies": policies, "microbatches": m,
           "schedule": schedule}
    try:
        Plan.from_dict(doc).validate()
    except (PlanError, ProfileError):
        pass


@FUZZ
@given(st.one_of(st.text(max_size=12), st.integers(), st.none(), st.floats()))
def test_policy_parse_raises_only_plan_errors(value: object) -> None:
    try:
        assert Policy.parse(value) in tuple(Policy)
    except PlanError:
        pass


@FUZZ
@given(st.text(max_size=16))
def test_schedule_actions_parse_or_raise_schedule_errors(text: str) -> None:
    try:
        Action.parse(text)
    except ScheduleError:
        pass
    try:
        Schedule.parse([text])
    except ScheduleError:
        pass


@FUZZ
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=10), max_size=6))
def test_the_magic_parser_raises_only_usage_errors(words: list[str]) -> None:
    from IPython.core.error import UsageError

    from vpipe_lab.jupyter.magics import _Done, build_parser

    parser = build_parser()
    try:
        parser.parse_args(shlex.split(shlex.join(words)))
    except (UsageError, _Done):
        pass


@FUZZ
@given(st.sampled_from(sorted(__import__("vpipe_lab.wire.codec", fromlist=["REGISTRY"]).REGISTRY)),
       st.dictionaries(st.sampled_from(["id", "rank", "stage", "plan", "iteration", "names", "layers", "spans",
                                        "memory", "ok", "error", "path", "losses", "job", "ready", "tensors"]),
                       json_values, max_size=8))
def test_any_body_of_any_type_decodes_or_is_refused_with_a_protocol_error(kind: str, body: dict[str, object]) -> None:
    """The typed decoder is all that stands between a signed header and the code that reads it."""
    from vpipe_lab.wire.codec import decode as decode_body
    from vpipe_lab.wire.protocol import Message

    try:
        decode_body(Message(kind, body=body))
    except ProtocolError:
        pass


def test_encoded_messages_round_trip() -> None:
    from vpipe_lab.wire.protocol import Message

    frames = [bytes(f) for f in encode(Message("run", body={"iterations": 3}, seq=1, sid="ab"), KEY)]
    assert decode(frames, KEY).sid == "ab"
