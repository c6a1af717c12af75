"""The bundled examples: named without importing torch, and their declared unit counts are what the workers cut."""

from __future__ import annotations

import subprocess
import sys

import pytest

from vpipe_lab import examples


def test_checking_a_name_imports_nothing() -> None:
    code = ("import sys; from vpipe_lab import examples; examples.check('gpt-tiny'); examples.check_stages('mlp', 3);"
            " print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == \
        "False"


def test_unknown_names_and_unfillable_stage_counts_say_what_works() -> None:
    with pytest.raises(ValueError, match="unknown example 'gpt-huge': bundled examples are mlp, gpt-tiny, moe-tiny"):
        examples.check("gpt-huge")
    with pytest.raises(ValueError, match=r"'gpt-tiny' has 8 partition units.*at most 8 stages, not 20.*between 1 and 8"):
        examples.check_stages("gpt-tiny", 20)
    examples.check_stages("gpt-tiny", 8)


@pytest.mark.parametrize("name", list(examples.EXAMPLES))
def test_declared_units_are_the_units_the_workers_cut(name: str) -> None:
    from vpipe_lab.runtime.build import unit_names

    bundled = examples.get(name)
    assert bundled.description == examples.EXAMPLES[name].description
    names = unit_names(bundled.model, None, 0, lambda: bundled.data(0)[0])
    assert len(names) == examples.EXAMPLES[name].units
