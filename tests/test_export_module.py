"""``vpipe_lab.export``: the bundle's API without torch (writing and reading a bundle imports no torch) and
``torch_pipeline`` when called."""

from __future__ import annotations

import subprocess
import sys


def test_bundles_need_no_torch_and_torch_pipeline_is_torchs() -> None:
    code = ("import sys, vpipe_lab.export as e; assert 'torch' not in sys.modules; "
            "from vpipe_lab.runtime.torch_pp.pipeline import torch_pipeline; assert callable(e.torch_pipeline)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_pipeline_shows_its_real_signature_in_help() -> None:
    """help() shows the parameters (was ``*args, **kwargs``), the same names, kinds and defaults as the function it
    calls, so the two cannot drift apart."""
    import inspect

    import vpipe_lab.export as e
    from vpipe_lab.runtime.torch_pp.pipeline import torch_pipeline

    ours, theirs = inspect.signature(e.torch_pipeline), inspect.signature(torch_pipeline)
    assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
        (p.name, p.kind, p.default) for p in theirs.parameters.values()]
    assert "example" in (e.torch_pipeline.__doc__ or "") and "model" in str(ours)
