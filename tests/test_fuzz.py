"""Fuzzing: the wire decoder, the plan/policy/schedule parsers and the magic's argument parser, given arbitrary input,
raise only their documented errors (never a crash, never another exception)."""

from __future__ import annotations

import copy
import json
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vpipe_lab.core.errors import PlanError, ProfileError, ScheduleError
from vpipe_lab.core.plan import Plan, Policy
from vpipe_lab.core.schedules.actions import Action, Schedule
from vpipe_lab.wire import commands, events  # noqa: F401  (their body classes fill the codec's registry)
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


def _bundle_doc() -> dict[str, object]:
    from vpipe_lab.core.interop.bundle import UnitInfo, make

    units = [UnitInfo("embed", ("embed",), "pre"), *(UnitInfo(f"b{i}", (f"blocks.{i}",), "block:Block")
                                                      for i in range(3)), UnitInfo("head", ("head",), "post")]
    return make(Plan((0, 1, 2, 3, 4, 5), tuple("kkrsk"), 4, "interleaved-1f1b", 2), units,
                microbatch_size=2).to_dict()


def _paths(doc: object, at: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every place in a JSON document a value sits, to put another value there."""
    out = [at]
    if isinstance(doc, dict):
        out += [p for k, v in doc.items() for p in _paths(v, (*at, k))]
    elif isinstance(doc, list):
        out += [p for i, v in enumerate(doc) for p in _paths(v, (*at, i))]
    return out


BUNDLE_PATHS = _paths(_bundle_doc())


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(BUNDLE_PATHS), json_values | st.integers() | st.sampled_from(
    ["../../x.csv", "/etc/passwd", "a/b.csv", "", 10**12, -1, None, [], {}])), min_size=1, max_size=3))
def test_any_edit_of_a_pipeline_json_reads_back_or_is_refused_in_one_line(edits: list[tuple[tuple[object, ...], object]]
                                                                         ) -> None:
    """pipeline.json from someone else: whatever was changed in it, reading it gives a Bundle or one ProfileError
    line, and a Bundle read is one the lab can write again (schedule_csv inside the bundle, micro-batches bounded)."""
    import tempfile
    from pathlib import Path

    from vpipe_lab.wire import bundle_files as bundle

    doc: object = _bundle_doc()
    for path, value in edits:
        value = copy.deepcopy(value)  # sampled_from hands out the same [] or {} twice: one put inside the other loops
        if not path:
            doc = value
            continue
        node = doc
        try:
            for key in path[:-1]:
                node = node[key]  # type: ignore[index]
            node[path[-1]] = value  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit changed the shape above this place
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pipeline.json").write_text(json.dumps(doc))
        try:
            read = bundle.read(tmp)
        except ProfileError as exc:
            assert "\n" not in str(exc) and len(str(exc)) < 600
            return
        assert bundle.csv_path(tmp, read).parent == Path(tmp)
        assert read.microbatches <= 16384
        bundle.write(Path(tmp) / "again", read)


@FUZZ
@given(st.text(max_size=60) | st.sampled_from(["[" * 3000, "{" * 3000, '{"kind": "plan"' + "0" * 5000 + "}"]))
def test_a_plan_document_of_any_text_is_a_plan_or_one_profile_error(text: str) -> None:
    try:
        Plan.from_json(text if text.lstrip().startswith("{") else "{" + text)
    except (PlanError, ProfileError) as exc:
        assert "\n" not in str(exc)


class _Launched(Exception):
    """Raised instead of starting workers: the line passed every check before the launch."""


def _words(command: str) -> st.SearchStrategy[list[str]]:
    from vpipe_lab.jupyter.magics import build_parser, subcommands

    options = sorted(o for o in subcommands(build_parser())[command]._option_string_actions if o.startswith("--"))
    token: st.SearchStrategy[str] = st.sampled_from(options) if options else st.nothing()
    value = st.sampled_from(["mlp", "gpt-tiny", "-5", "0", "3", "1e99", "nan", "-1", "forever", "banana", "1f1b",
                             "zbv", "/nonexistent/dir/x.json", "../..", "3=swap", "x=y", "2GB", "'", '"'])
    return st.lists(token | value | st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
                    max_size=6)


@FUZZ
@given(st.sampled_from(__import__("vpipe_lab.jupyter.magics", fromlist=["COMMANDS"]).COMMANDS).flatmap(
    lambda c: _words(c).map(lambda ws: [c, *ws])), st.booleans())
def test_any_magic_line_without_a_session_is_done_or_one_usage_error(words: list[str], quote: bool) -> None:
    """Every %vpipe line a user can type: it is done, or one UsageError line says why; a start whose line passes
    every check reaches launch() (which this test stops there), and nothing else escapes as a traceback."""
    import contextlib
    import os
    import tempfile
    from unittest import mock

    from IPython.core.error import UsageError
    from IPython.testing import globalipapp

    from vpipe_lab.jupyter.magics import VpipeMagics

    shell = globalipapp.start_ipython() or globalipapp.get_ipython()
    magics = VpipeMagics(shell)
    line = shlex.join(words) if quote else " ".join(words)
    cwd = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(None), \
            mock.patch("vpipe_lab.control.launch.launch", side_effect=_Launched), \
            mock.patch("vpipe_lab.control.sessions.latest", return_value=None):
        os.chdir(tmp)  # a line that writes a file writes it here
        try:
            magics.vpipe(line)
        except UsageError as exc:
            assert str(exc).strip(), line
        except _Launched:
            assert words[0] == "start"
        finally:
            os.chdir(cwd)


TITAN_KEYS = ["pipeline_parallel_degree", "pipeline_parallel_schedule", "module_fqns_per_model_part",
              "pipeline_parallel_microbatch_size", "pipeline_parallel_layers_per_stage",
              "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
              "pipeline_parallel_schedule_csv"]


@FUZZ
@given(st.dictionaries(st.sampled_from(TITAN_KEYS), json_values | st.sampled_from(
    [2, 4, "1F1B", "Interleaved1F1B", "ZBVZeroBubble", [["embed", "blocks.0"], ["blocks.1", "blocks.2", "head"]]]),
    max_size=6), st.one_of(st.none(), st.integers(-2, 16)), st.one_of(st.none(), st.integers(-2, 64)))
def test_a_torchtitan_config_of_any_values_is_a_plan_or_one_plan_error(par: dict[str, object], m: int | None,
                                                                      batch: int | None) -> None:
    """An imported production config: whatever its values, a plan or a PlanError line, never a TypeError."""
    from vpipe_lab.core.interop import torchtitan
    from vpipe_lab.core.interop.bundle import UnitInfo

    units = [UnitInfo("embed", ("embed",), "pre"), *(UnitInfo(f"b{i}", (f"blocks.{i}",), "block:Block")
                                                      for i in range(3)), UnitInfo("head", ("head",), "post")]
    try:
        torchtitan.read(par, units, batch_size=batch, microbatches=m, csv_text="")
    except (PlanError, ProfileError, ScheduleError) as exc:
        assert "\n" not in str(exc)


@FUZZ
@given(st.text(alphabet="Et|L*0123456789 (),-m", max_size=24), st.integers(-1, 5), st.integers(-1, 9))
def test_a_megatron_layout_of_any_text_is_a_plan_or_one_plan_error(layout: str, ranks: int, m: int) -> None:
    from vpipe_lab.core.interop import megatron
    from vpipe_lab.core.interop.bundle import UnitInfo

    units = [UnitInfo("embed", ("embed",), "pre"), *(UnitInfo(f"b{i}", (f"blocks.{i}",), "block:Block")
                                                      for i in range(4)), UnitInfo("head", ("head",), "post")]
    try:
        megatron.plan_from_layout(layout, ranks, units, microbatches=m)
    except (PlanError, ProfileError, ScheduleError) as exc:
        assert "\n" not in str(exc)
