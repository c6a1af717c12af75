"""The zoo's decoder language models (transformers), each trained on 2 stages with the default cut, equal to one
process: every loss, parameter and buffer (``tests/models/zoo.py``; the table is in docs/models.md)."""

from __future__ import annotations

import pytest

from tests.models.zoo import check

pytestmark = [pytest.mark.slow, pytest.mark.models]


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2", "mistral", "gpt-neox", "opt"])
def test_decoder_trains_as_one_process(name: str) -> None:
    names = check(name)
    assert len(names) == 6 and names[1].endswith(".0")  # embedding, four layers, head: cut between the layers
