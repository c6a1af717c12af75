"""The zoo's encoders and encoder-decoders (transformers), each trained on 2 stages with the default cut, equal to
one process. ALBERT's one layer group, called at every depth, is cut between its calls, its weights tied across the
stages that hold them."""

from __future__ import annotations

import pytest

from tests.models.zoo import check

pytestmark = [pytest.mark.slow, pytest.mark.models]


@pytest.mark.parametrize("name", ["bert", "roberta", "albert", "t5", "bart"])
def test_encoder_trains_as_one_process(name: str) -> None:
    names = check(name)
    assert len(names) == 6
    if name == "albert":
        assert names[2] == "albert.encoder.albert_layer_groups.0@1"
