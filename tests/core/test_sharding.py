"""A sharded stage's two choices, as one value: what each means, parsed from its words."""

from __future__ import annotations

import pytest

from vpipe_lab.core.errors import PlanError
from vpipe_lab.core.sharding import Sharding


def test_each_choice_is_one_pair_of_answers() -> None:
    assert {(s.reshard_after_forward, s.reduce_per_microbatch) for s in Sharding} == {
        (False, False), (True, False), (False, True), (True, True)}
    for s in Sharding:
        assert Sharding.of(s.reshard_after_forward, s.reduce_per_microbatch) is s
    assert not Sharding.HOLD.reshard_after_forward and not Sharding.HOLD.reduce_per_microbatch
    assert Sharding.STREAM.reshard_after_forward and Sharding.STREAM.reduce_per_microbatch


def test_words_and_prefixes_parse_and_anything_else_is_refused_by_name() -> None:
    assert Sharding.parse("hold") is Sharding.HOLD and Sharding.parse(" St ") is Sharding.STREAM
    assert Sharding.parse(Sharding.SCATTER) is Sharding.SCATTER and Sharding.parse("reg") is Sharding.REGATHER
    for bad in ("s", "", "zero3", 1):  # "s" is scatter or stream
        with pytest.raises(PlanError, match=r"unknown sharding .*'hold', 'regather', 'scatter', 'stream'"):
            Sharding.parse(bad)
